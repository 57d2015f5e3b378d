"""The PyTorch reference of lossless verification: the specification every backend must match.

Chain rejection sampling (Leviathan et al. 2023; Chen et al. 2023) verifies a block of drafted
tokens against the target model. For each row, draft slot ``j`` holds a token ``d_j`` that was
sampled from the draft distribution ``q_j``, and the target gives ``p_j`` at the same slot:

1. Scan the slots left to right. Slot ``j`` is *accepted* iff ``u_j * q_j(d_j) < p_j(d_j)`` for a
   fresh uniform ``u_j`` in ``[0, 1)``, i.e. with probability ``min(1, p_j(d_j) / q_j(d_j))``. The
   strict ``<`` never accepts a token the target gives probability zero, even when ``u_j == 0``.
2. At the first rejected slot, emit one *recovered* token from the residual ``max(p_j - q_j, 0)``.
   If every slot is accepted, emit one *bonus* token from the target row after the last draft.

Each row therefore emits ``accepted + 1`` tokens, whose joint law is exactly the target's, for any
draft distributions. The single categorical draw per row is an exponential race: with independent
``E_v ~ Exp(1)``, ``argmax_v w_v / E_v`` is distributed as ``w / sum(w)``. The race needs neither
the normalisation of the residual nor a division, it decomposes over any split of the vocabulary
(so block sizes cannot change the result), and the exact path uses only IEEE multiply, subtract,
max and compare, which is what lets the Triton kernel match this file bit for bit. The race reads
its noise as *race weights* ``noise_v = 1 / E_v``.

Temperature-0 ("greedy") rows accept while the draft equals the target's argmax and then emit the
target's argmax; this is the same rule with ``p`` replaced by the one-hot of its argmax.

Randomness is counter-based: Philox4x32-10, bit-identical to Triton's ``tl.rand`` and
``tl.rand4x``, keyed by a per-row seed and an offset built from the absolute position of the token
being decided, a stream and the vocabulary index (see :func:`philox_offsets`; race noise takes four
tokens per counter). A position is decided exactly once, so no draw is ever reused, and the result
depends neither on the other rows of the batch nor on the block size. The streams keep the
draft's own sampling noise independent of the verifier's noise; sharing them biases the output
(a bug peers have shipped).

A draw outside verification (a plain decoding step, a draft) needs no race: :func:`inverse_cdf`
takes the first token whose cumulative weight, summed in float64, exceeds ``u`` times the total,
for one 53-bit uniform per row (:func:`philox_uniform64`). It reads the weights once and draws
one Philox counter instead of ``V / 4``, which on a CPU is the difference between a few percent of
a decoding step and nothing.

The helpers :func:`accepts`, :func:`acceptance_probability` and :func:`residual` are written with
arithmetic operators only, so the exact-arithmetic test oracle runs them on ``fractions.Fraction``
values and checks this very code, not a re-derivation.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = [
    "RandomStream",
    "acceptance_probability",
    "accepts",
    "exponential_race",
    "generator_race_noise",
    "inverse_cdf",
    "philox_offsets",
    "philox_race_noise",
    "philox_uniform",
    "philox_uniform4x",
    "philox_uniform64",
    "race_noise_from_uniform",
    "rejection_sample_reference",
    "residual",
]

_MASK32 = 0xFFFFFFFF
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUNDS = 10
# Triton's int32 -> [0, 1) scale: the largest float32 with (2**31 - 1) * scale < 1.
_UNIFORM_SCALE = 4.6566127342e-10
# Uniforms are clamped to this before -log(u), so every race weight is finite and positive (a
# token with probability > 0 can always win). 2**-32 is below every non-zero uniform Philox draws.
MIN_RACE_UNIFORM = 2.0**-32
# Seeded exponentials are clamped from below so that 1 / E stays finite on the generator path.
_MIN_EXPONENTIAL = torch.finfo(torch.float32).tiny
NUM_STREAMS = 4


class RandomStream(enum.IntEnum):
    """Disjoint Philox counter domains for the draws made at one absolute position.

    The draft's sampling noise must be independent of the verifier's: ``DRAFT`` is reserved for
    drafting. ``RESIDUAL`` is also :func:`spark_generate.sample`'s default stream, so a
    verification step with no drafts emits exactly what that sampler emits for the same seed and
    position. ``PLAIN`` is the decoding loop's plain steps (an inverse-CDF draw,
    :func:`philox_uniform64`): a position the target samples without drafts.
    """

    ACCEPT = 0
    RESIDUAL = 1
    DRAFT = 2
    PLAIN = 3


def philox_offsets(positions: torch.Tensor, stream: RandomStream, token_ids: torch.Tensor) -> torch.Tensor:
    """Builds the 64-bit Philox offsets ``token_id + ((position * 4 + stream) << 32)``.

    Args:
        positions: int64 absolute positions, broadcastable against ``token_ids``.
        stream: the counter domain of the draw.
        token_ids: int64 vocabulary indices (0 for the one acceptance uniform of a position).

    Returns:
        int64 offsets of the broadcast shape: the low word is the token id, the high word encodes
        position and stream.
    """
    return token_ids + ((positions * NUM_STREAMS + int(stream)) << 32)


def _philox_words(
    seeds: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four 32-bit output words of Philox4x32-10, as Triton's ``randint4x(seed, offset)``."""
    seeds, offsets = seeds.to(torch.int64), offsets.to(torch.int64)
    return _philox_rounds(seeds, offsets & _MASK32, (offsets >> 32) & _MASK32)


