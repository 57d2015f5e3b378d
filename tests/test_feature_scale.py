"""Training ``fc`` on scaled target features: the scale, the reparametrisation, its fold on save, resume.

A head trained with :meth:`DSparkHead.scale_target_features` must (1) train exactly as a head fed
the scaled features would, (2) save as a plain speculators head whose ``fc.weight`` is the folded
product, with the same logits before and after saving, and (3) resume bit for bit. The speculators
side of (2) is in ``test_speculators_interop.py`` (the "feature-scaled" case).
"""

import pytest
import torch
from conftest import tiny_head, tiny_target
from test_training import dataset, settings
from test_training import tiny_head as training_head
from test_training import tiny_target as training_target

from spark_generate.heads import DSparkHead
from spark_generate.training import Trainer
from spark_generate.training.initialization import feature_scale, feature_scale_from_target


def scaled_head(seed: int = 3):
    target = tiny_target()
    head = tiny_head(target)
    generator = torch.Generator().manual_seed(seed)
    head.scale_target_features(torch.rand(head.fc.in_features, generator=generator) * 4 + 0.1)
    return target, head


def backbone_logits(head: DSparkHead, features: torch.Tensor) -> torch.Tensor:
    block = head.block_input_ids(torch.tensor([3, 5]))
    anchors = torch.full((2, 1), features.shape[1])
    with torch.no_grad():
        return head(block, anchors, target_hidden_states=features).base_logits


def test_a_scaled_head_saves_the_folded_weight_and_the_same_logits(tmp_path):
    target, head = scaled_head()
    features = torch.randn(2, 6, head.fc.in_features, generator=torch.Generator().manual_seed(0)) * 30
    before = backbone_logits(head, features)
    head.save_pretrained(tmp_path)
    loaded = DSparkHead.from_pretrained(tmp_path).attach(target).eval()
    assert loaded.target_feature_scale is None  # a plain head, as speculators reads it
    assert torch.equal(loaded.fc.weight, head.fc.weight.detach())
    assert torch.equal(backbone_logits(loaded, features), before)
    unscaled = tiny_head(target)  # same seed: the weight W that was scaled
    assert not torch.allclose(unscaled.fc.weight, loaded.fc.weight)
    expected = unscaled.fc.weight * head.target_feature_scale
    assert torch.equal(loaded.fc.weight, expected)


def test_the_reparametrisation_trains_as_scaled_inputs_would():
    target, head = scaled_head()
    scale = head.target_feature_scale
    plain = tiny_head(target)  # the same W, fed scale ⊙ x instead
    features = torch.randn(2, 6, head.fc.in_features, generator=torch.Generator().manual_seed(1)) * 30
    block = head.block_input_ids(torch.tensor([3, 5]))
    anchors = torch.full((2, 1), 6)
    outputs = []
    for model, inputs in ((head, features), (plain, features * scale)):
        out = model(block, anchors, target_hidden_states=inputs).base_logits
        out.square().mean().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    raw_grad = head.fc.parametrizations.weight.original.grad
    torch.testing.assert_close(raw_grad, plain.fc.weight.grad, rtol=1e-4, atol=1e-6)


def test_scale_is_one_over_channel_rms_without_the_first_position():
    documents = [torch.tensor([[1000.0, 1000.0, 5.0, 5.0], [3.0, 0.0, 1.0, 4.0], [4.0, 0.0, 1.0, 3.0]])]
    scale = feature_scale(documents, num_taps=2)
    rms = torch.tensor([(12.5) ** 0.5, 0.0, 1.0, 12.5**0.5])
    # The all-zero channel gets the floor: one thousandth of the median RMS.
    floor = rms[rms > 0].median() * 1e-3
    torch.testing.assert_close(scale, 1 / rms.clamp(min=floor.item()))
    per_tap = feature_scale(documents, num_taps=2, kind="tap")
    tap_rms = torch.tensor([(12.5 / 2) ** 0.5, ((1 + 12.5) / 2) ** 0.5])
    torch.testing.assert_close(per_tap, (1 / tap_rms).repeat_interleave(2))


def test_bad_scales_and_inputs_are_refused():
    target = tiny_target()
    head = tiny_head(target)
    with pytest.raises(ValueError, match="finite positive"):
        head.scale_target_features(torch.zeros(head.fc.in_features))
    with pytest.raises(ValueError, match=f"expected {head.fc.in_features} finite"):
        head.scale_target_features(torch.ones(3))
    head.scale_target_features(torch.ones(head.fc.in_features))
    with pytest.raises(ValueError, match="applied once"):
        head.scale_target_features(torch.ones(head.fc.in_features))
    with pytest.raises(ValueError, match="kind="):
        feature_scale([torch.ones(3, 4)], num_taps=2, kind="position")
    with pytest.raises(ValueError, match="no feature rows"):
        feature_scale([torch.ones(1, 4)], num_taps=2)


def scaled_training_head(target):
    head = training_head(target)
    layer_ids = head.config.target_layer_ids
    head.scale_target_features(feature_scale_from_target(target, layer_ids, dataset(), range(3)))
    return head


def test_a_scaled_run_resumes_bit_for_bit(tmp_path):
    straight_target = training_target()
    straight = scaled_training_head(straight_target)
    Trainer(straight, straight_target, dataset(), settings(tmp_path / "straight")).train()

    target = training_target()
    half = Trainer(scaled_training_head(target), target, dataset(), settings(tmp_path / "split")).train(stop_after=2)
    resumed = training_head(target)  # fresh weights and another scale, both overwritten by the checkpoint
    resumed.scale_target_features(torch.ones(resumed.fc.in_features))
    Trainer(resumed, target, dataset(), settings(tmp_path / "split")).train(resume_from=half.checkpoint)
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name

    unscaled = training_head(target)
    with pytest.raises(ValueError, match="trained on scaled features"):
        Trainer(unscaled, target, dataset(), settings(tmp_path / "split")).train(resume_from=half.checkpoint)
