"""What a speculative generation reports: per-row statistics and the ``generate()``-style output.

:class:`SpeculativeStats` counts, per row, the steps taken, the drafts verified and accepted, and,
per draft slot, how often it was verified and accepted, which gives the mean accepted length tau
(bonus token included) and the conditional acceptance of each slot; it also splits wall time into
drafting and verification. :class:`DSparkGenerateOutput` is Transformers'
``GenerateDecoderOnlyOutput`` with these statistics attached, so code written for plain
``generate()`` outputs keeps working.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation import GenerateDecoderOnlyOutput

__all__ = ["DSparkGenerateOutput", "SpeculativeStats", "record_step", "stack_per_step"]


@dataclass
class SpeculativeStats:
    """Per-row statistics of one speculative generation (``return_dict_in_generate=True``).

    Attributes:
        num_rounds: ``[B]`` target forwards each row took part in (drafted rounds and plain steps).
        num_drafted: ``[B]`` drafts verified.
        num_accepted: ``[B]`` drafts accepted.
        num_plain_steps: ``[B]`` of ``num_rounds``, the plain decoding steps (the schedule stepped
            aside and nothing was drafted).
        verified_by_position: ``[B, S]`` how often draft slot ``j`` was verified.
        accepted_by_position: ``[B, S]`` how often it was accepted.
        draft_seconds: Wall time spent drafting and scheduling.
        verify_seconds: Wall time in the target's verification forwards and rejection sampling.
    """

    num_rounds: torch.Tensor
    num_drafted: torch.Tensor
    num_accepted: torch.Tensor
    num_plain_steps: torch.Tensor
    verified_by_position: torch.Tensor
    accepted_by_position: torch.Tensor
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    @classmethod
    def zeros(cls, batch_size: int, num_draft_tokens: int) -> SpeculativeStats:
        """Empty statistics for ``batch_size`` rows and blocks of ``num_draft_tokens`` drafts."""
        counts = [torch.zeros(batch_size, dtype=torch.int64) for _ in range(4)]
        positions = [torch.zeros(batch_size, num_draft_tokens, dtype=torch.int64) for _ in range(2)]
        return cls(*counts, *positions)

    @property
    def tau(self) -> torch.Tensor:
        """``[B]`` mean tokens emitted per target forward (accepted drafts plus the bonus or recovered token)."""
        return (self.num_accepted + self.num_rounds) / self.num_rounds.clamp(min=1)

    @property
    def acceptance_by_position(self) -> torch.Tensor:
        """``[S]`` conditional acceptance rate of slot ``j`` given that it was verified, over all rows."""
        return self.accepted_by_position.sum(0) / self.verified_by_position.sum(0).clamp(min=1)

    def summary(self) -> str:
        """A few human-readable lines: tau, acceptance per slot, and where the time went."""
        verified = self.verified_by_position.sum(0).tolist()
        rates = " ".join(
            f"{rate:.2f}" if count else "n/a"
            for rate, count in zip(self.acceptance_by_position.tolist(), verified, strict=True)
        )
        total_rounds = int(self.num_rounds.sum())
        tau = (self.num_accepted.sum() + total_rounds) / max(total_rounds, 1)
        return (
            f"DSpark: {total_rounds} row-steps ({int(self.num_plain_steps.sum())} plain), tau {float(tau):.2f} "
            f"tokens/step ({int(self.num_accepted.sum())}/{int(self.num_drafted.sum())} drafts accepted)\n"
            f"  acceptance by draft position: {rates}\n"
            f"  time: draft {self.draft_seconds:.3f}s, verify {self.verify_seconds:.3f}s"
        )


@dataclass
class DSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus the speculative statistics in ``dspark_stats``.

    ``scores`` and ``logits`` (with ``output_scores`` / ``output_logits``) hold one ``[B, V]``
    float32 tensor per generated token, as plain ``generate()`` gives them; rows that had already
    stopped get ``-inf`` there (plain decoding keeps computing them). ``cache`` is None: finished
    rows leave the cache during decoding, so it no longer matches ``sequences``.
    """

    dspark_stats: SpeculativeStats | None = None


def record_step(
    stats: SpeculativeStats, rows: torch.Tensor, num_verified: torch.Tensor, num_accepted: torch.Tensor,
    drafted: bool, start: float, verify_start: float,
) -> None:  # fmt: skip
    """Adds one step of the running ``rows`` to ``stats`` (``drafted``: not a plain step; timings from ``start``)."""
    rows, num_verified, num_accepted = rows.cpu(), num_verified.cpu(), num_accepted.cpu()
    stats.num_rounds[rows] += 1
    if not drafted:
        stats.num_plain_steps[rows] += 1
    stats.num_drafted[rows] += num_verified
    stats.num_accepted[rows] += num_accepted
    slots = torch.arange(stats.verified_by_position.shape[1])
    stats.verified_by_position[rows] += (slots[None] < num_verified[:, None]).long()
    stats.accepted_by_position[rows] += (slots[None] < num_accepted[:, None]).long()
    now = time.perf_counter()
    stats.draft_seconds += verify_start - start
    stats.verify_seconds += now - verify_start


def stack_per_step(per_row: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """Stacks per-row lists of ``[V]`` tensors into one ``[B, V]`` tensor per step (-inf where a row had stopped)."""
    num_steps = max(len(tokens) for tokens in per_row)
    reference = next(tokens[0] for tokens in per_row if tokens)
    steps = []
    for step in range(num_steps):
        rows = [
            tokens[step] if step < len(tokens) else torch.full_like(reference, float("-inf")) for tokens in per_row
        ]
        steps.append(torch.stack(rows))
    return tuple(steps)
