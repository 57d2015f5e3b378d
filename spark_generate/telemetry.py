"""What a speculative generation reports: per-row statistics and the ``generate()``-style output.

:class:`SpeculativeStats` counts, per row, the target forwards it took part in (speculative rounds,
which verify a drafted block, and plain decoding steps, which draft nothing), the drafts verified
and accepted, and, per draft slot, how often it was verified and accepted, which gives the mean
accepted length tau (bonus token included) and the conditional acceptance of each slot; it also
times the decoding after the prefill (tokens per second) and splits that time into drafting,
verification, plain steps and the rest. Per drafter (:class:`DraftSource`: the head, the suffix
index, or none in a plain step) it counts the row-rounds, drafts verified and accepted, and the
share of the decoding time those rows took. :class:`DSparkGenerateOutput` is Transformers'
``GenerateDecoderOnlyOutput`` with these statistics attached, so code written for plain
``generate()`` outputs keeps working.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import torch
from transformers.generation import GenerateDecoderOnlyOutput

__all__ = ["DSparkGenerateOutput", "DraftSource", "SpeculativeStats", "record_step", "stack_per_step"]


class DraftSource(IntEnum):
    """Where a row's drafts come from in one round."""

    PLAIN = 0  # no draft: a plain decoding step
    HEAD = 1  # the DSpark draft head
    SUFFIX = 2  # the suffix index over the prompt, the generated text and any global corpus


@dataclass
class SpeculativeStats:
    """Per-row statistics of one speculative generation (``return_dict_in_generate=True``).

    Attributes:
        num_rounds: ``[B]`` target forwards each row took part in: speculative rounds (a drafted
            block verified) and plain decoding steps.
        num_drafted: ``[B]`` drafts verified.
        num_accepted: ``[B]`` drafts accepted.
        num_plain_steps: ``[B]`` of ``num_rounds``, the plain decoding steps: the schedule judged
            that drafting would not pay, and the target decoded one token without a draft.
        verified_by_position: ``[B, S]`` how often draft slot ``j`` was verified.
        accepted_by_position: ``[B, S]`` how often it was accepted.
        draft_seconds: Wall time of the speculative rounds spent drafting and scheduling.
        verify_seconds: Wall time of the speculative rounds in the target's verification forwards
            and rejection sampling.
        plain_seconds: Wall time of the plain decoding steps.
        decode_seconds: Wall time from the first step to the end of the last verification (the
            decoding after the prefill): the three above plus committing tokens, stopping
            criteria and cache rollback.
        rounds_by_source: ``[3]`` row-rounds per :class:`DraftSource` (all rows together).
        drafted_by_source: ``[3]`` drafts verified per source.
        accepted_by_source: ``[3]`` drafts accepted per source.
        seconds_by_source: ``[3]`` float64 seconds per source: each step's time shared equally
            among the rows it advanced.
    """

    num_rounds: torch.Tensor
    num_drafted: torch.Tensor
    num_accepted: torch.Tensor
    num_plain_steps: torch.Tensor
    verified_by_position: torch.Tensor
    accepted_by_position: torch.Tensor
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    plain_seconds: float = 0.0
    decode_seconds: float = 0.0
    rounds_by_source: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DraftSource), dtype=torch.int64))
    drafted_by_source: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DraftSource), dtype=torch.int64))
    accepted_by_source: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DraftSource), dtype=torch.int64))
    seconds_by_source: torch.Tensor = field(default_factory=lambda: torch.zeros(len(DraftSource), dtype=torch.float64))
    _first_step_start: float | None = field(default=None, repr=False)

    @classmethod
    def zeros(cls, batch_size: int, num_draft_tokens: int) -> SpeculativeStats:
        """Empty statistics for ``batch_size`` rows and blocks of ``num_draft_tokens`` drafts."""
        counts = [torch.zeros(batch_size, dtype=torch.int64) for _ in range(4)]
        positions = [torch.zeros(batch_size, num_draft_tokens, dtype=torch.int64) for _ in range(2)]
        return cls(*counts, *positions)

    @property
    def tau(self) -> torch.Tensor:
        """``[B]`` mean tokens emitted per target forward (accepted drafts plus the bonus or recovered token)."""
        return self.num_emitted / self.num_rounds.clamp(min=1)

    @property
    def num_emitted(self) -> torch.Tensor:
        """``[B]`` tokens the target forwards emitted: accepted drafts plus one bonus or recovered token each.

        A row's last block may run past the token it stopped at, so this can exceed its new tokens
        by a few; the first new token (chosen at the prefill) is not counted.
        """
        return self.num_accepted + self.num_rounds

    @property
    def tokens_per_second(self) -> float:
        """Emitted tokens of all rows per second of :attr:`decode_seconds` (0 before any step)."""
        return float(self.num_emitted.sum()) / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_by_position(self) -> torch.Tensor:
        """``[S]`` conditional acceptance rate of slot ``j`` given that it was verified, over all rows."""
        return self.accepted_by_position.sum(0) / self.verified_by_position.sum(0).clamp(min=1)

    def summary(self) -> str:
        """A few lines that explain themselves: forwards, tau, acceptance per slot, throughput and where the time went.

        Example (one row)::

            DSpark: 57 target forwards per row: 17 speculative rounds (a drafted block verified)
              + 40 plain decoding steps (no draft: the schedule judged drafting would not pay)
              tau 1.11 tokens per target forward; 6 of 85 drafts accepted
              acceptance by draft position: 0.12 0.00 n/a ...
              63 tokens in 16.712 s after the prefill: 3.8 tokens/s
              time: draft 0.712 s, verify 3.161 s (speculative rounds), plain steps 12.732 s, other 0.107 s
        """
        verified = self.verified_by_position.sum(0).tolist()
        rates = " ".join(
            f"{rate:.2f}" if count else "n/a"
            for rate, count in zip(self.acceptance_by_position.tolist(), verified, strict=True)
        )
        num_rows = len(self.num_rounds)
        per_row = "per row" if num_rows == 1 else f"per row (mean of {num_rows} rows)"
        total_rounds, num_plain = int(self.num_rounds.sum()), int(self.num_plain_steps.sum())
        tau = int(self.num_emitted.sum()) / max(total_rounds, 1)
        other = self.decode_seconds - self.draft_seconds - self.verify_seconds - self.plain_seconds
        return (
            f"DSpark: {_per_row(total_rounds, num_rows, 'target forward')} {per_row}: "
            f"{_per_row(total_rounds - num_plain, num_rows, 'speculative round')} (a drafted block verified)\n"
            f"  + {_per_row(num_plain, num_rows, 'plain decoding step')} (no draft: the schedule judged drafting "
            "would not pay)\n"
            f"  tau {tau:.2f} tokens per target forward; {int(self.num_accepted.sum())} of "
            f"{int(self.num_drafted.sum())} drafts accepted\n"
            f"  acceptance by draft position: {rates}\n"
            f"  {int(self.num_emitted.sum())} tokens in {self.decode_seconds:.3f} s after the prefill: "
            f"{self.tokens_per_second:.1f} tokens/s\n"
            f"  time: draft {self.draft_seconds:.3f} s, verify {self.verify_seconds:.3f} s (speculative rounds), "
            f"plain steps {self.plain_seconds:.3f} s, other {max(other, 0.0):.3f} s"
            + "".join(f"\n  {line}" for line in self.per_source_lines())
        )

    def per_source_lines(self) -> list[str]:
        """One line per drafter that drafted: its row-rounds, acceptance, tokens per row-round and per second."""
        lines = []
        for source in (DraftSource.HEAD, DraftSource.SUFFIX, DraftSource.PLAIN):
            rounds = int(self.rounds_by_source[source])
            if not rounds:
                continue
            emitted = int(self.accepted_by_source[source]) + rounds
            seconds = float(self.seconds_by_source[source])
            speed = f"{emitted / seconds:.1f} tokens/s" if seconds > 0 else "n/a tokens/s"
            drafted = int(self.drafted_by_source[source])
            accepted = f", {int(self.accepted_by_source[source])} of {drafted} drafts accepted" if drafted else ""
            lines.append(
                f"{source.name.lower()}: {rounds} row-rounds{accepted}, {emitted / rounds:.2f} tokens per row-round, "
                f"{speed}"
            )
        return lines


