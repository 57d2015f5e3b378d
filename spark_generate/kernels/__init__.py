"""Lossless verification: the public entry point, its input checks and its backend choice.

:func:`rejection_sample` verifies a padded batch of drafted blocks against the target's
distributions and emits, per row, the accepted drafts plus one recovered or bonus token. Two
backends implement one contract: the PyTorch reference in :mod:`spark_generate.kernels.reference`
(the specification; runs everywhere) and a Triton kernel (CUDA, or CPU through Triton's
interpreter), imported lazily so that ``import spark_generate`` never imports Triton.
"""

from __future__ import annotations

import torch

from spark_generate.kernels._availability import resolve_backend
from spark_generate.kernels.reference import RandomStream, generator_race_noise, rejection_sample_reference

__all__ = ["PROBABILITY_SUM_TOLERANCE", "RandomStream", "check_distributions", "rejection_sample"]

# fp32 softmax over 150k+ logits, then top-k/top-p renormalisation, sums to 1 within ~1e-5.
PROBABILITY_SUM_TOLERANCE = 1e-3


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    *,
    greedy: bool | torch.Tensor = False,
    seed: int | torch.Tensor | None = None,
    positions: int | torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    backend: str = "auto",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifies drafted blocks by chain rejection sampling; the output has the target's law.

    Row ``b`` drafted ``K_b = num_draft_tokens[b]`` tokens. Slot ``j < K_b`` is accepted iff
    ``u_j * q_j(d_j) < p_j(d_j)``; at the first rejection one recovered token is drawn from
    ``max(p_j - q_j, 0)``, and if all ``K_b`` slots are accepted one bonus token is drawn from
    ``p_{K_b}``. Greedy rows accept while the draft equals ``argmax p_j`` and then emit that argmax.

    Randomness, in order of precedence: explicit draws (``uniforms`` and ``noise``, for bit-exact
    comparisons between backends); counter-based Philox keyed by ``seed``, absolute position and
    stream (results independent of batch composition and block size); otherwise ``generator`` (or
    torch's global generator when ``None``).

    Backends: ``"torch"`` runs the reference; ``"triton"`` the Triton kernel (CUDA tensors, or CPU
    with ``TRITON_INTERPRET=1``); ``"auto"`` picks Triton for CUDA tensors when Triton is installed
    and the reference otherwise (``SPARK_GENERATE_BACKEND`` overrides ``"auto"``). Both give equal
    tokens on equal explicit draws; in Philox mode they share the acceptance uniforms bit for bit,
    while the device ``log`` in the race can flip near-ties of the one categorical draw.

    Args:
        target_probs: float32 ``[B, K+1, V]`` processed target distributions (after temperature,
            top-k, top-p, penalties); row ``K_b`` is the bonus distribution. For greedy rows
            only the argmax matters.
        draft_probs: float32 ``[B, K, V]`` in the target vocabulary: exactly the distributions the
            drafts were sampled from. ``None`` for deterministic drafts (one-hot ``q``).
        draft_token_ids: int64 ``[B, K]`` drafted target-vocabulary ids; slots ``>= K_b`` ignored.
        num_draft_tokens: integer ``[B]``, ``K_b`` in ``0..K``.
        greedy: ``bool`` for all rows, or bool ``[B]`` for temperature-0 rows mixed with sampled ones.
        seed: Philox seed, an ``int`` for all rows or int64 ``[B]``. Rows sharing a seed and a
            position share their draws: give independent rows distinct seeds.
        positions: absolute position of draft slot 0 (``int`` or int64 ``[B]``), with ``seed``
            only; defaults to 0. The token emitted at slot ``j`` is keyed by ``positions + j``.
        uniforms: float32 ``[B, K]`` acceptance uniforms in ``[0, 1)``, with ``noise``.
        noise: float32 ``[B, V]`` positive race weights ``1 / E``, ``E ~ Exp(1)``, with ``uniforms``.
        generator: torch generator for the draws when neither ``seed`` nor explicit draws are given.
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        validate: check values (probabilities, ranges, draws). This reads the inputs once and
            synchronises with the device; callers that build their inputs themselves may skip it.
            Shapes, dtypes and devices are always checked.

    Returns:
        ``output_token_ids`` int64 ``[B, K+1]``: accepted drafts, then the recovered or bonus token,
        then ``-1`` padding; and ``num_emitted`` int64 ``[B]`` = accepted + 1.

    Raises:
        ValueError: inputs of the wrong shape, dtype or device, probabilities that are negative,
            NaN or do not sum to 1, draft lengths or token ids out of range, or conflicting
            randomness arguments.

    Example:
        >>> import torch
        >>> from spark_generate.kernels import rejection_sample
        >>> p = torch.tensor([[[0.5, 0.5], [0.5, 0.5], [0.25, 0.75]]])   # [B=1, K+1=3, V=2]
        >>> q = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])                # drafts drawn from p itself
        >>> out, n = rejection_sample(p, q, torch.tensor([[1, 0]]), torch.tensor([2]), seed=7)
        >>> n.item(), out[0, :2].tolist()   # p == q accepts every draft, then a bonus token
        (3, [1, 0])
    """
    batch_size = _check_shapes(target_probs, draft_probs, draft_token_ids, num_draft_tokens)
    device = target_probs.device
    block_size = draft_token_ids.shape[1]
    vocab_size = target_probs.shape[2]
    num_draft_tokens = num_draft_tokens.to(torch.int64)
    greedy_rows = _per_row(greedy, batch_size, device, torch.bool, "greedy")

    seeds = row_positions = None
    if (uniforms is None) != (noise is None):
        raise ValueError("explicit draws need both uniforms [B, K] and noise [B, V]; got only one of them.")
    if uniforms is not None:
        if seed is not None:
            raise ValueError("give either seed (Philox draws) or uniforms and noise (explicit draws), not both.")
        _check_tensor("uniforms", uniforms, (batch_size, block_size), torch.float32, device)
        _check_tensor("noise", noise, (batch_size, vocab_size), torch.float32, device)
    elif seed is not None:
        seeds = _per_row(seed, batch_size, device, torch.int64, "seed")
        row_positions = _per_row(0 if positions is None else positions, batch_size, device, torch.int64, "positions")
    else:
        if positions is not None:
            raise ValueError("positions keys the Philox draws and needs seed; got positions without seed.")
        uniforms = torch.rand((batch_size, block_size), device=device, generator=generator)
        noise = generator_race_noise((batch_size, vocab_size), device, generator)

    if validate:
        _check_values(target_probs, draft_probs, draft_token_ids, num_draft_tokens, uniforms, noise)

    if resolve_backend(backend, device) == "triton":
        from spark_generate.kernels._triton_rejection import rejection_sample_triton

        return rejection_sample_triton(
            target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy_rows,
            uniforms, noise, seeds, row_positions,
        )  # fmt: skip
    return rejection_sample_reference(
        target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy_rows,
        uniforms, noise, seeds, row_positions,
    )  # fmt: skip


def _check_tensor(name: str, tensor: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {list(shape)}; got {type(tensor).__name__}.")
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {list(tensor.shape)}; expected {list(shape)}.")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}; expected {dtype} (convert with .to({dtype})).")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}; expected {device}, the device of target_probs.")


def _check_shapes(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
) -> int:
    if not isinstance(target_probs, torch.Tensor) or target_probs.dim() != 3:
        got = list(target_probs.shape) if isinstance(target_probs, torch.Tensor) else type(target_probs).__name__
        raise ValueError(f"target_probs must be a [B, K+1, V] tensor; got {got}.")
    batch_size, block_size_plus_one, vocab_size = target_probs.shape
    if block_size_plus_one < 1 or vocab_size < 1:
        raise ValueError(f"target_probs has shape {list(target_probs.shape)}; K+1 and V must be at least 1.")
    if target_probs.dtype != torch.float32:
        raise ValueError(
            f"target_probs has dtype {target_probs.dtype}; expected torch.float32 "
            "(compute the softmax in float32: lower precision biases the acceptance test)."
        )
    block_size = block_size_plus_one - 1
    device = target_probs.device
    _check_tensor("draft_token_ids", draft_token_ids, (batch_size, block_size), torch.int64, device)
    if draft_probs is not None:
        _check_tensor("draft_probs", draft_probs, (batch_size, block_size, vocab_size), torch.float32, device)
    if not isinstance(num_draft_tokens, torch.Tensor) or num_draft_tokens.dtype.is_floating_point:
        raise ValueError("num_draft_tokens must be an integer tensor of shape [B].")
    _check_tensor("num_draft_tokens", num_draft_tokens, (batch_size,), num_draft_tokens.dtype, device)
    return batch_size


def _per_row(
    value: bool | int | torch.Tensor, batch_size: int, device: torch.device, dtype: torch.dtype, name: str
) -> torch.Tensor:
    """Broadcasts a Python scalar to ``[B]``, or checks a ``[B]`` tensor."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or (dtype != torch.bool) == (value.dtype == torch.bool):
            raise ValueError(f"{name} has dtype {value.dtype}; expected {dtype}.")
        _check_tensor(name, value, (batch_size,), value.dtype, device)
        return value.to(dtype)
    if isinstance(value, float) or (dtype == torch.bool) != isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a {'bool' if dtype == torch.bool else 'int'} or a [B] tensor.")
    return torch.full((batch_size,), value, device=device, dtype=dtype)


