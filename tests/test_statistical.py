"""A seeded chi-square test of the whole joint law, with mutants that prove its power.

A first-order Markov target over a narrow vocabulary is decoded speculatively: a position-dependent
Markov draft (the law of slot ``j`` depends on the sampled token at ``j - 1``, as with DSpark's
Markov head) proposes ``K`` tokens sampled on the draft stream, `rejection_sample` verifies them
with Philox draws keyed by absolute position, and the loop goes on with variable emissions per
step until every sequence has ``L`` tokens. The histogram of the first ``L`` tokens over all
``V ** L`` cells is compared with the exact target joint.

The draft is the target with a strong random perturbation per slot and predecessor, so about
half of the slots reject and the residual draw carries the result; the residual's support keeps
tokens the draft also likes, which is where noise shared between drafting and recovery biases
the draw. A narrow vocabulary with many rejections is what exposes that bug, which a wide-vocab
test misses; the model was chosen for the power of the test against it. The seeds are fixed, so
every figure is deterministic. Each mutant must fail by orders of magnitude; the correct sampler,
also with a draft-side confidence truncation that never looks at the drafted token, must pass.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch
from scipy import stats

from spark_generate import sample
from spark_generate.kernels import reference, rejection_sample
from spark_generate.kernels.reference import RandomStream

VOCAB_SIZE, BLOCK_SIZE, LENGTH = 3, 3, 3
NUM_SEQUENCES = 600_000
NUM_CELLS = VOCAB_SIZE**LENGTH
CRITICAL = stats.chi2.ppf(0.99, NUM_CELLS - 1)  # ~45.6 for 26 degrees of freedom
CONFIDENCE_THRESHOLD = 0.8  # draft-side truncation: stop before a slot whose q_j is this flat


def toy_model() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    target = torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=gen).softmax(-1)
    perturbation = torch.randn(BLOCK_SIZE, VOCAB_SIZE, VOCAB_SIZE, generator=gen) * 2
    return target, (target.log()[None] + perturbation).softmax(-1)


def speculative_sequences(
    num_sequences: int, *, draft_stream: RandomStream, truncation: str, backend: str = "torch"
) -> torch.Tensor:
    """Decodes ``num_sequences`` sequences of ``LENGTH`` tokens speculatively; returns ``[N, L]``."""
    target, draft = toy_model()
    rows = torch.arange(num_sequences)
    seeds = 0x5EED0000 + rows
    tokens = torch.full((num_sequences, LENGTH + BLOCK_SIZE + 1), -1, dtype=torch.int64)
    lengths = torch.zeros(num_sequences, dtype=torch.int64)
    last = torch.zeros(num_sequences, dtype=torch.int64)  # the prompt is token 0 at position 0
    while (lengths < LENGTH).any():
        positions = lengths + 1
        draft_probs, draft_ids, previous = [], [], last
        for slot in range(BLOCK_SIZE):
            q = draft[slot, previous]
            token = sample(q, seed=seeds, positions=positions + slot, stream=draft_stream, validate=False)
            draft_probs.append(q)
            draft_ids.append(token)
            previous = token
        draft_probs, draft_ids = torch.stack(draft_probs, 1), torch.stack(draft_ids, 1)
        predecessors = torch.cat([last[:, None], draft_ids], 1)
        target_probs = target[predecessors]

        num_draft = torch.full((num_sequences,), BLOCK_SIZE)
        if truncation == "draft-side":  # reads q_j only (q_j depends on d_<j, never on d_j)
            flat = draft_probs.max(-1).values < CONFIDENCE_THRESHOLD
        elif truncation == "token-side":  # unsound: withdraws a drafted token by its own probability
            flat = draft_probs.gather(-1, draft_ids[..., None])[..., 0] < 0.25
        if truncation != "none":
            flat = torch.cat([flat, torch.ones(num_sequences, 1, dtype=torch.bool)], 1)
            num_draft = flat.to(torch.int8).argmax(1)

        out, num_emitted = rejection_sample(
            target_probs, draft_probs, draft_ids, num_draft, seed=seeds, positions=positions,
            backend=backend, validate=False,
        )  # fmt: skip
        for k in range(BLOCK_SIZE + 1):
            write = (k < num_emitted) & (lengths + k < tokens.shape[1])
            tokens[rows[write], (lengths + k)[write]] = out[write, k]
        lengths += num_emitted
        last = out.gather(1, (num_emitted - 1)[:, None])[:, 0]
    return tokens[:, :LENGTH]


def target_joint() -> torch.Tensor:
    target, _ = toy_model()
    joint = torch.empty(NUM_CELLS, dtype=torch.float64)
    for cell, seq in enumerate(product(range(VOCAB_SIZE), repeat=LENGTH)):
        prob, previous = 1.0, 0
        for token in seq:
            prob *= float(target[previous, token])
            previous = token
        joint[cell] = prob
    return joint


def chi_square(sequences: torch.Tensor) -> tuple[float, float]:
    powers = VOCAB_SIZE ** torch.arange(LENGTH - 1, -1, -1)
    observed = torch.bincount((sequences * powers).sum(1), minlength=NUM_CELLS).double()
    expected = target_joint() * len(sequences)
    statistic = float(((observed - expected) ** 2 / expected).sum())
    return statistic, float(stats.chi2.sf(statistic, NUM_CELLS - 1))


def test_the_toy_model_rejects_often_and_the_truncation_rule_fires():
    target, draft = toy_model()
    acceptance = torch.minimum(target[None], draft).sum(-1)  # 1 - TV per (slot, predecessor)
    assert acceptance.mean() < 0.7
    truncated = (draft.max(-1).values < CONFIDENCE_THRESHOLD).float().mean()
    assert 0.2 < truncated < 0.8


@pytest.mark.slow
@pytest.mark.parametrize("truncation", ["none", "draft-side"])
def test_speculative_sampling_has_the_target_joint(truncation):
    statistic, p_value = chi_square(
        speculative_sequences(NUM_SEQUENCES, draft_stream=RandomStream.DRAFT, truncation=truncation)
    )
    print(f"correct sampler, truncation={truncation}: chi2={statistic:.1f} (critical {CRITICAL:.1f}), p={p_value:.3f}")
    assert p_value > 1e-3


def residual_from_draft(target_probs, draft_probs):
    return torch.clamp_min(draft_probs - target_probs, 0)


def residual_is_target(target_probs, draft_probs):
    return target_probs


MUTANTS = {
    "residual from q": dict(patch=residual_from_draft),
    "residual = p": dict(patch=residual_is_target),
    "draft noise shared with the residual draw": dict(draft_stream=RandomStream.RESIDUAL),
    "truncation that looks at the drafted token": dict(truncation="token-side"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", MUTANTS.values(), ids=MUTANTS.keys())
def test_chi_square_catches_every_mutant_by_orders_of_magnitude(monkeypatch, mutant):
    if "patch" in mutant:
        monkeypatch.setattr(reference, "residual", mutant["patch"])
    sequences = speculative_sequences(
        NUM_SEQUENCES,
        draft_stream=mutant.get("draft_stream", RandomStream.DRAFT),
        truncation=mutant.get("truncation", "none"),
    )
    statistic, _ = chi_square(sequences)
    print(f"mutant: chi2={statistic:.3g} = {statistic / CRITICAL:.0f} x critical")
    assert statistic > 100 * CRITICAL


@pytest.mark.triton
def test_triton_kernel_in_the_loop_smoke(backend):
    """The same loop through the selected backend, small N: the kernel is wired in correctly."""
    statistic, p_value = chi_square(
        speculative_sequences(400, draft_stream=RandomStream.DRAFT, truncation="draft-side", backend=backend)
    )
    assert p_value > 1e-3, f"chi2={statistic:.1f}"
