"""Plain (non-speculative) sampling with the verification engine's random streams.

:func:`sample` draws one token per row from a batch of distributions with the same exponential
race and the same counter-based Philox draws as :func:`spark_generate.kernels.rejection_sample`.
By default it draws on the ``RESIDUAL`` stream, the one verification uses for its recovered and
bonus tokens, so a verification step with no drafts emits exactly what :func:`sample` emits for
the same seed and position.

:func:`inverse_cdf_sample` draws from the same law with one Philox uniform per row instead of a
race weight per token (:func:`~spark_generate.kernels.reference.inverse_cdf`); the decoding loop
takes its plain steps (on the ``PLAIN`` stream) and its drafts (on the ``DRAFT`` stream, which
keeps the draft's randomness independent of the verifier's) with it. On one thread of the
project's CPU it draws 16 rows over a 49k vocabulary in under 1 ms, where the race takes 27 ms and
``torch.multinomial`` (plain ``generate()``'s draw) 17 ms.
"""

from __future__ import annotations

import torch

from spark_generate.kernels import check_distributions
from spark_generate.kernels.reference import (
    RandomStream,
    exponential_race,
    generator_race_noise,
    inverse_cdf,
    philox_race_noise,
    philox_uniform64,
)

__all__ = ["inverse_cdf_sample", "sample"]


def sample(
    probs: torch.Tensor,
    *,
    greedy: bool | torch.Tensor = False,
    seed: int | torch.Tensor | None = None,
    positions: int | torch.Tensor | None = None,
    stream: RandomStream = RandomStream.RESIDUAL,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Draws one token per row from ``probs``; greedy rows take the first argmax.

    Args:
        probs: float32 ``[B, V]`` distributions (after temperature, top-k, top-p).
        greedy: ``bool`` for all rows or bool ``[B]``.
        seed: Philox seed (``int`` or int64 ``[B]``); draws are keyed by seed, position, stream
            and token id, so they do not depend on the rest of the batch.
        positions: absolute position of the drawn token (``int`` or int64 ``[B]``), with ``seed``.
        stream: counter domain; ``RESIDUAL`` matches verification's recovered and bonus tokens.
        noise: float32 ``[B, V]`` explicit race weights ``1 / E`` instead of ``seed``.
        generator: torch generator used when neither ``seed`` nor ``noise`` is given.
        validate: check that ``probs`` holds distributions (synchronises with the device).

    Returns:
        int64 ``[B]`` token ids.

    Raises:
        ValueError: ``probs`` is not a float32 ``[B, V]`` batch of distributions, or the
            randomness arguments conflict.
    """
    _check_probs(probs, validate)
    batch_size, vocab_size = probs.shape
    if noise is not None and seed is not None:
        raise ValueError("give either seed (Philox draws) or noise (explicit draws), not both.")
    if positions is not None and seed is None:
        raise ValueError("positions keys the Philox draws and needs seed; got positions without seed.")
    if noise is None and seed is not None:
        seeds = torch.as_tensor(seed, dtype=torch.int64, device=probs.device).expand(batch_size)
        row_positions = torch.as_tensor(0 if positions is None else positions, dtype=torch.int64, device=probs.device)
        noise = philox_race_noise(seeds, row_positions.expand(batch_size), stream, vocab_size)
    elif noise is None:
        noise = generator_race_noise((batch_size, vocab_size), probs.device, generator)
    elif noise.shape != probs.shape:
        raise ValueError(f"noise has shape {list(noise.shape)}; expected {list(probs.shape)} like probs.")
    greedy_rows = torch.as_tensor(greedy, device=probs.device).expand(batch_size)
    noise = torch.where(greedy_rows[:, None], torch.ones_like(noise), noise)
    return exponential_race(probs, noise, fallback=probs)


def inverse_cdf_sample(
    probs: torch.Tensor,
    *,
    seed: int | torch.Tensor,
    positions: int | torch.Tensor,
    stream: RandomStream = RandomStream.PLAIN,
    validate: bool = True,
) -> torch.Tensor:
    """Draws one token per row from ``probs`` by the inverse CDF at one Philox uniform per row.

    The uniform is :func:`~spark_generate.kernels.reference.philox_uniform64` of the row's seed,
    the token's absolute position and ``stream``, so a row's draw depends neither on the rest of the
    batch nor on how often it was called. The law is :func:`sample`'s; the draws are not.

    Args:
        probs: float32 ``[B, V]`` distributions (after temperature, top-k, top-p).
        seed: Philox seed, ``int`` or int64 ``[B]``.
        positions: Absolute position of the drawn token, ``int`` or int64 ``[B]``.
        stream: Counter domain; ``PLAIN`` for a plain decoding step, ``DRAFT`` for drafting.
        validate: Check that ``probs`` holds distributions (synchronises with the device).

    Returns:
        int64 ``[B]`` token ids.

    Raises:
        ValueError: ``probs`` is not a float32 ``[B, V]`` batch of distributions.
    """
    _check_probs(probs, validate)
    batch_size = probs.shape[0]
    seeds = torch.as_tensor(seed, dtype=torch.int64, device=probs.device).expand(batch_size)
    row_positions = torch.as_tensor(positions, dtype=torch.int64, device=probs.device).expand(batch_size)
    return inverse_cdf(probs, philox_uniform64(seeds, row_positions, stream))


def _check_probs(probs: torch.Tensor, validate: bool) -> None:
    """Raises ``ValueError`` unless ``probs`` is a float32 ``[B, V]`` tensor (of distributions, with ``validate``)."""
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.dtype != torch.float32:
        got = f"{probs.dtype} {list(probs.shape)}" if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"probs must be a float32 [B, V] tensor; got {got}.")
    if validate:
        check_distributions("probs", probs)
