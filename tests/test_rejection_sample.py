"""Behaviour of `rejection_sample` on the PyTorch reference: rules, invariants, draws and errors.

Exactness of the algorithm is proven in `test_exact_oracle.py` and statistically in
`test_statistical.py`; the Triton kernel is compared with this reference in
`test_triton_kernel.py`. Here: the greedy rule, support and shape invariants, independence of the
result from batch composition and block size, determinism, the zero-draft equivalence with plain
sampling, edge cases, and the error messages of bad input.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from spark_generate import sample
from spark_generate.kernels import rejection_sample
from spark_generate.kernels.reference import RandomStream, accepts, philox_offsets, philox_uniform


def random_case(seed: int, batch_size: int, block_size: int, vocab_size: int, zero_rate: float = 0.0):
    """Random processed target/draft distributions, drafts sampled from the draft, random K_b."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, 2 * block_size + 1, vocab_size, generator=gen) * 2
    logits[torch.rand(logits.shape, generator=gen) < zero_rate] = float("-inf")
    logits[..., 0] = logits[..., 0].clamp_min(-1e4)  # keep every row with some mass
    probs = logits.softmax(-1)
    target_probs, draft_probs = probs[:, : block_size + 1], probs[:, block_size + 1 :]
    draft_token_ids = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=gen).view(batch_size, -1)
    num_draft_tokens = torch.randint(0, block_size + 1, (batch_size,), generator=gen)
    return target_probs.contiguous(), draft_probs.contiguous(), draft_token_ids, num_draft_tokens


cases = st.builds(
    random_case,
    seed=st.integers(0, 2**16),
    batch_size=st.integers(1, 6),
    block_size=st.integers(0, 6),
    vocab_size=st.integers(2, 40),
    zero_rate=st.sampled_from([0.0, 0.5]),
)


@given(cases, st.integers(0, 2**40), st.booleans())
def test_output_invariants(case, seed, one_hot):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens = case
    draft_probs = None if one_hot else draft_probs
    out, num_emitted = rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seed=seed)
    batch_size, block_size = draft_token_ids.shape
    assert out.shape == (batch_size, block_size + 1) and out.dtype == torch.int64
    assert ((num_emitted >= 1) & (num_emitted <= num_draft_tokens + 1)).all()
    for b in range(batch_size):
        n = int(num_emitted[b])
        assert torch.equal(out[b, : n - 1], draft_token_ids[b, : n - 1]), "accepted tokens are the drafts"
        assert (out[b, n:] == -1).all(), "padding is -1"
        for slot in range(n):
            assert target_probs[b, slot, out[b, slot]] > 0, "every emitted token has target probability > 0"


@given(cases, st.integers(0, 2**40))
def test_accept_scan_stops_exactly_at_the_first_failed_test(case, seed):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens = case
    batch_size, block_size = draft_token_ids.shape
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(batch_size, block_size, generator=gen)
    noise = 1 / torch.empty(batch_size, target_probs.shape[-1]).exponential_(generator=gen)
    _, num_emitted = rejection_sample(
        target_probs, draft_probs, draft_token_ids, num_draft_tokens, uniforms=uniforms, noise=noise
    )
    p = target_probs[:, :block_size].gather(-1, draft_token_ids[..., None])[..., 0]
    q = draft_probs.gather(-1, draft_token_ids[..., None])[..., 0]
    passed = accepts(uniforms, p, q)
    for b in range(batch_size):
        n_accepted = int(num_emitted[b]) - 1
        assert passed[b, :n_accepted].all()
        if n_accepted < num_draft_tokens[b]:
            assert not passed[b, n_accepted]


@given(cases)
def test_greedy_accepts_the_longest_prefix_matching_the_target_argmax(case):
    target_probs, _, _, num_draft_tokens = case
    batch_size, block_size_plus_one, _ = target_probs.shape
    argmax = target_probs.argmax(-1)
    # Drafts that agree with the argmax up to a random slot, then disagree.
    agree = torch.randint(0, block_size_plus_one, (batch_size,))
    slots = torch.arange(block_size_plus_one - 1)
    draft_token_ids = torch.where(
        slots < agree[:, None], argmax[:, :-1], (argmax[:, :-1] + 1) % target_probs.shape[-1]
    )
    out, num_emitted = rejection_sample(target_probs, None, draft_token_ids, num_draft_tokens, greedy=True, seed=3)
    expected_accepted = torch.minimum(agree, num_draft_tokens)
    assert torch.equal(num_emitted, expected_accepted + 1)
    for b in range(batch_size):
        n = int(num_emitted[b])
        assert torch.equal(out[b, :n], argmax[b, :n]), "greedy emits the target argmax at every slot"


