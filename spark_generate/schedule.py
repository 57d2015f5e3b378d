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
* :class:`AdaptiveSchedule`, the default, plans on this machine's costs with a *lookahead*
  (:func:`lookahead_lengths`) and adds a switch. Algorithm 1 admits one token at a time and stops
  at the first that does not pay, which is blind to a cost that jumps at the first draft and then
  stays flat (a CPU forward over two tokens can cost nearly twice one, over eight barely more than
  over two): no single draft pays there, yet a whole block can. The lookahead widens the block
  slot by slot, every row alike (the target's forward is a padded block, so a row verifying fewer
  than the width saves nothing), and admits slot ``j`` while *some* width ``>= j`` beats stopping
  before it, valuing the slots ``<= j`` by their survivals and the slots after ``j`` by this
  generation's running per-slot acceptance: slot ``j``'s decision reads ``c_<=j`` (drafts
  ``< j``) and the past, never ``d_j``. The switch keeps a running measure of what drafted rounds
  paid (tokens per second of modelled cost, against plain decoding), and when drafting does not
  pay it decodes plain steps without running the draft head, probing again after a growing number
  of steps. It reads only how many tokens *past* rounds emitted, so every round is lossless given
  the past, and so is the whole generation. Without a confidence head, survivals come from the
  running per-slot acceptance alone. With a suffix drafter (:mod:`spark_generate.suffix`) it also
  chooses, per row and before anything of the round is drawn, which drafter drafts
  (:meth:`AdaptiveRun.sources`): the suffix draft is a function of the committed tokens, so its
  estimates may decide freely, and the head is judged by its past record only.

``SPS`` comes from a :class:`CostTable`: measured on the user's own hardware by
:func:`spark_generate.profiling.profile_costs` (and cached per target, dtype, device and batch size
by :func:`spark_generate.profiling.cost_table_for`), or the built-in :meth:`CostTable.estimate`.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import torch

from spark_generate.drafting import NO_CONFIDENCE
from spark_generate.heads.hub_io import load_calibration  # a head folder's calibration.json, re-exported
from spark_generate.telemetry import DraftSource

