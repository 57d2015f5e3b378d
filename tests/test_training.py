"""The trainer on a tiny random Llama target: what trains, exact resume, checkpoints and bad input.

Everything runs in float32 on the CPU in a few seconds; resuming is checked bit for bit (the batch
order and the anchors are functions of the seed and the step, the optimizer and scheduler states
are saved).
"""

import functools
import json
import os
import shutil
import subprocess

import pytest
import torch
from conftest import tiny_head as shared_tiny_head
from conftest import tiny_target as shared_tiny_target
from transformers import LlamaForCausalLM

import spark_generate.training.trainer as trainer_module
from spark_generate.config import DSparkConfigError
from spark_generate.heads import DSparkHead
from spark_generate.training import (
    TokenDataset,
    Trainer,
    TrainingConfig,
    draft_vocab_from_data,
    read_jsonl,
    write_jsonl,
)
from spark_generate.training.evaluation import plot_history
from spark_generate.training.initialization import grow_draft_layers
from spark_generate.training.provenance import git_commit

VOCAB = 96


def tiny_target(num_layers: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """The shared tiny Llama, narrower (hidden 32) so training steps stay fast."""
    return shared_tiny_target(num_layers=num_layers, hidden_size=32, intermediate_size=48, seed=seed)


def tiny_head(target, **overrides) -> DSparkHead:
    """The shared tiny head with blocks of 3."""
    return shared_tiny_head(target, **{"block_size": 3, **overrides})


def dataset(num_sequences: int = 6) -> TokenDataset:
    generator = torch.Generator().manual_seed(2)
    sequences, masks = [], []
    for index in range(num_sequences):
        length = 12 + 3 * index
        sequences.append(tuple(torch.randint(2, VOCAB, (length,), generator=generator).tolist()))
        masks.append(tuple([0] * 4 + [1] * (length - 4)))
    return TokenDataset(tuple(sequences), tuple(masks), "random test documents")


def settings(tmp_path, **overrides) -> TrainingConfig:
    fields = {"num_steps": 4, "batch_size": 2, "gradient_accumulation_steps": 2, "num_anchors": 6, "progress": False}
    return TrainingConfig(str(tmp_path), **{**fields, **overrides})


def test_only_the_head_trains(tmp_path):
    target = tiny_target()
    before = {name: value.clone() for name, value in target.state_dict().items()}
    head = tiny_head(target)
    head_before = {name: value.clone() for name, value in head.state_dict().items()}
    Trainer(head, target, dataset(), settings(tmp_path, num_steps=2)).train()
    assert all(torch.equal(before[name], value) for name, value in target.state_dict().items())
    changed = {name for name, value in head.state_dict().items() if not torch.equal(head_before[name], value)}
    prefixes = ("fc.", "hidden_norm.", "layers.0.", "norm.", "markov_head.", "confidence_head.")
    assert all(name.startswith(prefixes) for name in changed)
    assert {name.split(".")[0] for name in changed} >= {"fc", "layers", "markov_head", "confidence_head"}


def test_resume_reaches_bit_identical_weights(tmp_path):
    straight_target = tiny_target()
    straight = tiny_head(straight_target)
    Trainer(straight, straight_target, dataset(), settings(tmp_path / "straight")).train()

    target = tiny_target()
    first = tiny_head(target)
    half = Trainer(first, target, dataset(), settings(tmp_path / "split")).train(stop_after=2)
    assert half.checkpoint.name == "checkpoint-0000002"
    resumed = tiny_head(target)  # fresh weights, overwritten by the checkpoint
    end = Trainer(resumed, target, dataset(), settings(tmp_path / "split")).train(resume_from=half.checkpoint)
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    # The learning curve spans both sessions, record for record as the straight run's.
    history = json.loads((end.checkpoint / "history.json").read_text())
    assert [record["step"] for record in history] == [1, 2, 3, 4]
    assert history == json.loads((tmp_path / "straight" / "checkpoint-0000004" / "history.json").read_text())
    assert history[0]["learning_rate"] > history[-1]["learning_rate"]  # the cosine decay, step by step
    plot_history(history, tmp_path / "curve.png", window=2)
    assert (tmp_path / "curve.png").read_bytes().startswith(b"\x89PNG")


def test_a_warm_started_run_continues_from_the_other_runs_weights(tmp_path):
    """A second stage equals a run begun by hand from the first stage's weights, and resumes bit for bit."""
    target = tiny_target()
    first = tiny_head(target)
    stage_one = Trainer(first, target, dataset(), settings(tmp_path / "one")).train()
    second_stage = {"seed": 1, "learning_rate": 3e-4}

    by_hand = tiny_head(target)
    by_hand.load_state_dict(first.state_dict())
    Trainer(by_hand, target, dataset(), settings(tmp_path / "by-hand", **second_stage)).train()

    warm = tiny_head(target)  # fresh weights, overwritten by stage one's
    assert not torch.equal(warm.fc.weight, first.fc.weight)
    half = Trainer(warm, target, dataset(), settings(tmp_path / "two", **second_stage)).train(
        warm_start_from=stage_one.checkpoint, stop_after=2
    )
    resumed = tiny_head(target)
    end = Trainer(resumed, target, dataset(), settings(tmp_path / "two", **second_stage)).train(
        resume_from=half.checkpoint
    )
    for name, value in by_hand.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    provenance = json.loads((end.checkpoint / "provenance.json").read_text())
    assert provenance["warm_start"] == {"checkpoint": str(stage_one.checkpoint), "step": 4}
    history = json.loads((end.checkpoint / "history.json").read_text())
    assert [record["step"] for record in history] == [1, 2, 3, 4]  # this stage's own curve


def test_a_run_warm_starts_from_a_saved_head_with_its_folded_weights(tmp_path):
    """A shipped head (bfloat16, fc folded, no trainer state) seeds a run on another feature scale, same logits."""
    target = tiny_target()
    first = tiny_head(target)
    first.scale_target_features(torch.linspace(0.5, 2.0, first.fc.in_features))
    Trainer(first, target, dataset(), settings(tmp_path / "one", num_steps=2)).train()
    first.to(torch.bfloat16).save_pretrained(tmp_path / "shipped")
    shipped = DSparkHead.from_pretrained(tmp_path / "shipped").float().attach(target).eval()

    warm = DSparkHead.from_pretrained(tmp_path / "shipped").float()
    warm.scale_target_features(torch.linspace(3.0, 0.25, warm.fc.in_features))  # any other scale
    trainer = Trainer(warm, target, dataset(), settings(tmp_path / "two", num_steps=2))
    trainer._warm_start(tmp_path / "shipped")
    torch.testing.assert_close(warm.fc.weight, shipped.fc.weight, rtol=1e-6, atol=0)
    features = torch.randn(2, 5, warm.fc.in_features, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(warm.eval().fc(features), shipped.fc(features), rtol=1e-5, atol=1e-6)
    for name, value in shipped.state_dict().items():
        if name != "fc.weight":
            assert torch.equal(warm.state_dict()[name], value), name
    result = trainer.train(warm_start_from=tmp_path / "shipped")
    provenance = json.loads((result.checkpoint / "provenance.json").read_text())
    assert provenance["warm_start"] == {"checkpoint": str(tmp_path / "shipped"), "step": None}
    other = Trainer(tiny_head(target, markov_rank=4), target, dataset(), settings(tmp_path / "three"))
    with pytest.raises(ValueError, match="another configuration"):
        other.train(warm_start_from=tmp_path / "shipped")


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None, reason="needs a C++ compiler")
def test_a_grown_head_drafts_exactly_as_the_trained_one_and_trains_its_new_layers(tmp_path):
    target = tiny_target()
    head = tiny_head(target)
    Trainer(head, target, dataset(), settings(tmp_path / "trained", num_steps=2)).train()
    head.eval()
    grown = grow_draft_layers(head, 3, target).attach(target).eval()
    assert len(grown.layers) == grown.config.num_draft_layers == 3 and len(head.layers) == 1
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(2, 9, head.fc.in_features, generator=generator)
    blocks = torch.full((2, 2, head.config.block_size), head.config.mask_token_id)
    blocks[..., 0] = torch.tensor([[17, 90], [4, 52]])
    anchors = torch.tensor([[3, 8], [2, 6]])
    before, after = head(blocks, anchors, features), grown(blocks, anchors, features)
    assert torch.equal(before.base_logits, after.base_logits) and torch.equal(before.draft_hidden, after.draft_hidden)
    assert torch.equal(grown.layers[2].self_attn.q_proj.weight, head.layers[0].self_attn.q_proj.weight)
    assert torch.equal(grown.layers[0].mlp.up_proj.weight, target.model.layers[1].mlp.up_proj.weight)
    assert not grown.layers[1].self_attn.o_proj.weight.any() and not grown.layers[1].mlp.down_proj.weight.any()
    grown.save_pretrained(tmp_path / "grown")
    reloaded = DSparkHead.from_pretrained(tmp_path / "grown")
    Trainer(reloaded, target, dataset(), settings(tmp_path / "run", num_steps=2)).train()
    for layer in reloaded.layers[:2]:  # the zero projections open from the first steps
        assert layer.self_attn.o_proj.weight.any() and layer.mlp.down_proj.weight.any()
    with pytest.raises(ValueError, match="never cut"):
        grow_draft_layers(grown, 1, target)


def test_a_compiled_loss_trains_the_same_head(tmp_path):
    """compile_loss fuses the objective's passes: the same steps, up to float32 rounding."""
    target = tiny_target()
    eager, compiled = tiny_head(target), tiny_head(target)
    Trainer(eager, target, dataset(), settings(tmp_path / "eager", num_steps=2)).train()
    result = Trainer(
        compiled, target, dataset(), settings(tmp_path / "compiled", num_steps=2, compile_loss=True)
    ).train()
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
    history = json.loads((result.checkpoint / "history.json").read_text())
    expected = json.loads((tmp_path / "eager" / "checkpoint-0000002" / "history.json").read_text())
    assert [record["loss"] for record in history] == pytest.approx([record["loss"] for record in expected], rel=1e-4)


def test_warm_start_refuses_ambiguous_or_mismatched_checkpoints(tmp_path):
    target = tiny_target()
    stage_one = Trainer(tiny_head(target), target, dataset(), settings(tmp_path / "one", num_steps=1)).train()
    trainer = Trainer(tiny_head(target), target, dataset(), settings(tmp_path / "two"))
    with pytest.raises(ValueError, match="give one"):
        trainer.train(resume_from=stage_one.checkpoint, warm_start_from=stage_one.checkpoint)
    other = Trainer(
        tiny_head(target, markov_rank=0, enable_confidence_head=False), target, dataset(), settings(tmp_path / "three")
    )
    with pytest.raises(ValueError, match="another configuration"):
        other.train(warm_start_from=stage_one.checkpoint)


def test_a_run_stopped_by_its_time_budget_resumes_bit_for_bit(tmp_path, monkeypatch):
    straight_target = tiny_target()
    straight = tiny_head(straight_target)
    Trainer(straight, straight_target, dataset(), settings(tmp_path / "straight")).train()

    class FakeClock:  # every reading is a minute later
        now = 0.0

        def monotonic(self) -> float:
            self.now += 60.0
            return self.now

    monkeypatch.setattr(trainer_module, "time", FakeClock())
    target = tiny_target()
    checkpoint, steps = None, []
    while not steps or steps[-1] < 4:
        head = tiny_head(target)
        result = Trainer(head, target, dataset(), settings(tmp_path / "budget")).train(checkpoint, max_minutes=1.5)
        checkpoint = result.checkpoint
        steps.append(int(checkpoint.name.split("-")[1]))
    assert steps == [2, 4]  # budget read at 1 min, deadline 2.5 min: passed after the second step (3 min)
    for name, value in straight.state_dict().items():
        assert torch.equal(value, head.state_dict()[name]), name


def test_checkpoint_is_complete_loadable_and_has_provenance(tmp_path):
    target = tiny_target()
    result = Trainer(tiny_head(target), target, dataset(), settings(tmp_path, num_steps=2, save_every=1)).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000001", "checkpoint-0000002"]
    assert sorted(p.name for p in result.checkpoint.iterdir()) == [
        "README.md", "config.json", "custom_generate", "history.json", "model.safetensors", "provenance.json",
        "trainer_state.pt",
    ]  # fmt: skip
    provenance = json.loads((result.checkpoint / "provenance.json").read_text())
    assert provenance["step"] == 2
    assert len(provenance["target"]["weights_sha256"]) == 64
    assert provenance["data"] == {"description": "random test documents", "num_sequences": 6}
    assert provenance["loss_divergences"]["distribution_term"].startswith("l1")
    assert {"torch", "transformers", "accelerate"} <= set(provenance["packages"])
    assert provenance["training"]["learning_rate"] == 6e-4 and "argv" in provenance and "git_commit" in provenance
    metric_names = {"tau", "greedy_tau", "acceptance", "greedy_accuracy", "confidence_error"}
    assert set(provenance["teacher_forced_metrics"]) == metric_names
    loaded = DSparkHead.from_pretrained(result.checkpoint)
    assert loaded.config.block_size == 3


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    target = tiny_target()
    config = settings(tmp_path, num_steps=4, save_every=1, save_total_limit=2)
    result = Trainer(tiny_head(target), target, dataset(), config).train()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-0000003", "checkpoint-0000004"]
    assert result.checkpoint.name == "checkpoint-0000004"
    with pytest.raises(ValueError, match="save_total_limit=0"):
        settings(tmp_path, save_total_limit=0)


def test_failed_save_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    target = tiny_target()
    trainer = Trainer(tiny_head(target), target, dataset(), settings(tmp_path, num_steps=1))

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(trainer_module.torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert list(tmp_path.iterdir()) == []


def test_bf16_and_a_reduced_draft_vocabulary_train(tmp_path, fresh_accelerate_state):
    target = tiny_target()
    head = tiny_head(target, draft_vocab_size=40)
    result = Trainer(head, target, dataset(), settings(tmp_path, num_steps=1, mixed_precision="bf16")).train()
    assert torch.isfinite(torch.tensor(result.loss))
    assert result.metrics.slot_count[0] > 0


def test_jsonl_round_trip_and_bad_lines(tmp_path):
    path = tmp_path / "data.jsonl"
    write_jsonl(path, [[5, 6, 7]], [[0, 1, 1]])
    data = read_jsonl(path)
    assert data.sequences == ((5, 6, 7),) and data.loss_masks == ((0, 1, 1),)
    assert str(path) in data.description and "sha256" in data.description
    path.write_text('{"input_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match=r"data.jsonl:1 .*loss_mask"):
        read_jsonl(path)
    path.write_text("")
    with pytest.raises(ValueError, match="holds no sequences"):
        read_jsonl(path)
    with pytest.raises(ValueError, match="does not exist"):
        read_jsonl(tmp_path / "missing.jsonl")


def test_data_of_another_tokenizer_is_refused(tmp_path):
    target = tiny_target()
    foreign = TokenDataset(((5, 6, VOCAB + 10),), ((0, 1, 1),), "foreign.jsonl")
    with pytest.raises(ValueError, match=r"foreign.jsonl .*another model"):
        Trainer(tiny_head(target), target, foreign, settings(tmp_path))


def test_head_of_another_target_is_refused(tmp_path):
    head = tiny_head(tiny_target(num_layers=4))
    with pytest.raises(DSparkConfigError):
        Trainer(head, tiny_target(num_layers=6), dataset(), settings(tmp_path))


def test_unwritable_output_folder_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    target = tiny_target()
    with pytest.raises(ValueError, match="not a writable folder"):
        Trainer(tiny_head(target), target, dataset(), settings(blocker / "out"))


def test_corrupt_checkpoint_is_refused(tmp_path):
    target = tiny_target()
    result = Trainer(tiny_head(target), target, dataset(), settings(tmp_path / "run", num_steps=2)).train(stop_after=1)
    state = result.checkpoint / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    trainer = Trainer(tiny_head(target), target, dataset(), settings(tmp_path / "run", num_steps=2))
    with pytest.raises(ValueError, match=r"trainer_state\.pt is missing or corrupt"):
        trainer.train(resume_from=result.checkpoint)
    os.remove(result.checkpoint / "model.safetensors")
    with pytest.raises(Exception, match=r"model\.safetensors|weights"):
        trainer.train(resume_from=result.checkpoint)


def test_invalid_settings_say_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match="num_anchors=0: expected a positive integer"):
        settings(tmp_path, num_anchors=0)
    with pytest.raises(ValueError, match="mixed_precision='fp16'"):
        settings(tmp_path, mixed_precision="fp16")


def test_draft_vocabulary_takes_the_most_frequent_learned_tokens():
    data = TokenDataset(((7, 5, 5, 9, 9, 9), (3, 3, 3, 3, 5, 2)), ((0, 1, 1, 1, 1, 1), (1, 1, 1, 1, 0, 0)), "counts")
    # Loss-masked counts: 9 x3, 3 x4, 5 x2; 7 and 2 are unmasked. Ties and padding: lowest ids.
    assert draft_vocab_from_data(data, 3, VOCAB).tolist() == [3, 5, 9]
    assert draft_vocab_from_data(data, 5, VOCAB).tolist() == [0, 1, 3, 5, 9]
    with pytest.raises(ValueError, match="expected 1 to 96"):
        draft_vocab_from_data(data, 0, VOCAB)


def test_provenance_marks_a_run_of_uncommitted_code(tmp_path):
    run = functools.partial(subprocess.run, cwd=tmp_path, check=True, capture_output=True)
    run(["git", "init", "-q"])
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "model_cards").mkdir()
    (tmp_path / "model_cards" / "card.md").write_text("v1\n")
    run(["git", "add", "."])
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"])
    head = run(["git", "rev-parse", "HEAD"], text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "model_cards" / "card.md").write_text("v2\n")  # what an export writes: not the code
    (tmp_path / "untracked.txt").write_text("scratch\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"
    assert git_commit(tmp_path.parent / "not-a-checkout-at-all") is None