def test_greedy_rows_mixed_with_sampled_rows_are_each_decided_by_their_rule(backend):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens = random_case(0, 8, 4, 11)
    greedy = torch.tensor([True, False] * 4)
    mixed, mixed_n = rejection_sample(
        target_probs,
        draft_probs,
        draft_token_ids,
        num_draft_tokens,
        greedy=greedy,
        seed=torch.arange(8),
        backend=backend,
    )
    for value in (True, False):
        alone, alone_n = rejection_sample(
            target_probs,
            draft_probs,
            draft_token_ids,
            num_draft_tokens,
            greedy=value,
            seed=torch.arange(8),
            backend=backend,
        )
        rows = greedy == value
        assert torch.equal(mixed[rows], alone[rows]) and torch.equal(mixed_n[rows], alone_n[rows])


def test_greedy_ties_go_to_the_first_index(backend):
    target_probs = torch.tensor([[[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]]])
    out, n = rejection_sample(target_probs, None, torch.tensor([[1]]), torch.tensor([1]), greedy=True, backend=backend)
    assert n.item() == 1 and out[0, 0].item() == 0


def test_greedy_rows_emit_the_target_argmax_at_a_rejection_whatever_q_is(backend):
    """A greedy row given the (non-one-hot) q its drafts came from still emits argmax p, never a residual draw.

    Row 0 rejects at slot 0: ``max(p - q, 0) = (0.05, 0.4, 0)`` peaks at token 1, the target at token
    0. Row 1 accepts its first draft and rejects at slot 1, where the residual peaks at token 2.
    Random rows of mixed lengths follow.
    """
    target_probs = torch.tensor([
        [[0.5, 0.4, 0.1], [0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3]],
        [[0.1, 0.7, 0.2], [0.6, 0.1, 0.3], [0.2, 0.2, 0.6]],
    ])  # fmt: skip
    draft_probs = torch.tensor([
        [[0.45, 0.0, 0.55], [1 / 3, 1 / 3, 1 / 3]],
        [[0.1, 0.8, 0.1], [0.5, 0.5, 0.0]],
    ])  # fmt: skip
    out, n = rejection_sample(target_probs, draft_probs, torch.tensor([[2, 0], [1, 1]]), torch.tensor([2, 2]),
                              greedy=True, seed=0, backend=backend)  # fmt: skip
    assert n.tolist() == [1, 2] and out.tolist() == [[0, -1, -1], [1, 0, -1]]

    target_probs, draft_probs, draft_token_ids, num_draft_tokens = random_case(3, 16, 4, 7)
    out, n = rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy=True, seed=1,
                              backend=backend)  # fmt: skip
    argmax = target_probs.argmax(-1)
    for row in range(16):
        assert out[row, : n[row]].tolist() == argmax[row, : n[row]].tolist(), row


@given(cases, st.integers(0, 2**40))
def test_rows_do_not_depend_on_the_rest_of_the_batch(case, seed):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens = case
    batch_size = target_probs.shape[0]
    seeds = seed + torch.arange(batch_size) * 7919
    positions = torch.arange(batch_size) * 13
    out, n = rejection_sample(
        target_probs, draft_probs, draft_token_ids, num_draft_tokens, seed=seeds, positions=positions
    )
    perm = torch.randperm(batch_size, generator=torch.Generator().manual_seed(seed % 1000))
    out_perm, n_perm = rejection_sample(
        target_probs[perm], draft_probs[perm], draft_token_ids[perm], num_draft_tokens[perm],
        seed=seeds[perm], positions=positions[perm],
    )  # fmt: skip
    assert torch.equal(out[perm], out_perm) and torch.equal(n[perm], n_perm)
    for b in range(batch_size):
        alone, n_alone = rejection_sample(
            target_probs[b : b + 1], draft_probs[b : b + 1], draft_token_ids[b : b + 1],
            num_draft_tokens[b : b + 1], seed=seeds[b : b + 1], positions=positions[b : b + 1],
        )  # fmt: skip
        assert torch.equal(alone[0], out[b]) and n_alone[0] == n[b]


@given(cases, st.integers(0, 2**40), st.integers(0, 4))
def test_result_does_not_depend_on_the_padded_block_size(case, seed, extra_slots):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens = case
    batch_size, _, vocab_size = target_probs.shape
    uniform_rows = torch.full((batch_size, extra_slots, vocab_size), 1.0 / vocab_size)
    out, n = rejection_sample(target_probs, draft_probs, draft_token_ids, num_draft_tokens, seed=seed, positions=5)
    wider, wider_n = rejection_sample(
        torch.cat([target_probs, uniform_rows], 1), torch.cat([draft_probs, uniform_rows], 1),
        torch.cat([draft_token_ids, torch.zeros(batch_size, extra_slots, dtype=torch.int64)], 1),
        num_draft_tokens, seed=seed, positions=5,
    )  # fmt: skip
    assert torch.equal(wider_n, n)
    assert torch.equal(wider[:, : out.shape[1]], out) and (wider[:, out.shape[1] :] == -1).all()


