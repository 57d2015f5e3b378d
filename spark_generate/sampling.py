"""Plain (non-speculative) sampling with the verification engine's random streams.

:func:`sample` draws one token per row from a batch of distributions with the same exponential
race and the same counter-based Philox draws as :func:`spark_generate.kernels.rejection_sample`.
By default it draws on the ``RESIDUAL`` stream, the one verification uses for its recovered and
bonus tokens, so a verification step with no drafts emits exactly what plain sampling emits for
the same seed and position. Drafting samples on the ``DRAFT`` stream, which keeps the draft's
noise independent of the verifier's.
"""

from __future__ import annotations

import torch

from spark_generate.kernels import check_distributions
from spark_generate.kernels.reference import (
    RandomStream,
    exponential_race,
    generator_race_noise,
    philox_race_noise,
)

__all__ = ["race_noise", "sample"]


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
        stream: counter domain; ``RESIDUAL`` matches verification, ``DRAFT`` is for drafting.
        noise: float32 ``[B, V]`` explicit race weights ``1 / E`` instead of ``seed``.
        generator: torch generator used when neither ``seed`` nor ``noise`` is given.
        validate: check that ``probs`` holds distributions (synchronises with the device).

    Returns:
        int64 ``[B]`` token ids.

    Raises:
        ValueError: ``probs`` is not a float32 ``[B, V]`` batch of distributions, or the
            randomness arguments conflict.
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.dtype != torch.float32:
        got = f"{probs.dtype} {list(probs.shape)}" if isinstance(probs, torch.Tensor) else type(probs).__name__
        raise ValueError(f"probs must be a float32 [B, V] tensor; got {got}.")
    if validate:
        check_distributions("probs", probs)
    batch_size, vocab_size = probs.shape
    if noise is not None and seed is not None:
        raise ValueError("give either seed (Philox draws) or noise (explicit draws), not both.")
    if positions is not None and seed is None:
        raise ValueError("positions keys the Philox draws and needs seed; got positions without seed.")
    if noise is None and seed is not None:
        seeds = torch.as_tensor(seed, dtype=torch.int64, device=probs.device).expand(batch_size)
        row_positions = torch.as_tensor(0 if positions is None else positions, dtype=torch.int64, device=probs.device)
        noise = race_noise(seeds, row_positions.expand(batch_size)[:, None], vocab_size, stream)[:, 0]
    elif noise is None:
        noise = generator_race_noise((batch_size, vocab_size), probs.device, generator)
    elif noise.shape != probs.shape:
        raise ValueError(f"noise has shape {list(noise.shape)}; expected {list(probs.shape)} like probs.")
    greedy_rows = torch.as_tensor(greedy, device=probs.device).expand(batch_size)
    noise = torch.where(greedy_rows[:, None], torch.ones_like(noise), noise)
    return exponential_race(probs, noise, fallback=probs)


def race_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, stream: RandomStream) -> torch.Tensor:
    """The Philox race weights :func:`sample` draws with, for several positions of each row at once.

    ``sample(probs, noise=race_noise(seeds, positions, V, stream)[:, k])`` draws exactly what
    ``sample(probs, seed=seeds, positions=positions[:, k], stream=stream)`` draws. One call for a
    whole block pays the fixed cost of the Philox rounds once instead of once per position, which
    on a CPU at batch 1 is most of the cost of a sampled draft slot.

    Args:
        seeds: int64 ``[B]`` per-row seeds.
        positions: int64 ``[B, K]`` absolute positions of the tokens to draw.
        vocab_size: ``V``.
        stream: The counter domain (``DRAFT`` for drafting).

    Returns:
        float32 ``[B, K, V]`` race weights.
    """
    batch_size, num_positions = positions.shape
    row_seeds = seeds.to(torch.int64)[:, None].expand(batch_size, num_positions).reshape(-1)
    noise = philox_race_noise(row_seeds, positions.to(torch.int64).reshape(-1), stream, vocab_size)
    return noise.view(batch_size, num_positions, vocab_size)