def _check_values(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    uniforms: torch.Tensor | None,
    noise: torch.Tensor | None,
) -> None:
    _, block_size_plus_one, vocab_size = target_probs.shape
    block_size = block_size_plus_one - 1
    bad_lengths = (num_draft_tokens < 0) | (num_draft_tokens > block_size)
    if bad_lengths.any():
        row = int(bad_lengths.nonzero()[0, 0])
        raise ValueError(
            f"num_draft_tokens[{row}] = {int(num_draft_tokens[row])} is out of range; expected 0..K = 0..{block_size}."
        )
    slots = torch.arange(block_size_plus_one, device=target_probs.device)
    used_target_rows = slots[None, :] <= num_draft_tokens[:, None]
    check_distributions("target_probs", target_probs, used_target_rows)
    used_draft_slots = used_target_rows[:, :block_size] & (slots[None, :block_size] < num_draft_tokens[:, None])
    if draft_probs is not None:
        check_distributions("draft_probs", draft_probs, used_draft_slots)
    bad_ids = used_draft_slots & ((draft_token_ids < 0) | (draft_token_ids >= vocab_size))
    if bad_ids.any():
        row, slot = (int(i) for i in bad_ids.nonzero()[0])
        raise ValueError(
            f"draft_token_ids[{row}, {slot}] = {int(draft_token_ids[row, slot])} is not a token id; "
            f"expected 0..V-1 = 0..{vocab_size - 1} (map draft-vocabulary ids to the target vocabulary first)."
        )
    if uniforms is not None and not ((uniforms >= 0) & (uniforms < 1)).all():
        raise ValueError("uniforms must lie in [0, 1); got values outside it (or NaN).")
    if noise is not None and not ((noise > 0) & torch.isfinite(noise)).all():
        raise ValueError("noise holds race weights 1 / E with E ~ Exp(1): every value must be finite and > 0.")


