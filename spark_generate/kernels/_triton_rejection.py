"""Triton kernel for chain rejection sampling, bit-exact against ``kernels/reference.py``.

One program verifies one row: a scalar scan over the row's ``K_b`` draft slots, then exactly one
categorical draw, an exponential race over the vocabulary in blocks of ``BLOCK_V`` with a running
``(best score, index)`` that only a strictly larger score replaces. Ties therefore go to the first
index in every block split, and the result does not depend on ``BLOCK_V``. Only the slot where the
scan stops is read in full (``2V`` floats for a recovered token, ``V`` for a bonus token): no
recovered token is computed for slots that are never used.

Exactness against the reference: the accept test is one IEEE multiply and a compare, the residual
one subtract and a max, the race one multiply and compares; no division and no fused
multiply-add is on that path (the launcher turns FP fusion off). In explicit-draw mode the kernel
and the reference are therefore equal token for token on any device. In counter (Philox) mode the
acceptance uniforms are bit-identical too (integer Philox, ``tl.rand``), while the race weights
``1 / -log(u)`` use the device's ``log``, so residual draws can differ from the CPU reference at
near-ties; tests compare backends in explicit-draw mode.

Offsets are computed in int64: ``B * (K + 1) * V`` exceeds ``2**31`` at a 152k vocabulary.

When a split-V variant pays off: with one program per row, a batch of ``B`` rows occupies ``B``
SMs. For ``B >= ~32`` (or any ``B`` at a 32k vocabulary) that is enough to saturate memory
bandwidth, and this kernel is what we launch. For a handful of rows at a 150k+ vocabulary the
single draw reads ~1.2 MB per row from one SM, so latency is bound by one SM's bandwidth; a
split-V variant gives each row ``cdiv(V, BLOCK_V)`` programs that each redo the (cheap, scalar)
accept scan, race their block, and write ``(best score, index)`` to a ``[B, num_blocks]`` scratch
that a second launch reduces with the same strict ``>`` in block order. Because the noise of a
token depends only on its index, the result is identical to this kernel's. Add it when a GPU
benchmark shows the single-program kernel above the latency goal at small batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spark_generate.kernels.reference import MIN_RACE_UNIFORM, NUM_STREAMS, RandomStream

_DEFAULT_BLOCK_V = 1024


@triton.jit
def _row_argmax(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """First index of the row's maximum, scanning the vocabulary block by block."""
    best_value = tl.full((), -1.0, tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offsets = v0 + tl.arange(0, BLOCK_V)
        values = tl.load(row_ptr + offsets, mask=offsets < vocab_size, other=-1.0)
        block_max, block_index = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = block_max > best_value
        best_index = tl.where(take, v0 + block_index, best_index)
        best_value = tl.maximum(block_max, best_value)
    return best_index


@triton.jit
def _race(
    target_row_ptr,
    draft_row_ptr,
    noise_row_ptr,
    seed,
    noise_offset_base,
    vocab_size,
    recover,
    use_noise,
    rejected_token,
    BLOCK_V: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    PHILOX: tl.constexpr,
    MIN_UNIFORM: tl.constexpr,
):
    """Best ``(score, index)`` of the race ``argmax(w * noise)`` over one vocabulary row.

    ``w`` is the residual ``max(p - q, 0)`` when ``recover`` is set (for one-hot drafts: ``p``
    without ``rejected_token``, which is -1 when nothing was rejected), ``p`` otherwise; greedy rows race with
    unit noise, which makes the race an argmax.
    """
    best_score = tl.full((), -1.0, tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        offsets = v0 + tl.arange(0, BLOCK_V)
        in_vocab = offsets < vocab_size
        weights = tl.load(target_row_ptr + offsets, mask=in_vocab, other=0.0)
        if HAS_DRAFT_PROBS:
            # `offsets < limit` rather than `in_vocab & recover`: the interpreter mistypes `&`
            # between a block and a scalar flag.
            draft = tl.load(draft_row_ptr + offsets, mask=offsets < tl.where(recover, vocab_size, 0), other=0.0)
            weights = tl.where(recover, tl.maximum(weights - draft, 0.0), weights)
        else:
            weights = tl.where(offsets == rejected_token, 0.0, weights)
        if PHILOX:
            # Token v takes lane v % 4 of the Philox block at counter v // 4, as the reference.
            lane = offsets % 4
            u0, u1, u2, u3 = tl.rand4x(seed, noise_offset_base + (offsets // 4).to(tl.int64))
            uniform = tl.where(lane == 0, u0, tl.where(lane == 1, u1, tl.where(lane == 2, u2, u3)))
            noise = tl.math.div_rn(1.0, -tl.log(tl.maximum(uniform, MIN_UNIFORM)))
        else:
            noise = tl.load(noise_row_ptr + offsets, mask=in_vocab, other=0.0)
        noise = tl.where(use_noise, noise, 1.0)
        scores = tl.where(in_vocab, weights * noise, -1.0)
        block_max, block_index = tl.max(scores, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = block_max > best_score
        best_index = tl.where(take, v0 + block_index, best_index)
        best_score = tl.maximum(block_max, best_score)
    return best_score, best_index


@triton.jit
def _rejection_sample_kernel(
    target_probs_ptr,
    draft_probs_ptr,
    draft_token_ids_ptr,
    num_draft_tokens_ptr,
    greedy_ptr,
    uniforms_ptr,
    noise_ptr,
    seeds_ptr,
    positions_ptr,
    output_token_ids_ptr,
    num_emitted_ptr,
    vocab_size,
    target_stride_b,
    target_stride_k,
    draft_stride_b,
    draft_stride_k,
    draft_ids_stride_b,
    uniforms_stride_b,
    noise_stride_b,
    output_stride_b,
    BLOCK_V: tl.constexpr,
    HAS_DRAFT_PROBS: tl.constexpr,
    PHILOX: tl.constexpr,
    NUM_STREAMS_: tl.constexpr,
    ACCEPT_STREAM: tl.constexpr,
    RESIDUAL_STREAM: tl.constexpr,
    MIN_UNIFORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    num_draft = tl.load(num_draft_tokens_ptr + row).to(tl.int64)
    greedy = tl.load(greedy_ptr + row) != 0
    sampled = tl.load(greedy_ptr + row) == 0
    seed = tl.load(seeds_ptr + row) if PHILOX else 0
    position = tl.load(positions_ptr + row) if PHILOX else 0
    target_row_ptr = target_probs_ptr + row * target_stride_b
    draft_row_ptr = draft_probs_ptr + row * draft_stride_b
    draft_ids_ptr = draft_token_ids_ptr + row * draft_ids_stride_b
    output_ptr = output_token_ids_ptr + row * output_stride_b

    # 1. Accept scan: a flag instead of `break`, which the compiler rejects.
    stop = num_draft
    scanning = tl.full((), 1, tl.int32)
    for slot in range(0, num_draft):
        if scanning == 1:
            token = tl.load(draft_ids_ptr + slot)
            if greedy:
                accepted = token == _row_argmax(target_row_ptr + slot * target_stride_k, vocab_size, BLOCK_V)
            else:
                target_prob = tl.load(target_row_ptr + slot * target_stride_k + token)
                draft_prob = tl.load(draft_row_ptr + slot * draft_stride_k + token) if HAS_DRAFT_PROBS else 1.0
                if PHILOX:
                    accept_offset = ((position + slot) * NUM_STREAMS_ + ACCEPT_STREAM) << 32
                    uniform = tl.rand(seed, accept_offset)
                else:
                    uniform = tl.load(uniforms_ptr + row * uniforms_stride_b + slot)
                accepted = uniform * draft_prob < target_prob
            if accepted:
                tl.store(output_ptr + slot, token)
            else:
                scanning = 0
                stop = slot

    # 2. Exactly one categorical draw at the stop slot: recovered (rejected) or bonus token.
    recover = (stop < num_draft) & sampled
    draft_slot = tl.minimum(stop, tl.maximum(num_draft - 1, 0))
    rejected_token = tl.load(draft_ids_ptr + draft_slot, mask=recover, other=-1)
    noise_offset_base = ((position + stop) * NUM_STREAMS_ + RESIDUAL_STREAM) << 32
    stop_target_ptr = target_row_ptr + stop * target_stride_k
    stop_draft_ptr = draft_row_ptr + draft_slot * draft_stride_k
    noise_row_ptr = noise_ptr + row * noise_stride_b
    best_score, best_index = _race(
        stop_target_ptr, stop_draft_ptr, noise_row_ptr, seed, noise_offset_base, vocab_size,
        recover, sampled, rejected_token,
        BLOCK_V, HAS_DRAFT_PROBS, PHILOX, MIN_UNIFORM,
    )  # fmt: skip
    if best_score <= 0.0:
        # The residual is numerically empty (p == q up to rounding): race on p instead.
        # `stop < 0` is a runtime False, so `recover` keeps the type of a runtime flag.
        best_score, best_index = _race(
            stop_target_ptr, stop_draft_ptr, noise_row_ptr, seed, noise_offset_base, vocab_size,
            stop < 0, sampled, -1,
            BLOCK_V, HAS_DRAFT_PROBS, PHILOX, MIN_UNIFORM,
        )  # fmt: skip
    tl.store(output_ptr + stop, best_index.to(tl.int64))
    tl.store(num_emitted_ptr + row, stop + 1)


def rejection_sample_triton(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
    seeds: torch.Tensor | None,
    positions: torch.Tensor | None,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the kernel; same contract as ``reference.rejection_sample_reference``.

    Args:
        target_probs: float32 ``[B, K+1, V]``, last dimension contiguous.
        draft_probs: float32 ``[B, K, V]`` or ``None`` (one-hot drafts).
        draft_token_ids: int64 ``[B, K]``.
        num_draft_tokens: int64 ``[B]``.
        greedy: bool ``[B]``.
        uniforms: float32 ``[B, K]`` (explicit-draw mode) or ``None``.
        noise: float32 ``[B, V]`` (explicit-draw mode) or ``None``.
        seeds: int64 ``[B]`` (counter mode) or ``None``.
        positions: int64 ``[B]`` (counter mode) or ``None``.
        block_v: vocabulary block size (a power of two); results do not depend on it.

    Returns:
        ``output_token_ids`` int64 ``[B, K+1]`` and ``num_emitted`` int64 ``[B]``.
    """
    batch_size, _, vocab_size = target_probs.shape
    philox = seeds is not None
    if block_v is None:
        block_v = min(_DEFAULT_BLOCK_V, triton.next_power_of_2(vocab_size))
    target_probs = target_probs.contiguous()
    draft_token_ids = draft_token_ids.contiguous()
    # Unused pointers still need a tensor on the right device; the kernel never reads them.
    placeholder = torch.zeros(1, device=target_probs.device, dtype=torch.float32)
    draft_probs = placeholder if draft_probs is None else draft_probs.contiguous()
    uniforms = placeholder if uniforms is None else uniforms.contiguous()
    noise = placeholder if noise is None else noise.contiguous()
    index_placeholder = torch.zeros(1, device=target_probs.device, dtype=torch.int64)
    seeds = index_placeholder if seeds is None else seeds.contiguous()
    positions = index_placeholder if positions is None else positions.contiguous()

    block_size = draft_token_ids.shape[1]
    output_token_ids = torch.full((batch_size, block_size + 1), -1, device=target_probs.device, dtype=torch.int64)
    num_emitted = torch.empty(batch_size, device=target_probs.device, dtype=torch.int64)
    _rejection_sample_kernel[(batch_size,)](
        target_probs,
        draft_probs,
        draft_token_ids,
        num_draft_tokens.to(torch.int64).contiguous(),
        greedy.to(torch.int8).contiguous(),
        uniforms,
        noise,
        seeds,
        positions,
        output_token_ids,
        num_emitted,
        vocab_size,
        target_probs.stride(0),
        target_probs.stride(1),
        draft_probs.stride(0) if draft_probs.dim() == 3 else 0,
        draft_probs.stride(1) if draft_probs.dim() == 3 else 0,
        draft_token_ids.stride(0),
        uniforms.stride(0),
        noise.stride(0),
        output_token_ids.stride(0),
        BLOCK_V=block_v,
        HAS_DRAFT_PROBS=draft_probs.dim() == 3,
        PHILOX=philox,
        NUM_STREAMS_=NUM_STREAMS,
        ACCEPT_STREAM=int(RandomStream.ACCEPT),
        RESIDUAL_STREAM=int(RandomStream.RESIDUAL),
        MIN_UNIFORM=MIN_RACE_UNIFORM,
        enable_fp_fusion=False,
    )
    return output_token_ids, num_emitted