def _philox_rounds(
    seeds: torch.Tensor, counter_low: torch.Tensor, counter_high: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32-10 on the counter ``(low, high, 0, 0)`` and key ``seed``, the words broadcast lazily.

    Products wrap modulo 2**64 in int64, which keeps their exact low 64 bits, and the masks recover
    the 32-bit words. Nothing is broadcast up front: a race draw's counter low word is the token
    (``[1, V / 4]``) while its high word and key are per row (``[B, 1]``), and the first rounds
    mix them only partly, which saves about a third of the work of a full-size start.

    Args:
        seeds: int64 keys, broadcastable against the counter words.
        counter_low: int64 low counter words in ``[0, 2**32)``.
        counter_high: int64 high counter words in ``[0, 2**32)``.

    Returns:
        The four int64 output words in ``[0, 2**32)``, broadcast to a common shape.
    """
    c0, c1 = counter_low, counter_high
    c2 = c3 = torch.zeros((), dtype=torch.int64, device=seeds.device)
    k0 = seeds & _MASK32
    k1 = (seeds >> 32) & _MASK32
    for _ in range(_PHILOX_ROUNDS):
        product_a = c0 * _PHILOX_ROUND_A
        product_b = c2 * _PHILOX_ROUND_B
        c0, c1, c2, c3 = (
            ((product_b >> 32) & _MASK32) ^ c1 ^ k0,
            product_b & _MASK32,
            ((product_a >> 32) & _MASK32) ^ c3 ^ k1,
            product_a & _MASK32,
        )
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)  # every word has mixed every input by now
    return c0, c1, c2, c3


def _word_to_uniform(word: torch.Tensor) -> torch.Tensor:
    """32-bit words to float32 in ``[0, 1)``, as ``triton.language.random.uint_to_uniform_float``.

    Triton reads the word as a signed int32 ``x`` and maps negative ``x`` to ``-x - 1``; for a word
    ``w >= 2**31`` that is ``2**32 - 1 - w``, i.e. ``w XOR 0xFFFFFFFF``.
    """
    magnitude = torch.where(word >= 2**31, word ^ _MASK32, word)
    return magnitude.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)


def philox_uniform(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Uniform float32 draws in ``[0, 1)``, bit-identical to Triton's ``tl.rand(seed, offset)``.

    Args:
        seeds: int64 seeds (any 64-bit value), broadcastable against ``offsets``.
        offsets: int64 counters (see :func:`philox_offsets`).

    Returns:
        float32 uniforms of the broadcast shape.
    """
    return _word_to_uniform(_philox_words(seeds, offsets)[0])


def philox_uniform4x(seeds: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Four uniforms per counter, bit-identical to Triton's ``tl.rand4x(seed, offset)``.

    Args:
        seeds: int64 seeds, broadcastable against ``offsets``.
        offsets: int64 counters.

    Returns:
        float32 ``[*broadcast shape, 4]``; lane 0 equals :func:`philox_uniform`.
    """
    return _word_to_uniform(torch.stack(_philox_words(seeds, offsets), dim=-1))


def philox_uniform64(seeds: torch.Tensor, positions: torch.Tensor, stream: RandomStream) -> torch.Tensor:
    """One float64 uniform in ``[0, 1)`` with 53 random bits per (seed, position), on a stream.

    The bits are the top 27 of word 0 and the top 26 of word 1 of the Philox counter
    ``philox_offsets(position, stream, 0)`` (the counter of vocabulary index 0), so every multiple
    of ``2**-53`` in ``[0, 1)`` is equally likely.

    Args:
        seeds: int64 seeds, broadcastable against ``positions``.
        positions: int64 absolute positions of the drawn tokens.
        stream: The counter domain of the draw.

    Returns:
        float64 uniforms of the broadcast shape.
    """
    positions = positions.to(torch.int64)
    words = _philox_words(seeds, philox_offsets(positions, stream, torch.zeros_like(positions)))
    bits = (words[0] >> 5) * 2**26 + (words[1] >> 6)  # < 2**53: exact in float64
    return bits.to(torch.float64) * 2.0**-53


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draws one index per row from ``weights / weights.sum()``: the inverse of the float64 cumulative sum at ``u``.

    Index ``i`` is drawn iff ``c_{i-1} <= u * c_{V-1} < c_i`` for the cumulative sums ``c`` of the
    row, an interval of width ``w_i`` up to float64 rounding of the sums (about ``1e-16`` of the
    total). A zero weight adds exactly nothing, so its interval is empty and the token is never
    drawn. Nothing is drawn past the end: for ``u <= 1 - 2**-53`` the rounded product ``u * c``
    stays below ``c`` (at ``c = m * 2**e`` with ``1 < m < 2``, ``c * 2**-53`` is more than half the
    spacing below ``c``; at ``m = 1`` the product is exact).

    Args:
        weights: float32 or float64 ``[B, V]`` non-negative, unnormalised, with a positive sum.
        uniforms: ``[B]`` uniforms in ``[0, 1)`` (float64 for all their bits, see :func:`philox_uniform64`).

    Returns:
        int64 ``[B]`` drawn indices.
    """
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    thresholds = uniforms.to(torch.float64) * cumulative[:, -1]
    return torch.searchsorted(cumulative, thresholds[:, None], right=True)[:, 0]


def race_noise_from_uniform(uniforms: torch.Tensor) -> torch.Tensor:
    """Race weights ``1 / E`` with ``E = -log(u)``, ``u`` clamped to at least ``MIN_RACE_UNIFORM``.

    Args:
        uniforms: float32 uniforms in ``[0, 1)``, any shape.

    Returns:
        float32 race weights of the same shape, finite and positive.
    """
    return 1.0 / -torch.log(uniforms.clamp_min(MIN_RACE_UNIFORM))


def philox_race_noise(
    seeds: torch.Tensor, positions: torch.Tensor, stream: RandomStream, vocab_size: int
) -> torch.Tensor:
    """Race weights for one categorical draw per row at the given absolute positions.

    One Philox evaluation yields four uniforms, so the noise of token ``v`` is lane ``v % 4`` of the
    counter ``v // 4`` (a quarter of the Philox rounds of one draw per token).

    Args:
        seeds: int64 ``[B]`` per-row seeds.
        positions: int64 ``[B]`` absolute position of the token each row draws.
        stream: the counter domain (``RESIDUAL`` for verification and plain sampling).
        vocab_size: ``V``.

    Returns:
        float32 ``[B, V]`` race weights.
    """
    counters = torch.arange((vocab_size + 3) // 4, device=seeds.device, dtype=torch.int64)
    # The offsets of philox_offsets(positions, stream, counters), split into their 32-bit words.
    high = philox_offsets(positions.to(torch.int64), stream, torch.zeros_like(positions, dtype=torch.int64)) >> 32
    words = _philox_rounds(seeds.to(torch.int64)[:, None], counters[None, :], (high & _MASK32)[:, None])
    uniforms = _word_to_uniform(torch.stack(words, dim=-1)).flatten(start_dim=1)[:, :vocab_size]
    return race_noise_from_uniform(uniforms)


def generator_race_noise(
    shape: tuple[int, ...], device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """Race weights ``1 / E`` drawn from a torch generator (or the global one when ``None``)."""
    exponentials = torch.empty(shape, device=device, dtype=torch.float32).exponential_(generator=generator)
    return 1.0 / exponentials.clamp_min(_MIN_EXPONENTIAL)


def accepts(uniform: Any, target_prob: Any, draft_prob: Any) -> Any:
    """The acceptance test ``u * q(d) < p(d)`` (tensors elementwise, or exact numbers).

    Strict, so a token the target gives probability zero is never accepted, even for ``u == 0``;
    a draft probability of zero (underflow) accepts any token the target allows.
    """
    return uniform * draft_prob < target_prob


def acceptance_probability(target_prob: Any, draft_prob: Any) -> Any:
    """The probability over ``u ~ U[0, 1)`` that :func:`accepts` holds: ``min(1, p / q)``.

    Works on exact numbers (``fractions.Fraction``) for the test oracle; ``q == 0`` gives 1 when
    ``p > 0`` and 0 otherwise, as :func:`accepts` does.
    """
    if draft_prob == 0:
        return 1 if target_prob > 0 else 0
    ratio = target_prob / draft_prob
    return ratio if ratio < 1 else 1


def residual(target_probs: Any, draft_probs: Any) -> Any:
    """The unnormalised residual ``max(p - q, 0)`` a rejected slot recovers from.

    Args:
        target_probs: ``[..., V]`` tensor, or an exact number.
        draft_probs: same shape as ``target_probs``.

    Returns:
        The elementwise positive part of the difference, same type and shape.
    """
    difference = target_probs - draft_probs
    return difference * (difference > 0)


def exponential_race(weights: torch.Tensor, noise: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Draws one index per row from ``weights / weights.sum()`` by the race ``argmax(w * noise)``.

    Rows whose weights are numerically all zero (a residual of ``p == q`` with a rounding-level
    rejection) race on ``fallback`` instead. Ties go to the first index, like ``tl.argmax`` with
    ``tie_break_left``.

    Args:
        weights: float32 ``[B, V]`` non-negative, unnormalised.
        noise: float32 ``[B, V]`` positive race weights ``1 / E``.
        fallback: float32 ``[B, V]`` distribution used by rows whose ``weights`` race is empty.

    Returns:
        int64 ``[B]`` drawn indices.
    """
    scores = weights * noise
    empty = ~(scores > 0).any(dim=-1, keepdim=True)
    scores = torch.where(empty, fallback * noise, scores)
    return scores.argmax(dim=-1)


def rejection_sample_reference(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chain rejection sampling of a padded batch of drafted blocks, vectorised over rows.

    Inputs are assumed validated (see :func:`spark_generate.kernels.rejection_sample`). The draws
    come either explicitly (``uniforms`` and ``noise``) or from Philox (``seeds`` and
    ``positions``); exactly one of the two pairs is given.

    Args:
        target_probs: float32 ``[B, K+1, V]``; row ``K_b`` of row ``b`` is its bonus distribution.
        draft_probs: float32 ``[B, K, V]`` the drafts were sampled from, or ``None`` for
            deterministic drafts (``q`` is then the one-hot of the drafted token).
        draft_token_ids: int64 ``[B, K]``; slots ``>= K_b`` are ignored.
        num_draft_tokens: int64 ``[B]`` draft lengths ``K_b`` in ``0..K``.
        greedy: bool ``[B]`` temperature-0 rows.
        uniforms: float32 ``[B, K]`` acceptance uniforms, explicit-draw mode.
        noise: float32 ``[B, V]`` race weights of the one categorical draw, explicit-draw mode.
        seeds: int64 ``[B]`` Philox seeds, counter mode.
        positions: int64 ``[B]`` absolute position of draft slot 0, counter mode.

    Returns:
        ``output_token_ids`` int64 ``[B, K+1]`` (accepted drafts, then the recovered or bonus
        token, then -1) and ``num_emitted`` int64 ``[B]`` (= accepted + 1).

    Example:
        With ``K = 3``, ``K_b = 3`` and a rejection at slot 1, the row emits
        ``[d_0, r_1, -1, -1]`` where ``r_1`` is drawn from ``max(p_1 - q_1, 0)``;
        ``num_emitted = 2``.
    """
    batch_size, block_size_plus_one, vocab_size = target_probs.shape
    block_size = block_size_plus_one - 1
    rows = torch.arange(batch_size, device=target_probs.device)
    slots = torch.arange(block_size, device=target_probs.device)
    valid = slots[None, :] < num_draft_tokens[:, None]
    safe_draft_ids = torch.where(valid, draft_token_ids, 0)

    target_at_draft = target_probs[:, :block_size].gather(-1, safe_draft_ids[..., None])[..., 0]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(-1, safe_draft_ids[..., None])[..., 0]
    if uniforms is None:
        offsets = philox_offsets(positions[:, None] + slots[None, :], RandomStream.ACCEPT, torch.zeros_like(slots))
        uniforms = philox_uniform(seeds[:, None], offsets)
    sampled_accept = accepts(uniforms, target_at_draft, draft_at_draft)
    greedy_accept = target_probs[:, :block_size].argmax(dim=-1) == draft_token_ids
    accepted = torch.where(greedy[:, None], greedy_accept, sampled_accept)

    # The slot where the scan stops: the first rejected one, else K_b (the bonus slot). A sentinel
    # column keeps argmax (first maximal index) defined for K = 0 and rows without a rejection.
    rejected_slots = valid & ~accepted
    sentinel = torch.ones((batch_size, 1), dtype=torch.bool, device=target_probs.device)
    first_rejected = torch.cat([rejected_slots, sentinel], dim=1).to(torch.int8).argmax(dim=1)
    stop = torch.minimum(first_rejected, num_draft_tokens)
    recover = (stop < num_draft_tokens) & ~greedy

    stop_target = target_probs[rows, stop]
    stop_draft = torch.zeros_like(stop_target)
    if block_size > 0:
        draft_slot = stop.clamp(max=block_size - 1)
        if draft_probs is None:
            stop_draft[rows, safe_draft_ids[rows, draft_slot]] = 1.0
        else:
            stop_draft = draft_probs[rows, draft_slot]
    weights = torch.where(recover[:, None], residual(stop_target, stop_draft), stop_target)
    if noise is None:
        noise = philox_race_noise(seeds, positions + stop, RandomStream.RESIDUAL, vocab_size)
    noise = torch.where(greedy[:, None], torch.ones_like(noise), noise)
    final_token = exponential_race(weights, noise, fallback=stop_target)

    output_token_ids = torch.where(slots[None, :] < stop[:, None], draft_token_ids, -1)
    output_token_ids = torch.cat([output_token_ids, output_token_ids.new_full((batch_size, 1), -1)], dim=1)
    output_token_ids[rows, stop] = final_token
    return output_token_ids, stop + 1
