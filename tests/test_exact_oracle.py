"""Exact losslessness of chain rejection sampling, with the random draws integrated out.

The oracle enumerates every way one verification step can go for a small vocabulary: each draft
path with its probability, each acceptance with the probability of the library's own
:func:`acceptance_probability`, each recovered token from the library's own :func:`residual`,
each bonus token. Emissions shorter than ``K + 1`` are completed with direct target draws, and the
law of the completed sequence must equal the target's joint law exactly, in ``fractions.Fraction``
arithmetic: no tolerance, no sampling.

Target conditionals depend on the whole emitted prefix; draft conditionals depend on the slot and
on the drafted prefix (Markov-style, as DSpark's Markov head). Zeros, ``q == p`` and one-hot
drafts are drawn, and so are the draft lengths, fixed per row or chosen by a draft-side rule that
looks at ``q_j`` but never at ``d_j``. The same oracle run with a broken helper, or with a
truncation rule that looks at the drafted token, must find a counterexample: that is what proves
the oracle has the power to catch a broken sampler.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from itertools import product

import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from spark_generate.kernels import reference

Prefix = tuple[int, ...]


@dataclass(frozen=True)
class StepProblem:
    """One verification step: target and draft conditionals over every prefix, and a length rule."""

    vocab_size: int
    block_size: int
    target: dict[Prefix, tuple[Fraction, ...]]
    draft: dict[tuple[int, Prefix], tuple[Fraction, ...]]
    num_draft_tokens: int
    draft_side_threshold: Fraction | None  # stop drafting at slot j when max(q_j) falls below it

    def keeps_drafting(self, slot: int, prefix: Prefix) -> bool:
        """The draft-side stopping rule: reads q_j (which depends on d_<j), never d_j."""
        if slot >= self.num_draft_tokens:
            return False
        return self.draft_side_threshold is None or max(self.draft[slot, prefix]) >= self.draft_side_threshold


def random_distribution(rng: random.Random, vocab_size: int, zero_rate: float) -> tuple[Fraction, ...]:
    weights = [0 if rng.random() < zero_rate else rng.randint(1, 6) for _ in range(vocab_size)]
    if not any(weights):
        weights[rng.randrange(vocab_size)] = 1
    total = sum(weights)
    return tuple(Fraction(w, total) for w in weights)


@st.composite
def step_problems(draw) -> StepProblem:
    vocab_size = draw(st.integers(2, 3))
    block_size = draw(st.integers(1, 3))
    num_draft_tokens = draw(st.integers(0, block_size))
    draft_mode = draw(st.sampled_from(["independent", "equal", "one_hot"]))
    zero_rate = draw(st.sampled_from([0.0, 0.3, 0.6]))
    threshold = draw(st.sampled_from([None, Fraction(1, 2), Fraction(2, 3)]))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    prefixes = [p for n in range(block_size + 1) for p in product(range(vocab_size), repeat=n)]
    target = {p: random_distribution(rng, vocab_size, zero_rate) for p in prefixes}
    draft = {}
    for slot in range(block_size):
        for prefix in product(range(vocab_size), repeat=slot):
            if draft_mode == "equal":
                draft[slot, prefix] = target[prefix]
            elif draft_mode == "one_hot":
                token = rng.randrange(vocab_size)
                draft[slot, prefix] = tuple(Fraction(int(v == token)) for v in range(vocab_size))
            else:
                draft[slot, prefix] = random_distribution(rng, vocab_size, zero_rate)
    return StepProblem(vocab_size, block_size, target, draft, num_draft_tokens, threshold)


def emitted_law(problem: StepProblem, drops_drafted_token: Callable | None = None) -> dict[Prefix, Fraction]:
    """Exact law of one step's emission, completed to ``K + 1`` tokens with target draws.

    ``drops_drafted_token(slot, q, d)`` models a *token-side* truncation rule (unsound): when it
    holds, the drafted token is withdrawn and the step ends with a bonus draw at that slot.
    """
    law: dict[Prefix, Fraction] = defaultdict(Fraction)
    length = problem.block_size + 1

    def complete(prefix: Prefix, prob: Fraction) -> None:
        if len(prefix) == length:
            law[prefix] += prob
            return
        for token, target_prob in enumerate(problem.target[prefix]):
            if target_prob:
                complete((*prefix, token), prob * target_prob)

    def walk(prefix: Prefix, prob: Fraction) -> None:
        slot = len(prefix)
        target = problem.target[prefix]
        if not problem.keeps_drafting(slot, prefix):
            complete(prefix, prob)  # the bonus token is one target draw
            return
        draft = problem.draft[slot, prefix]
        reject_mass = Fraction(0)
        for token, draft_prob in enumerate(draft):
            if not draft_prob:
                continue
            if drops_drafted_token is not None and drops_drafted_token(slot, draft, token):
                complete(prefix, prob * draft_prob)
                continue
            accept = reference.acceptance_probability(target[token], draft_prob)
            reject_mass += draft_prob * (1 - accept)
            if accept:
                walk((*prefix, token), prob * draft_prob * accept)
        if reject_mass:
            residual = reference.residual(np.array(target, dtype=object), np.array(draft, dtype=object))
            residual_mass = sum(residual)
            for token, weight in enumerate(residual):
                if weight:
                    complete((*prefix, token), prob * reject_mass * weight / residual_mass)

    walk((), Fraction(1))
    return {seq: p for seq, p in law.items() if p}


def target_law(problem: StepProblem) -> dict[Prefix, Fraction]:
    law = {}
    for seq in product(range(problem.vocab_size), repeat=problem.block_size + 1):
        prob = Fraction(1)
        for t in range(len(seq)):
            prob *= problem.target[seq[:t]][seq[t]]
        if prob:
            law[seq] = prob
    return law


def is_lossless(problem: StepProblem, drops_drafted_token: Callable | None = None) -> bool:
    return emitted_law(problem, drops_drafted_token) == target_law(problem)


@given(step_problems())
def test_emitted_sequence_has_exactly_the_target_law(problem):
    assert emitted_law(problem) == target_law(problem)


@given(
    st.fractions(0, 1).filter(lambda u: u < 1),
    st.fractions(0, 1),
    st.fractions(0, 1),
)
def test_accept_test_holds_exactly_on_the_acceptance_probability(uniform, target_prob, draft_prob):
    """``accepts(u, p, q)`` is the event ``u < acceptance_probability(p, q)`` for every ``u``."""
    assert reference.accepts(uniform, target_prob, draft_prob) == (
        uniform < reference.acceptance_probability(target_prob, draft_prob)
    )


def test_zero_target_probability_is_never_accepted_even_for_a_zero_uniform():
    assert not reference.accepts(Fraction(0), Fraction(0), Fraction(1, 2))
    assert reference.acceptance_probability(Fraction(0), Fraction(0)) == 0


@pytest.mark.parametrize(
    "mutant",
    [
        pytest.param(("residual", lambda p, q: (q - p) * (q > p)), id="residual from q"),
        pytest.param(("residual", lambda p, q: p), id="residual = p"),
        pytest.param(("acceptance_probability", lambda p, q: p), id="acceptance = p(d)"),
        pytest.param(("acceptance_probability", lambda p, q: min(1, p)), id="one-hot acceptance for sampled drafts"),
    ],
)
def test_oracle_catches_a_broken_helper(monkeypatch, mutant):
    name, broken = mutant
    monkeypatch.setattr(reference, name, broken)
    counterexample = find(
        step_problems(), lambda problem: not is_lossless(problem), settings=settings(max_examples=500)
    )
    assert not is_lossless(counterexample)


def test_oracle_catches_a_truncation_rule_that_looks_at_the_drafted_token():
    def drops_unlikely_draft(slot, draft, token):
        return draft[token] < Fraction(1, 2)

    counterexample = find(
        step_problems(),
        lambda problem: not is_lossless(problem, drops_unlikely_draft),
        settings=settings(max_examples=500),
    )
    assert not is_lossless(counterexample, drops_unlikely_draft)
    assert is_lossless(counterexample), "the same problem is lossless without the token-side rule"
