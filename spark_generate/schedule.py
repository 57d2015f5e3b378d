"""How many drafts of each row to verify, and whether to draft at all this round.

The confidence head gives, per draft slot ``j``, a logit whose sigmoid ``c_j`` (optionally divided
by a per-slot temperature from a calibration file, "STS") estimates the probability that ``d_j``
is accepted given that ``d_<j`` were. ``c_j`` reads the hidden state of slot ``j`` and the token
drafted at ``j - 1``, never ``d_j`` itself. Truncating the block is lossless if and only if the
decision to verify slot ``j`` never depends on ``d_j`` or later tokens: a rule that looks at
``d_j`` before deciding to verify it would verify likely-accepted drafts more often and skew the
output distribution (the paper's Appendix A). Each schedule below holds that by construction:

* :class:`FixedLength` verifies ``num_draft_tokens`` slots whatever was drafted;
* :class:`ConfidenceThreshold` verifies up to, excluding, the first slot with ``c_j < threshold``:
  slot ``j`` is admitted from ``c_1..c_j`` only;
* :class:`GoodputSchedule` is the paper's Algorithm 1: prefix survivals ``a_{r,j} = c_{r,1}···c_{r,j}``
  are admitted in descending order (ties: earlier slot first) while the goodput ``τ · SPS(tokens)``
  improves, and the **first** non-improving candidate stops the search. Every candidate looked at
  before ``(r, j)`` has a survival ``>= a_{r,j}``, so it is another row's or an earlier slot's, and
  nothing that depends on ``d_{r,j}`` (e.g. ``a_{r,j+1}``) can influence whether ``(r, j)`` is
  admitted. A retrospective global argmax over all prefixes would look at ``a_{r,j+1}`` and is
  biased (``tests/test_schedule.py`` reproduces the paper's counterexample).
* :class:`AdaptiveSchedule`, the default, is Algorithm 1 on this machine's costs plus a switch:
  it keeps a running measure of what drafted rounds paid (tokens per second of modelled cost,
  against plain decoding), and when drafting does not pay it decodes plain steps without running
  the draft head, probing again after a growing number of steps. The switch reads only how many
  tokens *past* rounds emitted, never a draft of the round it decides on, so every round is
  lossless given the past, and so is the whole generation. Without a confidence head, survivals
  come from the running per-slot acceptance instead.

``SPS`` comes from a :class:`CostTable`: measured on the user's own hardware by
:func:`spark_generate.profiling.profile_costs` (and cached per target, dtype, device and batch size
by :func:`spark_generate.profiling.cost_table_for`), or the built-in :meth:`CostTable.estimate`.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

__all__ = [
    "AdaptiveSchedule",
    "ConfidenceThreshold",
    "CostTable",
    "FixedLength",
    "GoodputSchedule",
    "Schedule",
    "ScheduleRun",
    "confidences",
    "load_calibration",
    "start_schedule",
]


class Schedule(Protocol):
    """Chooses how many of the ``S`` drafts of each of ``B`` rows to verify.

    Called with ``[B, S]`` confidence logits (None without a confidence head), ``B`` and ``S``;
    returns ``[B]`` int64 counts in ``0..S``. It never sees the drafted tokens.
    """

    def __call__(self, confidence_logits: torch.Tensor | None, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
        """Returns ``[B]`` int64 numbers of drafts to verify."""
        ...


def confidences(confidence_logits: torch.Tensor, temperatures: torch.Tensor | None = None) -> torch.Tensor:
    """``c = sigmoid(z / T)``: ``[B, S]`` logits and optional ``[S]`` STS temperatures -> ``[B, S]``."""
    if temperatures is not None:
        confidence_logits = confidence_logits / temperatures.to(confidence_logits)
    return torch.sigmoid(confidence_logits.float())


def load_calibration(path: str | Path) -> torch.Tensor:
    """Reads per-slot STS temperatures from a JSON file ``{"temperatures": [T_1, ..., T_S]}``."""
    temperatures = json.loads(Path(path).read_text()).get("temperatures")
    if not temperatures or any(t <= 0 for t in temperatures):
        raise ValueError(f"{path} holds temperatures={temperatures!r}; expected a non-empty list of positive numbers.")
    return torch.tensor(temperatures, dtype=torch.float32)


def _require(confidence_logits: torch.Tensor | None, name: str) -> torch.Tensor:
    if confidence_logits is None:
        raise ValueError(
            f"{name} needs confidences, but the draft head has no confidence head "
            "(enable_confidence_head=False); use FixedLength() instead."
        )
    return confidence_logits


@dataclass(frozen=True)
class FixedLength:
    """Verifies the same number of drafts in every row.

    Attributes:
        num_draft_tokens: Drafts to verify; None verifies the whole block.
    """

    num_draft_tokens: int | None = None

    def __call__(self, confidence_logits: torch.Tensor | None, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
        """``[B]`` copies of the fixed length (see :class:`Schedule`)."""
        length = num_draft_tokens if self.num_draft_tokens is None else min(self.num_draft_tokens, num_draft_tokens)
        return torch.full((batch_size,), length, dtype=torch.int64)


@dataclass(frozen=True)
class ConfidenceThreshold:
    """Verifies each row's drafts up to, excluding, its first slot with confidence below a threshold.

    Attributes:
        threshold: In ``[0, 1]``; 0 verifies the whole block.
        temperatures: Optional ``[S]`` STS temperatures (see :func:`load_calibration`).
    """

    threshold: float
    temperatures: torch.Tensor | None = None

    def __call__(self, confidence_logits: torch.Tensor | None, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
        """``[B]`` lengths of the leading runs of confident slots (see :class:`Schedule`)."""
        confident = (
            confidences(_require(confidence_logits, "ConfidenceThreshold"), self.temperatures) >= self.threshold
        )
        return confident.long().cumprod(dim=1).sum(dim=1)


@dataclass(frozen=True)
class CostTable:
    """Measured cost of one speculative round as a function of the tokens the target verifies.

    Attributes:
        num_tokens: Increasing token counts (rows × (1 + drafts)) that were measured.
        verify_seconds: Seconds of one target forward over that many tokens.
        draft_seconds: Seconds of drafting one block (added to every drafted round).
    """

    num_tokens: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_seconds: float = 0.0

    def verify_cost(self, num_tokens: int) -> float:
        """Seconds of a target forward over ``num_tokens`` tokens (linear interpolation, clamped)."""
        points, seconds = self.num_tokens, self.verify_seconds
        if len(points) == 1:
            return seconds[0]
        x = min(max(num_tokens, points[0]), points[-1])
        upper = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
        weight = (x - points[upper - 1]) / (points[upper] - points[upper - 1])
        return seconds[upper - 1] * (1 - weight) + seconds[upper] * weight

    def steps_per_second(self, num_tokens: int) -> float:
        """``SPS``: drafted rounds per second when verifying ``num_tokens`` tokens."""
        return 1.0 / (self.draft_seconds + self.verify_cost(num_tokens))

    @classmethod
    def estimate(cls, device_type: str, max_tokens: int) -> CostTable:
        """A built-in, deliberately pessimistic table in units of one single-token forward.

        On a CPU a forward's cost grows with every token (measured on a 2-core machine with a
        135M-parameter target: 8 tokens cost 1.4 single-token forwards, so 0.06 per extra token is
        assumed); on an accelerator it stays nearly flat until the batch fills the chip (0.01 per
        extra token assumed). Drafting is assumed to cost 0.15 of a forward.

        Args:
            device_type: ``"cpu"``, ``"cuda"``, ...
            max_tokens: The most tokens one forward verifies (rows × block width).
        """
        slope = 0.06 if device_type == "cpu" else 0.01
        points = tuple(sorted({1, max(max_tokens, 2)}))
        return cls(points, tuple(1.0 + slope * (n - 1) for n in points), draft_seconds=0.15)

    def to_dict(self) -> dict[str, object]:
        """The table as JSON-ready fields (read back by :meth:`load`)."""
        fields = {"num_tokens": list(self.num_tokens), "verify_seconds": list(self.verify_seconds)}
        return {**fields, "draft_seconds": self.draft_seconds}

    def save(self, path: str | Path) -> None:
        """Writes the table as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Reads a table written by :meth:`save`."""
        raw = json.loads(Path(path).read_text())
        return cls(tuple(raw["num_tokens"]), tuple(raw["verify_seconds"]), raw.get("draft_seconds", 0.0))


def goodput_lengths(survival: torch.Tensor, cost_table: CostTable) -> torch.Tensor:
    """Algorithm 1 with the lossless early stop: ``[B, S]`` prefix survivals -> ``[B]`` lengths.

    Goodput is ``τ · SPS(n)`` with ``τ = Σ_r (1 + Σ_{j <= ℓ_r} a_{r,j})`` expected tokens and
    ``n = Σ_r (1 + ℓ_r)`` verified tokens, as in the paper. (The loop's verification forward is a
    padded ``[R, 1 + max ℓ]`` block, so on hardware where cost follows padded tokens the table
    slightly favours ragged lengths; the choice stays lossless either way.)
    """
    num_rows = survival.shape[0]
    # Slot-major flattening + stable sort: ties go to the earlier slot, so prefixes stay prefixes.
    values, order = survival.T.flatten().sort(descending=True, stable=True)
    lengths = [0] * num_rows
    num_tokens, expected_tokens = num_rows, float(num_rows)
    best = expected_tokens * cost_table.steps_per_second(num_tokens)
    for value, index in zip(values.tolist(), order.tolist(), strict=True):
        goodput = (expected_tokens + value) * cost_table.steps_per_second(num_tokens + 1)
        if value <= 0 or goodput <= best:
            break  # the early stop: never look further down (lossless, see the module docstring)
        best, expected_tokens, num_tokens = goodput, expected_tokens + value, num_tokens + 1
        lengths[index % num_rows] = index // num_rows + 1
    return torch.tensor(lengths, dtype=torch.int64)


@dataclass(frozen=True)
class GoodputSchedule:
    """The paper's Algorithm 1: greedy admission by prefix survival, with the lossless early stop.

    Attributes:
        cost_table: Measured costs (:func:`spark_generate.profiling.profile_costs`).
        temperatures: Optional ``[S]`` STS temperatures.
    """

    cost_table: CostTable
    temperatures: torch.Tensor | None = None

    def __call__(self, confidence_logits: torch.Tensor | None, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
        """``[B]`` lengths chosen by Algorithm 1 with the early stop (see :class:`Schedule`)."""
        survival = confidences(_require(confidence_logits, "GoodputSchedule"), self.temperatures).cumprod(dim=1)
        return goodput_lengths(survival, self.cost_table)


@dataclass(frozen=True)
class AdaptiveSchedule:
    """The default schedule: Algorithm 1 on this machine's costs, and plain steps when drafting does not pay.

    Attributes:
        cost_table: Costs to plan with; None uses this machine's table for the target, dtype,
            device and batch size (profiled once and cached, see
            :func:`spark_generate.profiling.cost_table_for`).
        temperatures: Optional ``[S]`` STS temperatures of the confidence head.
        smoothing: Weight of the newest drafted round in the running gain.
        max_backoff: The most plain steps between two probing rounds.
    """

    cost_table: CostTable | None = None
    temperatures: torch.Tensor | None = None
    smoothing: float = 0.3
    max_backoff: int = 32

    def start(self, cost_table: CostTable, num_draft_tokens: int) -> AdaptiveRun:
        """The per-generation state of this schedule, planning with ``cost_table``."""
        return AdaptiveRun(self, cost_table, torch.zeros(num_draft_tokens), torch.zeros(num_draft_tokens))


class ScheduleRun(Protocol):
    """A schedule during one generation: the loop asks it before drafting, then after, then reports."""

    def should_draft(self) -> bool:
        """Whether this round drafts (else it is a plain decoding step)."""
        ...

    def lengths(self, confidence_logits: torch.Tensor | None, num_rows: int, num_draft_tokens: int) -> torch.Tensor:
        """``[R]`` int64 drafts to verify per row (see :class:`Schedule`)."""
        ...

    def record(self, num_verified: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """What a drafted round verified (``[R]``) and emitted (``[R]``, accepted + 1)."""
        ...


@dataclass
class EveryRound:
    """A stateless :class:`Schedule` during one generation: drafts every round."""

    schedule: Schedule

    def should_draft(self) -> bool:
        """Always."""
        return True

    def lengths(self, confidence_logits: torch.Tensor | None, num_rows: int, num_draft_tokens: int) -> torch.Tensor:
        """What the schedule chooses."""
        return self.schedule(confidence_logits, num_rows, num_draft_tokens)

    def record(self, num_verified: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """Nothing to remember."""


@dataclass
class AdaptiveRun:
    """:class:`AdaptiveSchedule` during one generation.

    ``gain`` is the running ratio of what drafted rounds emitted per modelled second to what
    plain steps would have emitted (``R`` tokens per single-token forward of ``R`` rows); below 1
    the next ``backoff`` rounds are plain steps, and ``backoff`` doubles at every probe that does
    not pay (up to ``max_backoff``), resetting once drafting pays again.
    """

    settings: AdaptiveSchedule
    cost_table: CostTable
    verified_by_slot: torch.Tensor  # [S] running counts, for heads without confidences
    accepted_by_slot: torch.Tensor
    gain: float | None = None
    plain_steps_left: int = 0
    backoff: int = 1

    def should_draft(self) -> bool:
        """False while stepping aside."""
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        return True

    def lengths(self, confidence_logits: torch.Tensor | None, num_rows: int, num_draft_tokens: int) -> torch.Tensor:
        """Algorithm 1 on the confidences, or on the running per-slot acceptance without them."""
        if confidence_logits is not None:
            survival = confidences(confidence_logits, self.settings.temperatures).cumprod(dim=1)
        else:  # Laplace-smoothed acceptance of each slot so far; optimistic before any evidence
            rates = (self.accepted_by_slot + 1) / (self.verified_by_slot + 1)
            survival = rates[:num_draft_tokens].cumprod(dim=0).expand(num_rows, -1)
        return goodput_lengths(survival.cpu(), self.cost_table)

    def record(self, num_verified: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """Updates the running gain and per-slot acceptance, and decides whether to step aside."""
        num_verified, num_accepted = num_verified.cpu(), num_emitted.cpu() - 1
        slots = torch.arange(len(self.verified_by_slot))
        self.verified_by_slot += (slots[None] < num_verified[:, None]).sum(0)
        self.accepted_by_slot += (slots[None] < num_accepted[:, None]).sum(0)
        num_rows, width = len(num_verified), int(num_verified.max()) + 1
        table = self.cost_table
        round_seconds = table.draft_seconds + table.verify_cost(num_rows * width)
        ratio = (float(num_emitted.sum()) / round_seconds) / (num_rows / table.verify_cost(num_rows))
        weight = self.settings.smoothing
        self.gain = ratio if self.gain is None else (1 - weight) * self.gain + weight * ratio
        if self.gain < 1.0:
            self.plain_steps_left = self.backoff
            self.backoff = min(2 * self.backoff, self.settings.max_backoff)
        else:
            self.backoff = 1


def start_schedule(
    schedule: Schedule | AdaptiveSchedule, cost_table: CostTable | None, num_draft_tokens: int
) -> ScheduleRun:
    """The per-generation run of a schedule (``cost_table`` is used by :class:`AdaptiveSchedule` only)."""
    if isinstance(schedule, AdaptiveSchedule):
        return schedule.start(schedule.cost_table or cost_table, num_draft_tokens)
    return EveryRound(schedule)
