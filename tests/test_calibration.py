"""STS calibration: the fit on synthetic miscalibrated confidences, and end to end with real decoding.

Synthetic: prefix survivals drawn from ``σ(z / 3)`` per position make raw logits ``z`` overconfident
by a temperature of 3; STS must find temperatures near 3 and lower the ECE, without a warning.
Miscalibration beyond the grid (a temperature of 100 or 1/50) ends on a bound and warns, naming the
slots. End to end: a tiny
random target and a head whose confidence logits are scaled up (deliberately overconfident) are
calibrated on real speculative decoding, and the JSON is read back by ``load_calibration``.
"""

import json
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spark_generate.heads import DSparkHead
from spark_generate.schedule import load_calibration
from spark_generate.training.calibration import (
    CalibrationData,
    CalibrationWarning,
    brier_score,
    collect_calibration_data,
    expected_calibration_error,
    fit_sts,
    plot_reliability,
)


def test_ece_by_hand():
    probabilities = torch.tensor([0.1, 0.1, 0.9, 0.9], dtype=torch.float64)
    outcomes = torch.tensor([0, 0, 1, 0])
    # Bin of 0.1: predicted 0.1, observed 0 -> 0.1 * 2/4; bin of 0.9: 0.9 vs 0.5 -> 0.4 * 2/4.
    assert expected_calibration_error(probabilities, outcomes) == pytest.approx(0.25)


def test_brier_by_hand():
    probabilities = torch.tensor([[0.9, 0.5], [0.2, 0.5]])
    outcomes = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    expected = torch.tensor([(0.01 + 0.04) / 2, (0.25 + 0.25) / 2], dtype=torch.float64)
    torch.testing.assert_close(brier_score(probabilities, outcomes), expected)


def synthetic(num_steps: int, temperature: float, seed: int) -> CalibrationData:
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_steps, 4, generator=generator, dtype=torch.float64) * 4 + 2
    accepted = torch.rand(num_steps, 4, generator=generator, dtype=torch.float64) < torch.sigmoid(logits / temperature)
    num_accepted = accepted.long().cumprod(dim=-1).sum(-1)
    return CalibrationData(logits, num_accepted)


def test_sts_recovers_the_temperature_of_overconfident_logits():
    with warnings.catch_warnings():
        warnings.simplefilter("error", CalibrationWarning)  # inside the grid: no warning
        result = fit_sts(synthetic(20_000, temperature=3.0, seed=0))
    assert (result.ece_after < result.ece_before).all()
    assert result.ece_after.max() < 0.03 < result.ece_before.min()
    assert (result.brier_after < result.brier_before).all()
    torch.testing.assert_close(result.temperatures, torch.full((4,), 3.0, dtype=torch.float64), rtol=0.2, atol=0)
    held_out = synthetic(20_000, temperature=3.0, seed=1)
    cumulative = torch.sigmoid(held_out.confidence_logits / result.temperatures).cumprod(-1)
    raw = torch.sigmoid(held_out.confidence_logits).cumprod(-1)
    for k in range(4):
        after = expected_calibration_error(cumulative[:, k], held_out.survived[:, k])
        assert after < expected_calibration_error(raw[:, k], held_out.survived[:, k])


def test_temperatures_on_a_grid_bound_are_a_warning_naming_the_slots():
    with pytest.warns(
        CalibrationWarning, match=r"slots 1, 2, 3, 4 at the upper bound T=8 \(prefix survived in"
    ) as caught:
        result = fit_sts(synthetic(4_000, temperature=100.0, seed=1))
    assert result.temperatures.tolist() == [8.0] * 4
    assert "too little data" in str(caught[0].message) and "miscalibrated beyond" in str(caught[0].message)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4_000, 4, generator=generator, dtype=torch.float64) * 0.2  # underconfident by 50x
    accepted = torch.rand(4_000, 4, generator=generator, dtype=torch.float64) < torch.sigmoid(logits * 50)
    with pytest.warns(CalibrationWarning, match="slot 1 at the lower bound T=0.125"):
        result = fit_sts(CalibrationData(logits, accepted.long().cumprod(dim=-1).sum(-1)))
    assert result.temperatures[0] == 0.125


def test_no_steps_is_a_clear_error():
    with pytest.raises(ValueError, match="no speculative steps"):
        fit_sts(CalibrationData(torch.zeros(0, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.long)))


def tiny_target_and_head() -> tuple[LlamaForCausalLM, DSparkHead]:
    """A random 3-layer Llama over 32 tokens and an untrained head with blocks of 3."""
    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, num_draft_layers=1, markov_rank=4, block_size=3, mask_token_id=0).eval()
    return target, head


def test_calibration_on_real_decoding_lowers_ece_and_writes_the_schedule_file(tmp_path):
    target, head = tiny_target_and_head()
    with torch.no_grad():  # deliberately overconfident: logits around +6 for drafts that often fail
        head.confidence_head.proj.weight.mul_(20)
        head.confidence_head.proj.bias.fill_(6.0)
    prompts = [torch.randint(2, 32, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(6)]
    data = collect_calibration_data(head, target, prompts, max_new_tokens=40)
    assert data.confidence_logits.shape[1] == 3 and len(data.num_accepted) > 30
    result = fit_sts(data)
    assert result.ece_after.mean() < result.ece_before.mean()
    path = tmp_path / "sts.json"
    result.save(path, num_steps=len(data.num_accepted))
    torch.testing.assert_close(load_calibration(path), result.temperatures.float())
    assert set(json.loads(path.read_text())) >= {"temperatures", "ece_before", "ece_after", "brier_before"}
    plot_reliability(data, result, tmp_path / "reliability.png")
    assert (tmp_path / "reliability.png").read_bytes()[:4] == b"\x89PNG"


def test_each_prompt_samples_with_its_own_seed():
    target, head = tiny_target_and_head()
    prompt = torch.randint(2, 32, (6,), generator=torch.Generator().manual_seed(0)).tolist()
    alone = collect_calibration_data(head, target, [prompt], max_new_tokens=40).num_accepted
    twice = collect_calibration_data(head, target, [prompt, prompt], max_new_tokens=40).num_accepted
    assert torch.equal(twice[: len(alone)], alone)  # the first prompt samples as it does alone
    # One seed for both would replay the same draws: the second copy would give the same record.
    assert not torch.equal(twice[len(alone) :], alone)
