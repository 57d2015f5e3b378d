"""Interop: heads saved by spark_generate mean the same thing in the real speculators 0.9.0.

speculators owns the ``"dspark"`` checkpoint format that vLLM serves. Each case saves a head (and its
tiny random target as the verifier folder), has ``tests/interop/speculators_logits.py`` compute its
draft and confidence logits with speculators' own classes in a side virtualenv, and compares them
with ``DSparkHead``'s teacher-forced and serial logits for the same context features and block
tokens. The side virtualenv is found through ``$SPARK_SPECULATORS_PYTHON``; without it the test is
skipped. Build it (about a minute, offline-capable from pip's cache) with::

    export SPARK_SPECULATORS_PYTHON="$(tests/interop/build_speculators_venv.sh)"

Tolerance: both sides compute in float32 with different kernels (eager attention against SDPA,
another summation order in every matmul), which moves logits by a few 1e-7 relative to their
scale; ``RELATIVE_TOLERANCE`` leaves a margin of ten, while the semantic differences this test
exists for (a Markov state, an embedding scale, a soft-cap) change logits by 1e-2 to 1e1.
"""

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from test_heads import VOCAB, tiny_head, tiny_target

from spark_generate import zoo
from spark_generate.heads import DSparkHead

SPECULATORS_PYTHON = os.environ.get("SPARK_SPECULATORS_PYTHON")
LOADER = Path(__file__).parent / "interop" / "speculators_logits.py"
SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-instruct-dspark"
RELATIVE_TOLERANCE = 1e-5
CONTEXT_LENGTHS = (0, 7)  # an empty context, and one long enough for every block to read from

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not SPECULATORS_PYTHON,
        reason="needs the speculators 0.9.0 side virtualenv: "
        'export SPARK_SPECULATORS_PYTHON="$(tests/interop/build_speculators_venv.sh)"',
    ),
]


@dataclass
class Case:
    """A head, its target, and where the target is saved as the verifier folder."""

    name: str
    head: DSparkHead
    target: torch.nn.Module
    verifier: Path


def tiny_case(tmp_path: Path, name: str, architecture: str, **head_fields) -> Case:
    """A tiny random target and head whose Markov and confidence weights are large enough to matter."""
    target = tiny_target(architecture)
    if architecture == "gemma3":
        target.config.final_logit_softcapping = 3.0  # the target caps its logits; a draft head never does
    head = tiny_head(target, **head_fields)
    torch.manual_seed(7)
    for module in (head.markov_head, head.confidence_head):
        for parameter in () if module is None else module.parameters():
            torch.nn.init.normal_(parameter, std=0.5)
    verifier = tmp_path / f"verifier-{name}"
    target.save_pretrained(verifier)
    return Case(name, head, target, verifier)


def feature_scaled_case(tmp_path: Path) -> Case:
    """A head that trains fc on scaled features: saved, its fc.weight is the folded product."""
    case = tiny_case(tmp_path, "feature-scaled", "llama")
    scale = torch.rand(case.head.fc.in_features, generator=torch.Generator().manual_seed(3)) * 4 + 0.1
    case.head.scale_target_features(scale)
    return case


def shipped_case() -> Case:
    """The shipped SmolLM2 head on its real target, both in float32 (the zoo target from PyPI)."""
    try:
        target, _ = zoo.load("smollm2-135m-instruct", dtype=torch.float32)
    except ValueError as error:
        pytest.skip(f"the shipped head's target is not available: {error}")
    verifier = zoo.converted_folder("smollm2-135m-instruct")
    head = DSparkHead.from_pretrained(SHIPPED_HEAD, dtype=torch.float32).attach(target).eval()
    return Case("shipped-smollm2", head, target, verifier)