def test_same_seed_and_position_give_the_same_tokens_and_others_differ():
    case = random_case(1, 64, 5, 9)
    first = rejection_sample(*case, seed=11, positions=100)
    again = rejection_sample(*case, seed=11, positions=100)
    other_seed = rejection_sample(*case, seed=12, positions=100)
    other_position = rejection_sample(*case, seed=11, positions=101)
    assert torch.equal(first[0], again[0])
    assert not torch.equal(first[0], other_seed[0])
    assert not torch.equal(first[0], other_position[0])


def test_generator_mode_is_reproducible_with_a_seeded_generator():
    case = random_case(2, 16, 4, 9)
    a = rejection_sample(*case, generator=torch.Generator().manual_seed(5))
    b = rejection_sample(*case, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0])


@given(st.integers(2, 40), st.integers(0, 2**40), st.integers(0, 1000), st.integers(0, 5))
def test_bonus_token_is_the_plain_sampler_draw_at_its_position(vocab_size, seed, position, num_drafts):
    """With every draft accepted (q == p), the bonus token equals plain sampling at its position."""
    gen = torch.Generator().manual_seed(seed % 2**31)
    target_probs = torch.randn(1, num_drafts + 1, vocab_size, generator=gen).softmax(-1)
    draft_probs = target_probs[:, :num_drafts].clone()
    # p == q and u < 1 accept every draft; use the argmax so p(d) > 0.
    draft_token_ids = target_probs[:, :num_drafts].argmax(-1)
    out, n = rejection_sample(
        target_probs, draft_probs, draft_token_ids, torch.tensor([num_drafts]), seed=seed, positions=position
    )
    assert n.item() == num_drafts + 1
    plain = sample(target_probs[:, num_drafts], seed=seed, positions=position + num_drafts)
    assert out[0, num_drafts] == plain[0]


def test_zero_drafts_emit_exactly_what_plain_sampling_emits():
    gen = torch.Generator().manual_seed(0)
    probs = torch.randn(256, 1, 50, generator=gen).softmax(-1)
    seeds, positions = torch.arange(256) * 3 + 1, torch.arange(256) % 17
    out, n = rejection_sample(
        probs, None, torch.zeros(256, 0, dtype=torch.int64), torch.zeros(256, dtype=torch.int64),
        seed=seeds, positions=positions,
    )  # fmt: skip
    assert (n == 1).all()
    assert torch.equal(out[:, 0], sample(probs[:, 0], seed=seeds, positions=positions))


def test_draft_stream_is_independent_of_the_verifier_streams():
    seeds, positions = torch.full((1,), 42), torch.full((1,), 7)
    token_ids = torch.arange(4096)
    streams = [philox_uniform(seeds, philox_offsets(positions, s, token_ids)) for s in RandomStream]
    for i in range(len(streams)):
        for j in range(i + 1, len(streams)):
            assert not torch.equal(streams[i], streams[j])
            assert abs(torch.corrcoef(torch.stack([streams[i], streams[j]]))[0, 1]) < 0.1


def test_equal_distributions_accept_everything_even_for_uniforms_next_to_one(backend):
    target_probs = torch.tensor([[[0.25, 0.75], [0.5, 0.5], [0.9, 0.1]]])
    out, n = rejection_sample(
        target_probs, target_probs[:, :2].clone(), torch.tensor([[0, 1]]), torch.tensor([2]),
        uniforms=torch.tensor([[1 - 2**-24, 1 - 2**-24]]), noise=torch.tensor([[1.0, 1.0]]), backend=backend,
    )  # fmt: skip
    assert n.item() == 3 and out[0].tolist() == [0, 1, 0]


def test_zero_target_probability_is_rejected_even_for_a_zero_uniform(backend):
    target_probs = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    out, n = rejection_sample(
        target_probs, torch.tensor([[[1.0, 0.0]]]), torch.tensor([[0]]), torch.tensor([1]),
        uniforms=torch.zeros(1, 1), noise=torch.ones(1, 2), backend=backend,
    )  # fmt: skip
    assert n.item() == 1 and out[0].tolist() == [1, -1]


def test_one_hot_drafts_recover_from_the_target_without_the_rejected_token(backend):
    target_probs = torch.tensor([[[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]]])
    # u * 1 >= p(0) = 0.5 rejects token 0; the race prefers token 0 unless it is removed.
    out, n = rejection_sample(
        target_probs, None, torch.tensor([[0]]), torch.tensor([1]),
        uniforms=torch.tensor([[0.6]]), noise=torch.tensor([[100.0, 1.0, 2.0]]), backend=backend,
    )  # fmt: skip
    assert n.item() == 1 and out[0, 0].item() == 2