def check_distributions(name: str, probs: torch.Tensor, used: torch.Tensor | None = None) -> None:
    """Checks that distributions are finite, non-negative and sum to 1, or raises ``ValueError``.

    Args:
        name: the argument's name, for the message.
        probs: float ``[B, rows, V]`` (or ``[B, V]``, one row each).
        used: bool ``[B, rows]`` selecting the rows to check (padding rows may hold anything);
            ``None`` checks every row.
    """
    if probs.dim() == 2:
        probs = probs[:, None, :]
    if used is None:
        used = torch.ones(probs.shape[:2], dtype=torch.bool, device=probs.device)
    finite_non_negative = (torch.isfinite(probs) & (probs >= 0)).all(dim=-1)
    bad = used & ~finite_non_negative
    if bad.any():
        row, slot = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}[{row}, {slot}] holds NaN, infinite or negative values; expected probabilities "
            "(check the logits for NaN before the softmax)."
        )
    sums = probs.sum(dim=-1, dtype=torch.float64)
    bad = used & ((sums - 1).abs() > PROBABILITY_SUM_TOLERANCE)
    if bad.any():
        row, slot = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}[{row}, {slot}] sums to {float(sums[row, slot]):.6g}; expected 1 within "
            f"{PROBABILITY_SUM_TOLERANCE} (pass probabilities, not logits: apply softmax)."
        )