__all__ = [
    "AdaptiveSchedule",
    "ConfidenceThreshold",
    "CostTable",
    "FixedLength",
    "GoodputSchedule",
    "Schedule",
    "ScheduleRun",
    "SlotAcceptance",
    "confidences",
    "load_calibration",
    "lookahead_lengths",
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

    The costs grow with the context too: a forward's attention reads every cached token of its
    rows, so a wide round over a long context costs more plain steps than over a short one (batch
    16 on a 2-core CPU: 80 tokens cost 2.9 single-token steps at 64 cached tokens a row, 3.5 at
    350). A table measured at two context lengths keeps the slope, and :meth:`at_context` gives the
    table for a round's context (linear beyond the first length, as attention is).

    Attributes:
        num_tokens: Increasing token counts (rows × (1 + drafts)) that were measured.
        verify_seconds: Seconds of one target forward over that many tokens.
        draft_seconds: Seconds of drafting one block (added to every drafted round).
        context_length: Cached tokens per row the seconds above were measured at (0: not known).
        verify_seconds_per_context: Per token count, the seconds a forward adds per cached token
            beyond ``context_length`` (empty: costs taken as independent of the context).
        draft_seconds_per_context: The same for drafting one block.
    """

    num_tokens: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_seconds: float = 0.0
    context_length: int = 0
    verify_seconds_per_context: tuple[float, ...] = ()
    draft_seconds_per_context: float = 0.0

    def at_context(self, context_length: int) -> CostTable:
        """The table of rounds over ``context_length`` cached tokens per row (never below the measured costs)."""
        extra = context_length - self.context_length
        if extra <= 0 or not self.verify_seconds_per_context:
            return self
        slopes = zip(self.verify_seconds, self.verify_seconds_per_context, strict=True)
        seconds = tuple(base + extra * slope for base, slope in slopes)
        draft_seconds = self.draft_seconds + extra * self.draft_seconds_per_context
        return replace(self, verify_seconds=seconds, draft_seconds=draft_seconds, context_length=context_length)

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
        context = {
            "context_length": self.context_length,
            "verify_seconds_per_context": list(self.verify_seconds_per_context),
            "draft_seconds_per_context": self.draft_seconds_per_context,
        }
        return {**fields, "draft_seconds": self.draft_seconds, **context}

    def save(self, path: str | Path) -> None:
        """Writes the table as JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Reads a table written by :meth:`save`."""
        raw = json.loads(Path(path).read_text())
        return cls(
            tuple(raw["num_tokens"]), tuple(raw["verify_seconds"]), raw.get("draft_seconds", 0.0),
            raw.get("context_length", 0), tuple(raw.get("verify_seconds_per_context", ())),
            raw.get("draft_seconds_per_context", 0.0),
        )  # fmt: skip


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


def lookahead_lengths(survival: torch.Tensor, acceptance: torch.Tensor, cost_table: CostTable) -> torch.Tensor:
    """The adaptive schedule's plan: one verify length for every row, chosen slot by slot with lookahead.

    Verifying ``k`` drafts in each of ``R`` rows costs one forward over ``R (1 + k)`` tokens and is
    expected to emit ``R + sum_r sum_{j <= k} a_{r,j}`` tokens. Slot ``j`` is admitted (having
    admitted ``1 .. j - 1``) while the best goodput over widths ``k >= j`` beats stopping at
    ``j - 1``; the survivals of slots after ``j`` (which read ``d_j``) are not looked at: they are
    projected from ``a_{r,j}`` with the per-slot conditional ``acceptance`` of past rounds. The
    first slot that does not pay ends the search, so whether slot ``j`` is verified depends on
    ``a_{., <= j}`` and the past only (lossless, see the module docstring).

    Args:
        survival: ``[R, S]`` prefix survivals ``a_{r,j}`` of this round's drafts.
        acceptance: ``[S]`` probability that slot ``j`` is accepted when reached, from past rounds,
            or ``[R, S]`` per row (rows drafted by different drafters).
        cost_table: The costs to plan with.

    Returns:
        ``[R]`` int64 lengths, all equal.
    """
    num_rows, num_slots = survival.shape
    survival = survival.double()
    acceptance = acceptance.double().expand(num_rows, num_slots)
    expected = survival.sum(dim=0).tolist()  # [S] expected accepted tokens at each slot, all rows
    length, tokens = 0, float(num_rows)
    best = tokens * cost_table.steps_per_second(num_rows)
    for slot in range(num_slots):
        known = tokens + expected[slot]  # slots <= this one valued by their survivals
        projected, extension = known * cost_table.steps_per_second(num_rows * (slot + 2)), 0.0
        # Slots after this one, projected from its survivals with each row's past acceptance.
        reaches = (survival[:, slot, None] * acceptance[:, slot + 1 :].cumprod(dim=1)).sum(dim=0).tolist()
        for later, reach in enumerate(reaches, start=slot + 1):  # widths 1 + later + 1
            extension += reach
            projected = max(projected, (known + extension) * cost_table.steps_per_second(num_rows * (later + 2)))
        if projected <= best:
            break  # lossless early stop: slots after this one are never admitted
        length, tokens = slot + 1, known
        best = tokens * cost_table.steps_per_second(num_rows * (length + 1))
    return torch.full((num_rows,), length, dtype=torch.int64)


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
    """The default schedule: a lookahead plan on this machine's costs, and plain steps when drafting does not pay.

    Attributes:
        cost_table: Costs to plan with; None uses this machine's table for the target, dtype,
            device and batch size (profiled once and cached, see
            :func:`spark_generate.profiling.cost_table_for`).
        temperatures: Optional ``[S]`` STS temperatures of the confidence head.
        smoothing: Weight of the newest drafted round in the running means of the gain.
        max_backoff: The most plain steps between two probing rounds.
        probe_budget: While the head is not expected to pay, it still drafts once the rounds without
            it, each counted as this share of a plain step, add up to what a probe costs beyond a
            plain step (its drafting pass and a forward over one draft more per row), so such probes
            cost about this share of the time; at the latest after ``max_backoff`` rounds.
    """

    cost_table: CostTable | None = None
    temperatures: torch.Tensor | None = None
    smoothing: float = 0.5
    max_backoff: int = 32
    probe_budget: float = 0.02

    def start(self, cost_table: CostTable, num_draft_tokens: int) -> AdaptiveRun:
        """The per-generation state of this schedule, planning with ``cost_table``, for blocks of ``S`` drafts."""
        return AdaptiveRun(
            self, cost_table, SlotAcceptance.zeros(num_draft_tokens), SlotAcceptance.zeros(num_draft_tokens)
        )


class ScheduleRun(Protocol):
    """A schedule during one generation: the loop asks it where each row drafts, how much to verify, then reports."""

    def sources(
        self, suffix_confidence_logits: torch.Tensor | None, num_rows: int, head_slots: int, context_length: int = 0
    ) -> torch.Tensor:
        """``[R]`` int64 :class:`~spark_generate.telemetry.DraftSource` of each row: the round's first call.

        Args:
            suffix_confidence_logits: ``[R, L]`` logits of the suffix drafts' estimated
                acceptance (a deterministic function of the committed tokens), or None without a
                suffix drafter.
            num_rows: ``R``.
            head_slots: The head's draft slots (0 without a head).
            context_length: Cached tokens per row of the target (padded), what the round's
                forward attends to.
        """
        ...

    def lengths(
        self,
        confidence_logits: torch.Tensor | None,
        num_rows: int,
        num_draft_tokens: int,
        sources: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[R]`` int64 drafts to verify per row (see :class:`Schedule`); 0 for plain rows.

        ``sources`` (``[R]``, from :meth:`sources`; None: every row drafted by the head) tells
        which drafter each row's confidence logits come from.
        """
        ...

    def record(
        self,
        num_verified: torch.Tensor,
        num_emitted: torch.Tensor,
        live: torch.Tensor,
        sources: torch.Tensor | None = None,
    ) -> None:
        """What a round verified (``[R]``) and emitted (``[R]``, accepted + 1) in its ``[R]`` live rows."""
        ...


def _padded(temperatures: torch.Tensor | None, num_slots: int) -> torch.Tensor | None:
    """``[num_slots]`` STS temperatures: the head's ``[S]`` ones, 1 for the slots past them (or None)."""
    if temperatures is None:
        return None
    padded = torch.ones(num_slots)
    width = min(num_slots, len(temperatures))
    padded[:width] = temperatures[:width]
    return padded


def _within_drafts(
    lengths: torch.Tensor, sources: torch.Tensor, confidence_logits: torch.Tensor | None
) -> torch.Tensor:
    """``[R]`` lengths cut to each row's drafts: none for a plain row, and no slot past its drafter's.

    Where a row's drafts end is known before any draw (a suffix draft is a function of the committed
    tokens; the head's block has a fixed size), so the cut is lossless.
    """
    lengths = torch.where(sources == DraftSource.PLAIN, 0, lengths)
    if confidence_logits is None:
        return lengths
    return torch.minimum(lengths, _filled_slots(confidence_logits.cpu()).sum(dim=1))


def _filled_slots(confidence_logits: torch.Tensor) -> torch.Tensor:
    """``[R, S]`` bool: the leading slots a drafter filled (confidence logit above :data:`NO_CONFIDENCE`, or NaN)."""
    return (~(confidence_logits <= NO_CONFIDENCE)).long().cumprod(dim=1).bool()


def _default_sources(suffix_confidence_logits: torch.Tensor | None, num_rows: int, head_slots: int) -> torch.Tensor:
    """The head where there is one, else the suffix drafter where there is one, else plain steps."""
    if head_slots:
        source = DraftSource.HEAD
    else:
        source = DraftSource.PLAIN if suffix_confidence_logits is None else DraftSource.SUFFIX
    return torch.full((num_rows,), int(source), dtype=torch.int64)


@dataclass
class EveryRound:
    """A stateless :class:`Schedule` during one generation: drafts every round, with the head where there is one."""

    schedule: Schedule

    def sources(
        self, suffix_confidence_logits: torch.Tensor | None, num_rows: int, head_slots: int, context_length: int = 0
    ) -> torch.Tensor:
        """The head for every row; the suffix drafter without a head."""
        return _default_sources(suffix_confidence_logits, num_rows, head_slots)

    def lengths(
        self,
        confidence_logits: torch.Tensor | None,
        num_rows: int,
        num_draft_tokens: int,
        sources: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """What the schedule chooses (none for plain rows, none past a suffix draft's end)."""
        lengths = self.schedule(confidence_logits, num_rows, num_draft_tokens)
        return lengths if sources is None else _within_drafts(lengths, sources.cpu(), confidence_logits)

    def record(
        self,
        num_verified: torch.Tensor,
        num_emitted: torch.Tensor,
        live: torch.Tensor,
        sources: torch.Tensor | None = None,
    ) -> None:
        """Nothing to remember."""


@dataclass
class SlotAcceptance:
    """One drafter's record during a generation: per slot, how often it was reached, accepted, and vouched for.

    A slot is *reached* when it was verified and every earlier slot of its round was accepted.
    Besides, the prefix survivals the drafter's rows were planned with are summed over every row
    it drafted, verified or not (a round whose confidences were too low to verify anything is
    evidence too).
    """

    reached_by_slot: torch.Tensor  # [S] running counts: slot verified and every earlier slot accepted
    accepted_by_slot: torch.Tensor  # [S] of those, accepted
    confidence_by_slot: torch.Tensor  # [S] of those, the summed confidences the slots were given
    survival_by_slot: torch.Tensor  # [S] summed prefix survivals of every drafted row
    drafted_rows: torch.Tensor  # [] how many rows those were

    @classmethod
    def zeros(cls, num_slots: int) -> SlotAcceptance:
        """No evidence yet, for blocks of ``num_slots`` drafts."""
        return cls(*(torch.zeros(num_slots) for _ in range(4)), torch.zeros(()))

    def expected_survival(self, num_slots: int) -> torch.Tensor:
        """``[num_slots]`` prefix survivals to expect of a new draft: the past rows' mean, else the acceptance's."""
        if self.drafted_rows > 0:
            return self.survival_by_slot[:num_slots] / self.drafted_rows
        return self.acceptance[:num_slots].cumprod(dim=0)

    def planned(self, survival: torch.Tensor) -> None:
        """Adds the ``[R, S']`` prefix survivals this round's rows of the drafter were planned with."""
        self.survival_by_slot[: survival.shape[1]] += survival.sum(dim=0)
        self.drafted_rows += len(survival)

    @property
    def acceptance(self) -> torch.Tensor:
        """``[S]`` per-slot acceptance when reached so far, Laplace-smoothed (1/2 before any evidence)."""
        return (self.accepted_by_slot + 1) / (self.reached_by_slot + 2)

    def survival(self, confidences: torch.Tensor) -> torch.Tensor:
        """``[R, S']`` prefix survivals: ``[R, S']`` confidences corrected by the acceptance seen so far.

        Each slot's confidence is multiplied by how often reached slots were accepted against the
        confidence they were given, clamped to 1, and multiplied along the block.
        """
        num_slots = confidences.shape[1]
        correction = (self.accepted_by_slot[:num_slots] + 1) / (self.confidence_by_slot[:num_slots] + 1)
        return (confidences * correction).clamp(max=1.0).cumprod(dim=1)

    def record(self, num_verified: torch.Tensor, num_accepted: torch.Tensor, confidences: torch.Tensor | None) -> None:
        """Adds rounds of ``[R]`` verified and accepted drafts given ``[R, S']`` confidences (or None)."""
        slots = torch.arange(len(self.reached_by_slot))
        reached = (slots[None] < num_verified[:, None]) & (slots[None] <= num_accepted[:, None])
        self.reached_by_slot += reached.sum(0)
        self.accepted_by_slot += (slots[None] < num_accepted[:, None]).sum(0)
        if confidences is not None:
            width = min(confidences.shape[1], len(slots))
            self.confidence_by_slot[:width] += (confidences[:, :width] * reached[:, :width]).sum(0)


@dataclass
class AdaptiveRun:
    """:class:`AdaptiveSchedule` during one generation.

    ``gain`` is what head-drafted rounds emitted per row over what they cost in plain steps (running
    means of both, so one lucky round does not hide the losing rounds after it); below 1 the next
    ``backoff`` rounds do not run the head, and ``backoff`` doubles at every probe that does not
    pay (up to ``max_backoff``), resetting once drafting pays again. Each drafter's confidences are
    corrected per slot by how often its reached slots were accepted against the confidence they
    were given in past rounds (:class:`SlotAcceptance`; so a head calibrated elsewhere, or at
    another temperature, is brought to this generation's acceptance, and a suffix match's
    frequency estimate to how often such matches really continue).

    Each round, :meth:`sources` chooses for the whole batch (the forward is a padded block, so one
    row drafting makes every row pay for the width) the plan expected to emit the most tokens per
    plain step of cost: per row a plain step, the suffix draft (its estimates corrected by the
    suffix's own record) or, when it is the head's turn, the head's draft (the mean survivals its
    rows were planned with so far, 1/2 per slot before any; the drafting pass counted). A turn
    where the head is not expected to beat plain steps is stepped aside as after a probe that did
    not pay, unless the rounds without the head have paid for a probe, or it has not drafted yet in
    this generation and a draft accepted whole would pay (its prior of 1/2 per slot is no
    evidence): then it probes anyway.
    The suffix draft is a function of the committed tokens and the head's record is the past's,
    so the choice is made before any draft of the round is drawn and is lossless.
    """

    settings: AdaptiveSchedule
    cost_table: CostTable
    head: SlotAcceptance
    suffix: SlotAcceptance
    last_confidences: torch.Tensor | None = None  # [R, S] of the round being verified (each row its drafter's)
    tokens: float | None = None  # running mean tokens per row of a head-drafted round
    cost: float | None = None  # running mean cost of a head-drafted round, in plain steps
    plain_steps_left: int = 0
    backoff: int = 1
    rounds_without_head: int = 0  # rounds since the head last drafted
    head_drafted: bool = False  # whether the head has drafted in this generation
    probing: bool = False  # this round's head drafts although its record says they do not pay
    round_costs: CostTable | None = None  # cost_table at this round's context (set by sources)

    def __post_init__(self) -> None:
        if self.round_costs is None:
            self.round_costs = self.cost_table

    @property
    def gain(self) -> float | None:
        """Running tokens per plain step of head-drafted rounds (plain decoding: 1); None before any."""
        return None if self.tokens is None or self.cost is None else self.tokens / self.cost

    def should_draft(self) -> bool:
        """Whether the head drafts this round: False while stepping aside."""
        if self.plain_steps_left > 0:
            self.plain_steps_left -= 1
            return False
        return True

    def sources(
        self, suffix_confidence_logits: torch.Tensor | None, num_rows: int, head_slots: int, context_length: int = 0
    ) -> torch.Tensor:
        """``[R]`` each row's drafter under the round plan expected to emit the most tokens per unit of cost.

        The forward is a padded ``[R, 1 + k]`` block, so a plan is judged for the whole batch: for
        each width ``k``, every row takes its best of a plain step (one token), its suffix draft
        (``1 +`` the prefix survivals of its first ``k`` slots, corrected by the suffix's record)
        and, in plans that run the head (not while it steps aside), the head's draft (``1 +`` the
        mean prefix survivals of its first ``k`` slots over the rows it drafted so far; before any,
        its acceptance multiplied along the slots, 1/2 per slot); the plan's value is the batch's
        expected tokens over the forward's cost (plus the draft pass when the head runs), in plain
        steps. The best plan wins (ties: without the head, then narrower); a plain step of every row
        is the plan of value 1. A turn whose head plan is not expected to beat plain steps counts as
        a probe that did not pay (the head steps aside for twice as long), except once the rounds it
        has not drafted have paid for a probe (``probe_budget`` of a plain step each against the
        drafting pass and the wider forward of a one-draft round, up to ``max_backoff`` rounds),
        when it drafts anyway: its record is from the past, and what it drafts may have changed
        (such a probe verifies at least one draft per row, see :meth:`lengths`). Its first turn of a
        generation probes too, unless no draft could pay even if every slot were accepted: until
        then it has no record, only a prior. The round's costs
        (here, in :meth:`lengths` and :meth:`record`) are the table's at ``context_length``
        (:meth:`CostTable.at_context`).
        """
        self.round_costs = self.cost_table.at_context(context_length)
        self.probing = False
        head_turn = head_slots > 0 and self.should_draft()
        matched = torch.zeros(num_rows, dtype=torch.bool)  # rows with a suffix draft
        if suffix_confidence_logits is not None:
            matched = _filled_slots(suffix_confidence_logits[:, :1].cpu())[:, 0]
        if not head_turn and not bool(matched.any()):
            # nothing to choose from: every row steps plainly (what the plans below come to)
            self.rounds_without_head += 1
            return torch.full((num_rows,), int(DraftSource.PLAIN), dtype=torch.int64)
        width = head_slots if head_turn else 0
        plain = torch.ones(num_rows, 1, dtype=torch.float64)
        suffix_tokens = head_tokens = plain
        if suffix_confidence_logits is not None:
            survival = self.suffix.survival(confidences(suffix_confidence_logits).cpu())
            suffix_tokens, width = _tokens_by_width(survival), max(width, survival.shape[1])
        if head_turn:
            head_tokens = _tokens_by_width(self.head.expected_survival(head_slots).expand(num_rows, -1))
        suffix_tokens, head_tokens = _widened(suffix_tokens, width), _widened(head_tokens, width)
        options = [torch.maximum(suffix_tokens, torch.ones_like(suffix_tokens))]  # plain steps and suffix drafts
        if head_turn:
            options.append(torch.maximum(head_tokens, suffix_tokens))
        table = self.round_costs
        base = table.verify_cost(num_rows)
        forwards = torch.tensor([table.verify_cost(num_rows * (1 + k)) for k in range(width + 1)], dtype=torch.float64)
        plans = []  # per option, its best (value, width): the narrowest of the best widths
        for option, tokens in enumerate(options):
            values = tokens.mean(dim=0) * base / ((table.draft_seconds if option else 0.0) + forwards)
            best_width = int(values.argmax())  # the first of equal maxima
            plans.append((float(values[best_width]), best_width))
        option = 1 if head_turn and plans[1][0] > max(plans[0][0], 1.0) else 0
        if head_turn and plans[1][0] <= 1.0:  # the head's turn, but it is not expected to pay at all
            # Its record may be out of date: it probes once the rounds without it have paid for a probe.
            waited, settings = self.rounds_without_head, self.settings
            probe_cost = (table.draft_seconds + float(forwards[1]) - base) / base  # beyond a plain step
            probes = waited * settings.probe_budget >= probe_cost or waited >= settings.max_backoff
            if not probes and not self.head_drafted:  # only a prior, no record: probe where a whole draft pays
                whole = torch.arange(1, width + 2, dtype=torch.float64)  # tokens by width, every draft accepted
                probes = bool((whole * base / (table.draft_seconds + forwards) > 1.0).any())
            if probes:
                option, self.probing = 1, True
            else:
                self._step_aside()  # as after a probe that did not pay
        self.rounds_without_head = 0 if option else self.rounds_without_head + 1
        self.head_drafted |= bool(option)
        k = plans[option][1] if option or plans[0][0] > 1.0 else 0
        fallback = DraftSource.HEAD if option else DraftSource.PLAIN
        drafts_more = matched & (suffix_tokens[:, k] > (head_tokens[:, k] if option else 1.0))
        return torch.where(drafts_more, int(DraftSource.SUFFIX), int(fallback)).to(torch.int64)

    def lengths(
        self,
        confidence_logits: torch.Tensor | None,
        num_rows: int,
        num_draft_tokens: int,
        sources: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`lookahead_lengths` on each row's corrected confidences (the running acceptance without them).

        In a round where the head probes (:meth:`sources`), every drafted row verifies at least one
        draft, whatever the round's confidences say: a probe that verified nothing would pay its
        drafting pass and learn nothing. That is decided before anything is drafted, so it is lossless.
        """
        if sources is None:
            sources = torch.full((num_rows,), int(DraftSource.HEAD), dtype=torch.int64)
        sources = sources.cpu()
        survival = torch.zeros(num_rows, num_draft_tokens)
        acceptance = torch.zeros(num_rows, num_draft_tokens)
        self.last_confidences = None
        if confidence_logits is not None:
            logits = confidence_logits[:, :num_draft_tokens].float().cpu()
            head_confidences = confidences(logits, _padded(self.settings.temperatures, logits.shape[1]))
            self.last_confidences = torch.where(
                (sources == DraftSource.HEAD)[:, None], head_confidences, torch.sigmoid(logits)
            )
        for source, record in ((DraftSource.HEAD, self.head), (DraftSource.SUFFIX, self.suffix)):
            rows = sources == source
            if rows.any():
                acceptance[rows] = record.acceptance[:num_draft_tokens]
                given = None if self.last_confidences is None else self.last_confidences[rows]
                if given is None or bool(given.isnan().any()):  # a drafter without confidences
                    survival[rows] = record.acceptance[:num_draft_tokens].cumprod(dim=0)
                else:
                    survival[rows] = record.survival(given)
        if confidence_logits is not None:  # slots past a row's drafts (a shorter block, a short match): none
            filled = _filled_slots(confidence_logits.cpu()[:, :num_draft_tokens])
            survival, acceptance = survival * filled, acceptance * filled
        head_rows = sources == DraftSource.HEAD
        if bool(head_rows.any()):  # what the head's turns are judged by (sources)
            self.head.planned(survival[head_rows])
        lengths = lookahead_lengths(survival, acceptance, self.round_costs)
        if self.probing:  # a probe verifies a draft whatever this round's confidences say: it is there to learn
            lengths = lengths.clamp(min=1)
        return _within_drafts(lengths, sources, confidence_logits)

    def record(
        self,
        num_verified: torch.Tensor,
        num_emitted: torch.Tensor,
        live: torch.Tensor,
        sources: torch.Tensor | None = None,
    ) -> None:
        """Updates each drafter's per-slot acceptance and the head's running gain, and decides whether to step aside.

        Args:
            num_verified: ``[R]`` drafts verified per row this round.
            num_emitted: ``[R]`` tokens emitted (accepted + 1).
            live: ``[R]`` bool, the rows that had not stopped before the round (the others are ignored).
            sources: ``[R]`` each row's drafter (None: the head's, every row).
        """
        live = live.cpu()
        if sources is None:
            sources = torch.full(live.shape, int(DraftSource.HEAD), dtype=torch.int64)
        sources = sources.cpu()
        num_verified, num_accepted = num_verified.cpu(), num_emitted.cpu() - 1
        width = int(num_verified[live].max()) + 1 if live.any() else 1
        for source, record in ((DraftSource.HEAD, self.head), (DraftSource.SUFFIX, self.suffix)):
            rows = live & (sources == source)
            if rows.any():
                given = None if self.last_confidences is None else self.last_confidences[rows]
                given = None if given is None or bool(given.isnan().any()) else given
                record.record(num_verified[rows], num_accepted[rows], given)
        head_rows = live & (sources == DraftSource.HEAD)
        if not head_rows.any():
            return
        num_rows, table = int(live.sum()), self.round_costs
        cost = (table.draft_seconds + table.verify_cost(num_rows * width)) / table.verify_cost(num_rows)
        tokens = float(num_accepted[head_rows].sum() + head_rows.sum()) / float(head_rows.sum())
        weight = self.settings.smoothing
        self.tokens = tokens if self.tokens is None else (1 - weight) * self.tokens + weight * tokens
        self.cost = cost if self.cost is None else (1 - weight) * self.cost + weight * cost
        if self.gain < 1.0:
            self._step_aside()
        else:
            self.backoff = 1

    def _step_aside(self) -> None:
        """No head for the next ``backoff`` rounds, and twice as long next time (up to ``max_backoff``)."""
        self.plain_steps_left = self.backoff
        self.backoff = min(2 * self.backoff, self.settings.max_backoff)


def _tokens_by_width(survival: torch.Tensor) -> torch.Tensor:
    """``[R, L + 1]`` float64 expected tokens when verifying ``k = 0 .. L`` drafts, from ``[R, L]`` survivals."""
    survival = survival.double()
    return torch.cat([survival.new_zeros(len(survival), 1), survival.cumsum(dim=1)], dim=1) + 1


def _widened(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width + 1]``: ``[R', L + 1]`` expected tokens by width (``R'`` 1 or ``R``), flat past ``L``."""
    tokens = tokens[:, : width + 1]
    missing = width + 1 - tokens.shape[1]
    return torch.cat([tokens, tokens[:, -1:].expand(-1, missing)], dim=1) if missing > 0 else tokens


def start_schedule(
    schedule: Schedule | AdaptiveSchedule, cost_table: CostTable | None, num_draft_tokens: int
) -> ScheduleRun:
    """The per-generation run of a schedule (``cost_table`` is used by :class:`AdaptiveSchedule` only)."""
    if isinstance(schedule, AdaptiveSchedule):
        return schedule.start(schedule.cost_table or cost_table, num_draft_tokens)
    return EveryRound(schedule)