def _per_row(total: int, num_rows: int, noun: str) -> str:
    """``total / num_rows`` nouns: an integer when exact, else with one decimal (``"1 round"``, ``"1.5 rounds"``)."""
    count = str(total // num_rows) if total % num_rows == 0 else f"{total / num_rows:.1f}"
    return f"{count} {noun}" + ("" if count == "1" else "s")


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
    sources: torch.Tensor, live: torch.Tensor, start: float, verify_start: float,
) -> None:  # fmt: skip
    """Adds one step of the ``live`` running ``rows`` to ``stats`` (on any device; read on the host).

    Args:
        stats: The statistics to update.
        rows: ``[R]`` batch indices of the running rows.
        num_verified: ``[R]`` drafts verified.
        num_accepted: ``[R]`` drafts accepted.
        sources: ``[R]`` int64 :class:`DraftSource` of each row (``PLAIN``: a plain decoding step).
        live: ``[R]`` bool, the rows the step counts for (a finished row riding along does not).
        start: ``time.perf_counter()`` when the step began.
        verify_start: ``time.perf_counter()`` when its target forward began.
    """
    live = live.cpu()
    rows, num_verified, num_accepted = rows.cpu()[live], num_verified.cpu()[live], num_accepted.cpu()[live]
    sources = sources.cpu()[live]
    plain = sources == DraftSource.PLAIN
    now = time.perf_counter()
    if stats._first_step_start is None:
        stats._first_step_start = start
    stats.decode_seconds = now - stats._first_step_start
    stats.num_rounds[rows] += 1
    if bool(plain.all()):  # a plain step of every row: nothing drafted
        stats.num_plain_steps[rows] += 1
        stats.plain_seconds += now - start
        stats.rounds_by_source[DraftSource.PLAIN] += len(rows)
        stats.seconds_by_source[DraftSource.PLAIN] += (now - start) if len(rows) else 0.0
        return
    stats.num_plain_steps[rows] += plain.long()
    stats.num_drafted[rows] += num_verified
    stats.num_accepted[rows] += num_accepted
    slots = torch.arange(stats.verified_by_position.shape[1])
    stats.verified_by_position[rows] += (slots[None] < num_verified[:, None]).long()
    stats.accepted_by_position[rows] += (slots[None] < num_accepted[:, None]).long()
    stats.draft_seconds += verify_start - start
    stats.verify_seconds += now - verify_start
    if len(rows):
        stats.rounds_by_source += torch.bincount(sources, minlength=len(DraftSource))
        stats.drafted_by_source += torch.bincount(sources, weights=num_verified, minlength=len(DraftSource)).long()
        stats.accepted_by_source += torch.bincount(sources, weights=num_accepted, minlength=len(DraftSource)).long()
        share = (now - start) / len(rows)
        stats.seconds_by_source += share * torch.bincount(sources, minlength=len(DraftSource)).double()


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
