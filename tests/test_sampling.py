"""Plain sampling: the right law, the support, greedy ties, streams and errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from spark_generate import RandomStream, sample
from spark_generate.kernels.reference import (
    philox_offsets,
    philox_race_noise,
    philox_uniform4x,
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
