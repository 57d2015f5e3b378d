"""Plain sampling (the race and the inverse CDF): the right law, the support, greedy ties, streams and errors."""

from __future__ import annotations

from fractions import Fraction
from itertools import accumulate

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from spark_generate import RandomStream, inverse_cdf_sample, sample
from spark_generate.kernels.reference import (
    inverse_cdf,
    philox_offsets,
    philox_race_noise,
    philox_uniform4x,
    philox_uniform64,
    race_noise_from_uniform,
)


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    num_rows = 100_000
    tokens = sample(probs.expand(num_rows, -1).contiguous(), seed=torch.arange(num_rows), positions=3)
    observed = torch.bincount(tokens, minlength=6).double()
    assert observed[5] == 0, "a zero-probability token is never drawn"
    statistic, p_value = stats.chisquare(observed[:5], (probs[:5] * num_rows).double())
    assert p_value > 1e-3, f"chi2={statistic:.1f}"


def test_a_biased_sampler_would_fail_the_same_check():
    """Power check for the test above: a 2% shift of mass is rejected."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    shifted = torch.tensor([0.48, 0.27, 0.125, 0.0625, 0.0625])
    num_rows = 100_000
    tokens = sample(shifted.expand(num_rows, -1).contiguous(), seed=torch.arange(num_rows), positions=3)
    observed = torch.bincount(tokens, minlength=5).double()
    assert stats.chisquare(observed, (probs * num_rows).double()).pvalue < 1e-6


@given(st.integers(2, 64), st.integers(0, 2**40), st.integers(0, 10_000))
def test_support_and_determinism(vocab_size, seed, position):
    gen = torch.Generator().manual_seed(seed % 2**31)
    logits = torch.randn(8, vocab_size, generator=gen)
    logits[torch.rand(8, vocab_size, generator=gen) < 0.5] = float("-inf")
    logits[:, 0] = 0.0
    probs = logits.softmax(-1)
    tokens = sample(probs, seed=seed, positions=position)
    assert (probs.gather(1, tokens[:, None]) > 0).all()
    assert torch.equal(tokens, sample(probs, seed=seed, positions=position))


def test_greedy_takes_the_first_argmax_and_ignores_randomness():
    probs = torch.tensor([[0.1, 0.45, 0.45], [0.6, 0.2, 0.2]])
    assert sample(probs, greedy=True, seed=1).tolist() == [1, 0]
    assert sample(probs, greedy=torch.tensor([True, False]), seed=1)[0] == 1


def test_streams_are_different_draws():
    probs = torch.full((2000, 8), 1 / 8)
    seeds = torch.arange(2000)
    residual = sample(probs, seed=seeds, positions=9, stream=RandomStream.RESIDUAL)
    draft = sample(probs, seed=seeds, positions=9, stream=RandomStream.DRAFT)
    agreement = (residual == draft).float().mean()
    assert abs(agreement - 1 / 8) < 0.03, "independent draws agree about 1/V of the time"


def test_explicit_noise_is_an_exponential_race():
    probs = torch.tensor([[0.2, 0.3, 0.5]])
    assert sample(probs, noise=torch.tensor([[10.0, 1.0, 1.0]])).item() == 0
    assert sample(probs, noise=torch.tensor([[1.0, 1.0, 1.0]])).item() == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(probs=torch.ones(3)), "float32 \\[B, V\\]"),
        (dict(probs=torch.tensor([[0.5, 0.6]])), "sums to 1.1"),
        (dict(probs=torch.tensor([[0.5, 0.5]]), seed=1, noise=torch.ones(1, 2)), "not both"),
        (dict(probs=torch.tensor([[0.5, 0.5]]), positions=4), "needs seed"),
        (dict(probs=torch.tensor([[0.5, 0.5]]), noise=torch.ones(2, 2)), "noise has shape"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sample(**kwargs)


def test_philox_matches_the_random123_known_answer():
    """Philox4x32-10 of counter 0 under key 0 is Random123's published known answer."""
    words = philox_uniform4x(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    known = torch.tensor([0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8], dtype=torch.int64)
    magnitude = torch.where(known >= 2**31, known ^ 0xFFFFFFFF, known)  # Triton's word -> uniform
    assert torch.equal(words[0], magnitude.float() * torch.tensor(4.6566127342e-10))


@given(st.integers(1, 4), st.integers(1, 70), st.integers(-(2**63), 2**63 - 1), st.integers(0, 2**28))
def test_race_noise_is_lane_v_mod_4_of_counter_v_div_4(batch_size, vocab_size, seed, position):
    """The row-batched race noise equals the per-token definition, whatever the shapes."""
    seeds = torch.full((batch_size,), seed, dtype=torch.int64) + torch.arange(batch_size)
    positions = torch.full((batch_size,), position) + torch.arange(batch_size)
    noise = philox_race_noise(seeds, positions, RandomStream.RESIDUAL, vocab_size)
    tokens = torch.arange(vocab_size)
    offsets = philox_offsets(positions[:, None], RandomStream.RESIDUAL, tokens[None] // 4)
    uniforms = philox_uniform4x(seeds[:, None], offsets).gather(-1, (tokens % 4).expand(batch_size, -1)[..., None])
    assert torch.equal(noise, race_noise_from_uniform(uniforms[..., 0]))


# The loop's plain steps and drafts: inverse-CDF draws from one 53-bit Philox uniform per row.


@given(
    st.lists(st.integers(0, 7), min_size=1, max_size=24).filter(any),
    st.lists(st.integers(0, 2**12 - 1), min_size=1, max_size=8),
)
def test_inverse_cdf_is_the_exact_interval_lookup(weights, numerators):
    """Integer weights and dyadic uniforms make every sum exact: the draw is the interval holding ``u * total``.

    The oracle in exact rationals: index ``i`` is drawn iff ``c_{i-1} <= u * c_{V-1} < c_i``. Zero
    weights have empty intervals; an off-by-one (``right=False``) draws them at the boundaries.
    """
    uniforms = torch.tensor([numerator / 2**12 for numerator in numerators], dtype=torch.float64)
    rows = torch.tensor(weights, dtype=torch.float32).expand(len(numerators), -1)
    drawn = inverse_cdf(rows, uniforms).tolist()
    for numerator, index in zip(numerators, drawn, strict=True):
        threshold = Fraction(numerator, 2**12) * sum(weights)
        cumulative = list(accumulate(weights))
        assert index == next(i for i, c in enumerate(cumulative) if c > threshold)
        assert weights[index] > 0


@pytest.mark.parametrize("total", [1.0, 1.5, 1 + 2**-52, 3.0, 2**20 + 1, 1e-30])
def test_inverse_cdf_never_runs_past_the_end_nor_into_a_zero_tail(total):
    """The largest uniform (``1 - 2**-53``) draws the last token of positive weight, whatever the total."""
    weights = torch.tensor([[total / 3, total - total / 3, 0.0, 0.0]], dtype=torch.float64)
    largest = torch.tensor([1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(weights, largest).item() == 1
    assert inverse_cdf(weights, torch.zeros(1, dtype=torch.float64)).item() == 0


def test_inverse_cdf_draws_follow_the_distribution_and_a_shift_is_caught():
    """100k seeded draws pass the chi-square test; the same check rejects a 2% shift of mass (its power)."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    shifted = torch.tensor([0.48, 0.27, 0.125, 0.0625, 0.0625, 0.0])
    num_rows = 100_000
    expected = (probs[:5] * num_rows).double()
    for law, passes in ((probs, True), (shifted, False)):
        tokens = inverse_cdf_sample(law.expand(num_rows, -1).contiguous(), seed=torch.arange(num_rows), positions=3)
        observed = torch.bincount(tokens, minlength=6).double()
        assert observed[5] == 0, "a zero-probability token is never drawn"
        p_value = stats.chisquare(observed[:5], expected).pvalue
        assert p_value > 1e-3 if passes else p_value < 1e-6


def test_philox_uniform64_is_the_top_bits_of_the_first_two_words():
    """Counter 0 under key 0 (position 0 of the ACCEPT stream) gives Random123's known words 0x6627E8D5, 0xE169C58D."""
    zero = torch.zeros(1, dtype=torch.int64)
    expected = ((0x6627E8D5 >> 5) * 2**26 + (0xE169C58D >> 6)) / 2**53
    assert philox_uniform64(zero, zero, RandomStream.ACCEPT).item() == expected


def test_philox_uniform64_is_uniform_and_keyed_by_seed_position_and_stream():
    seeds = torch.arange(50_000)
    uniforms = philox_uniform64(seeds, torch.full_like(seeds, 9), RandomStream.PLAIN)
    assert uniforms.dtype == torch.float64 and ((uniforms >= 0) & (uniforms < 1)).all()
    assert stats.kstest(uniforms.numpy(), "uniform").pvalue > 1e-3
    assert len(torch.unique((uniforms * 2**53).long())) == len(seeds)
    others = [
        philox_uniform64(seeds, torch.full_like(seeds, 10), RandomStream.PLAIN),
        philox_uniform64(seeds, torch.full_like(seeds, 9), RandomStream.DRAFT),
    ]
    for other in others:  # independent: uncorrelated, never equal
        assert abs(torch.corrcoef(torch.stack([uniforms, other]))[0, 1]) < 0.03
        assert not (other == uniforms).any()


def test_inverse_cdf_sample_is_per_row_and_refuses_bad_input():
    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), dim=-1)
    seeds, positions = torch.arange(6) * 7, torch.arange(6) + 3
    together = inverse_cdf_sample(probs, seed=seeds, positions=positions)
    alone = [inverse_cdf_sample(probs[row : row + 1], seed=seeds[row], positions=positions[row]) for row in range(6)]
    assert torch.equal(together, torch.cat(alone))
    with pytest.raises(ValueError, match="float32 \\[B, V\\]"):
        inverse_cdf_sample(probs[0], seed=1, positions=0)
    with pytest.raises(ValueError, match="sums to"):
        inverse_cdf_sample(probs * 2, seed=1, positions=0)