def case_inputs(case: Case, seed: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    """``[2, T, m·H]`` tapped features of random token rows, and ``[2, K]`` random block tokens."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = case.head.config.target_vocab_size
    token_ids = torch.randint(0, vocab_size, (2, max(CONTEXT_LENGTHS)), generator=generator)
    with torch.no_grad():
        hidden_states = case.target(token_ids, output_hidden_states=True).hidden_states
    block_ids = torch.randint(0, vocab_size, (2, case.head.config.block_size), generator=generator)
    return case.head.select_target_features(hidden_states).float(), block_ids


def spark_logits(head: DSparkHead, context: torch.Tensor, block_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Draft and confidence logits of every draft token, teacher-forced and serial.

    Args:
        head: The head.
        context: ``[N, p, m·H]`` tapped features of the context rows.
        block_ids: ``[N, K]`` anchor and following tokens.

    Returns:
        ``forced``/``serial`` ``[N, S, V_d]`` and ``forced_confidence``/``serial_confidence`` ``[N, S]``.
    """
    num_draft = head.config.num_draft_tokens
    anchors = torch.full((len(block_ids), 1), context.shape[1])
    with torch.no_grad():
        out = head(head.block_input_ids(block_ids[:, 0]), anchors, target_hidden_states=context)
        prev_ids = block_ids[:, None, :num_draft]
        forced = head.teacher_forced(out.base_logits, out.draft_hidden, prev_ids, out.markov_state)
        state, steps = out.first_markov_state(0), []
        for j in range(num_draft):
            step = head.draft_step(out.base_logits[:, 0, j], out.draft_hidden[:, 0, j], block_ids[:, j], state)
            state = step.markov_state
            steps.append(step)
    result = {"forced": forced.draft_logits[:, 0], "serial": torch.stack([s.draft_logits for s in steps], 1)}
    if forced.confidence_logits is not None:
        result["forced_confidence"] = forced.confidence_logits[:, 0]
        result["serial_confidence"] = torch.stack([s.confidence_logits for s in steps], 1)
    return result


def relative_difference(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """``max |ours - theirs| / max(1, max |theirs|)``."""
    return ((ours - theirs).abs().max() / theirs.abs().max().clamp(min=1.0)).item()


Key = tuple[str, int]  # case name, context length


def speculators_logits(
    tmp_path: Path, cases: list[Case]
) -> tuple[dict[Key, dict[str, torch.Tensor]], dict[Key, tuple[torch.Tensor, torch.Tensor]]]:
    """Saves every head and its inputs, and runs the loader once in the side virtualenv.

    Returns:
        speculators' outputs (``logits``, ``confidence_logits``) and the inputs (context features,
        block tokens), both keyed by case name and context length.
    """
    manifest, inputs, outputs = [], {}, {}
    for case in cases:
        head_dir = tmp_path / f"head-{case.name}"
        case.head.save_pretrained(head_dir)
        features, block_ids = case_inputs(case)
        for length in CONTEXT_LENGTHS:
            key, stem = (case.name, length), tmp_path / f"{case.name}-{length}"
            inputs[key], outputs[key] = (features[:, :length], block_ids), f"{stem}-out.npz"
            np.savez(f"{stem}-in.npz", context_hidden=features[:, :length].numpy(), block_ids=block_ids.numpy())
            manifest.append({"head": str(head_dir), "verifier": str(case.verifier), "inputs": f"{stem}-in.npz"})
            manifest[-1]["output"] = outputs[key]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    completed = subprocess.run(
        [SPECULATORS_PYTHON, str(LOADER), str(tmp_path / "manifest.json")],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        check=False,
    )
    assert completed.returncode == 0, f"the speculators loader failed:\n{completed.stdout}\n{completed.stderr}"
    theirs = {
        key: {name: torch.from_numpy(array) for name, array in np.load(path).items()} for key, path in outputs.items()
    }
    return theirs, inputs


def assert_matches_speculators(tmp_path: Path, cases: list[Case]) -> None:
    """Every case's teacher-forced and serial logits agree with speculators' within the tolerance."""
    theirs, inputs = speculators_logits(tmp_path, cases)
    report = {}
    for case in cases:
        first_slot = 0 if case.head.config.sample_from_anchor else 1
        for length in CONTEXT_LENGTHS:
            ours = spark_logits(case.head, *inputs[case.name, length])
            reference = theirs[case.name, length]
            assert ("forced_confidence" in ours) == ("confidence_logits" in reference), case.name
            for name, tensor in ours.items():
                expected = reference["confidence_logits" if name.endswith("confidence") else "logits"][:, first_slot:]
                report[f"{case.name} p={length} {name}"] = (
                    relative_difference(tensor, expected),
                    (tensor - expected).abs().max().item(),
                )
    print("\n".join(f"{key}: relative {rel:.1e}, absolute {diff:.1e}" for key, (rel, diff) in report.items()))
    too_far = {key: rel for key, (rel, _) in report.items() if rel > RELATIVE_TOLERANCE}
    assert not too_far, f"logits differ from speculators' beyond {RELATIVE_TOLERANCE} (relative): {too_far}"


def test_saved_tiny_heads_match_speculators(tmp_path):
    assert_matches_speculators(
        tmp_path,
        [
            tiny_case(tmp_path, "vanilla", "llama"),
            tiny_case(tmp_path, "gated", "qwen3", markov_head_type="gated"),
            tiny_case(tmp_path, "rnn-anchor-first", "llama", markov_head_type="rnn"),
            tiny_case(tmp_path, "rnn-dflash-slots", "llama", markov_head_type="rnn", sample_from_anchor=False),
            tiny_case(
                tmp_path,
                "reduced-vocab",
                "qwen3",
                draft_vocab_ids=torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5))[:40],
            ),
            tiny_case(tmp_path, "no-markov", "mistral", markov_rank=0, confidence_head_with_markov=False),
            tiny_case(tmp_path, "gemma3", "gemma3", markov_head_type="rnn"),
            feature_scaled_case(tmp_path),
        ],
    )


def test_the_shipped_head_matches_speculators(tmp_path):
    assert_matches_speculators(tmp_path, [shipped_case()])