def test_numerically_empty_residual_falls_back_to_the_target(backend):
    target_probs = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    draft_probs = torch.tensor([[[0.5, 0.5, 0.0]]])
    # Force a rejection of an equal-probability token with u*q == p; the residual is all zero.
    out, n = rejection_sample(
        target_probs, draft_probs, torch.tensor([[1]]), torch.tensor([1]),
        uniforms=torch.tensor([[1.0 - 2**-24]]), noise=torch.tensor([[1.0, 2.0, 9.0]]), validate=False,
        backend=backend,
    )  # fmt: skip
    assert n.item() == 2  # equal probabilities are always accepted
    draft_probs = torch.tensor([[[0.5, 0.5, 0.0]]]) * (1 + 2**-23)  # q rounds just above p
    out, n = rejection_sample(
        target_probs, draft_probs, torch.tensor([[1]]), torch.tensor([1]),
        uniforms=torch.tensor([[1.0 - 2**-24]]), noise=torch.tensor([[1.0, 2.0, 9.0]]), validate=False,
        backend=backend,
    )  # fmt: skip
    assert n.item() == 1 and out[0, 0].item() == 1, "falls back to p, never to a zero-probability token"


BAD_INPUTS = {
    "target not 3-d": (
        dict(target_probs=torch.ones(2, 3)),
        "target_probs must be a \\[B, K\\+1, V\\] tensor",
    ),
    "target float64": (dict(target_probs=torch.full((1, 2, 2), 0.5, dtype=torch.float64)), "torch.float32"),
    "draft shape": (dict(draft_probs=torch.full((1, 2, 2), 0.5)), "draft_probs has shape \\[1, 2, 2\\]"),
    "token dtype": (dict(draft_token_ids=torch.zeros(1, 1, dtype=torch.int32)), "expected torch.int64"),
    "lengths float": (dict(num_draft_tokens=torch.ones(1)), "integer tensor"),
    "length too long": (dict(num_draft_tokens=torch.tensor([2])), "out of range; expected 0..K = 0..1"),
    "negative length": (dict(num_draft_tokens=torch.tensor([-1])), "out of range"),
    "nan target": (dict(target_probs=torch.tensor([[[float("nan"), 1.0], [0.5, 0.5]]])), "NaN"),
    "nan bonus row": (
        dict(target_probs=torch.tensor([[[0.5, 0.5], [float("nan"), 1.0]]])),
        "target_probs\\[0, 1\\] holds NaN",
    ),
    "bonus row not normalised": (
        dict(target_probs=torch.tensor([[[0.5, 0.5], [0.5, 0.6]]])),
        "target_probs\\[0, 1\\] sums to 1.1",
    ),
    "infinite bonus row, no drafts": (
        dict(target_probs=torch.tensor([[[float("inf"), 0.5], [0.5, 0.5]]]), num_draft_tokens=torch.tensor([0])),
        "target_probs\\[0, 0\\] holds NaN, infinite",
    ),
    "negative draft": (dict(draft_probs=torch.tensor([[[1.5, -0.5]]])), "negative"),
    "logits not probs": (dict(target_probs=torch.tensor([[[2.0, 1.0], [0.5, 0.5]]])), "sums to 3"),
    "token id out of vocab": (dict(draft_token_ids=torch.tensor([[5]])), "is not a token id"),
    "seed and draws": (dict(seed=1, uniforms=torch.zeros(1, 1), noise=torch.ones(1, 2)), "not both"),
    "one explicit draw": (dict(uniforms=torch.zeros(1, 1)), "both uniforms"),
    "positions without seed": (dict(positions=3), "needs seed"),
    "uniform of one": (dict(uniforms=torch.ones(1, 1), noise=torch.ones(1, 2)), "\\[0, 1\\)"),
    "zero noise": (dict(uniforms=torch.zeros(1, 1), noise=torch.zeros(1, 2)), "> 0"),
    "greedy float": (dict(greedy=torch.ones(1)), "greedy has dtype"),
    "seed float": (dict(seed=1.5), "must be a int"),
    "unknown backend": (dict(backend="cuda"), "backend='cuda' is not supported"),
}


@pytest.mark.parametrize("override, message", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_a_clear_error(override, message):
    args = dict(
        target_probs=torch.tensor([[[0.5, 0.5], [0.5, 0.5]]]),
        draft_probs=torch.tensor([[[0.5, 0.5]]]),
        draft_token_ids=torch.tensor([[1]]),
        num_draft_tokens=torch.tensor([1]),
    )
    args.update(override)
    with pytest.raises(ValueError, match=message):
        rejection_sample(**args)
