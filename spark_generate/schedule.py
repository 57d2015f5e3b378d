"""How many drafts of each row to verify: fixed length, confidence threshold, or goodput (Algorithm 1).

The confidence head gives, per draft slot ``j``, a logit whose sigmoid ``c_j`` (optionally divided
by a per-slot temperature from a calibration file, "STS") estimates the probability that ``d_j``
is accepted given that ``d_<j`` were. ``c_j`` reads the hidden state of slot ``j`` and the token
drafted at ``j - 1``, never ``d_j`` itself. Truncating the block is lossless if and only if the
decision to verify slot ``j`` never depends on ``d_j`` or later tokens (dspark_spec §3.4); each
schedule below holds that by construction:

* :class:`FixedLength` verifies ``num_draft_tokens`` slots whatever was drafted;
* :class:`ConfidenceThreshold` verifies up to, excluding, the first slot with ``c_j < threshold``:
  slot ``j`` is admitted from ``c_1..c_j`` only;
* :class:`GoodputSchedule` is the paper's Algorithm 1: prefix survivals ``a_{r,j} = c_{r,1}···c_{r,j}``
  are admitted in descending order (ties: earlier slot first) while the goodput ``τ · SPS(tokens)``
  improves, and the **first** non-improving candidate stops the search. Every candidate looked at
  before ``(r, j)`` has a survival ``>= a_{r,j}``, so it is another row's or an earlier slot's, and
  nothing that depends on ``d_{r,j}`` (e.g. ``a_{r,j+1}``) can influence whether ``(r, j)`` is
  admitted. A retrospective global argmax over all prefixes would look at ``a_{r,j+1}`` and is
  biased (the paper's Appendix A; ``tests/test_schedule.py`` reproduces it).

``SPS`` comes from a :class:`CostTable` measured on the user's own hardware by
:func:`profile_costs` and saved as JSON.
"""

from __future__ import annotations

import bisect
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from transformers import LogitsProcessorList, PreTrainedModel

from spark_generate.cache import FeatureTap, cache_kwarg_name, crop_cache, take_cache, target_forward
from spark_generate.drafting import DraftContext, RowPrefixes, Sampling, draft_block
from spark_generate.heads import DSparkHead

__all__ = [
    "ConfidenceThreshold",
    "CostTable",
    "FixedLength",
    "GoodputSchedule",
    "Schedule",
    "confidences",
    "load_calibration",
    "profile_costs",
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
        draft_seconds: Seconds of drafting one block (added to every round).
    """

    num_tokens: tuple[int, ...]
    verify_seconds: tuple[float, ...]
    draft_seconds: float = 0.0

    def steps_per_second(self, num_tokens: int) -> float:
        """``SPS``: rounds per second when verifying ``num_tokens`` tokens (linear interpolation)."""
        points, seconds = self.num_tokens, self.verify_seconds
        if len(points) == 1:
            return 1.0 / (self.draft_seconds + seconds[0])
        x = min(max(num_tokens, points[0]), points[-1])
        upper = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)
        weight = (x - points[upper - 1]) / (points[upper] - points[upper - 1])
        verify = seconds[upper - 1] * (1 - weight) + seconds[upper] * weight
        return 1.0 / (self.draft_seconds + verify)

    def save(self, path: str | Path) -> None:
        """Writes the table as JSON."""
        fields = {"num_tokens": list(self.num_tokens), "verify_seconds": list(self.verify_seconds)}
        Path(path).write_text(json.dumps({**fields, "draft_seconds": self.draft_seconds}, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        """Reads a table written by :meth:`save`."""
        raw = json.loads(Path(path).read_text())
        return cls(tuple(raw["num_tokens"]), tuple(raw["verify_seconds"]), raw.get("draft_seconds", 0.0))


@dataclass(frozen=True)
class GoodputSchedule:
    """The paper's Algorithm 1: greedy admission by prefix survival, with the lossless early stop.

    Goodput is ``τ · SPS(n)`` with ``τ = Σ_r (1 + Σ_{j <= ℓ_r} a_{r,j})`` expected tokens and
    ``n = Σ_r (1 + ℓ_r)`` verified tokens, as in the paper. (The loop's verification forward is a
    padded ``[R, 1 + max ℓ]`` block, so on hardware where cost follows padded tokens the table
    slightly favours ragged lengths; the choice stays lossless either way.)

    Attributes:
        cost_table: Measured costs (:func:`profile_costs`).
        temperatures: Optional ``[S]`` STS temperatures.
    """

    cost_table: CostTable
    temperatures: torch.Tensor | None = None

    def __call__(self, confidence_logits: torch.Tensor | None, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
        """``[B]`` lengths chosen by Algorithm 1 with the early stop (see :class:`Schedule`)."""
        survival = confidences(_require(confidence_logits, "GoodputSchedule"), self.temperatures).cumprod(dim=1)
        num_rows = survival.shape[0]
        # Slot-major flattening + stable sort: ties go to the earlier slot, so prefixes stay prefixes.
        values, order = survival.T.flatten().sort(descending=True, stable=True)
        lengths = [0] * num_rows
        num_tokens, expected_tokens = num_rows, float(num_rows)
        best = expected_tokens * self.cost_table.steps_per_second(num_tokens)
        for value, index in zip(values.tolist(), order.tolist(), strict=True):
            goodput = (expected_tokens + value) * self.cost_table.steps_per_second(num_tokens + 1)
            if value <= 0 or goodput <= best:
                break  # the early stop: never look further down (lossless, see the module docstring)
            best, expected_tokens, num_tokens = goodput, expected_tokens + value, num_tokens + 1
            lengths[index % num_rows] = index // num_rows + 1
        return torch.tensor(lengths, dtype=torch.int64)


@torch.no_grad()
def profile_costs(
    model: PreTrainedModel,
    head: DSparkHead,
    *,
    batch_size: int = 1,
    context_length: int = 64,
    repeats: int = 3,
    path: str | Path | None = None,
) -> CostTable:
    """Measures verification and drafting costs on this machine, optionally saving them as JSON.

    Runs a prefill of random tokens, then times (best of ``repeats``) one draft round and one target
    forward over ``batch_size × (1 + n)`` tokens for ``n = 0 .. S``, rolling the cache back each time.

    Args:
        model: The target.
        head: Its draft head (attached to it here).
        batch_size: Rows per round.
        context_length: Prompt length of the measurement.
        repeats: Timings per point; the fastest is kept.
        path: Where to write the table (JSON), or None.

    Returns:
        The cost table.
    """
    head.attach(model)
    device = next(model.parameters()).device
    input_ids = torch.randint(0, head.config.target_vocab_size, (batch_size, context_length), device=device)
    positions = torch.arange(context_length, device=device).expand(batch_size, -1)
    rows = torch.arange(batch_size, device=device)
    cache, cache_kwarg = take_cache(model, {}), cache_kwarg_name(model)

    def verify(num_verified: int) -> None:
        block_positions = positions[:, -1:] + 1 + torch.arange(num_verified + 1, device=device)
        mask = torch.ones(batch_size, context_length + num_verified + 1, dtype=torch.long, device=device)
        target_forward(
            model, input_ids[:, : num_verified + 1], cache=cache, cache_kwarg=cache_kwarg, attention_mask=mask,
            position_ids=block_positions, num_logits=num_verified + 1,
        )  # fmt: skip
        tap.take()
        crop_cache(cache, context_length)

    with FeatureTap(model, head.config.target_layer_ids, device) as tap:
        target_forward(
            model, input_ids, cache=cache, cache_kwarg=cache_kwarg, attention_mask=torch.ones_like(input_ids),
            position_ids=positions, num_logits=1,
        )  # fmt: skip
        features = tap.take()
        prefixes = RowPrefixes(input_ids, torch.full((batch_size,), context_length, device=device), rows)
        draft_cache = head.new_draft_cache()

        def draft(num_new_rows: int) -> None:
            context = DraftContext(features[:, -num_new_rows:], positions[:, -num_new_rows:])
            draft_block(
                head, input_ids[:, -1], positions[:, -1] + 1, context, draft_cache, LogitsProcessorList(), prefixes,
                Sampling(greedy=True, seeds=torch.zeros_like(rows)),
            )  # fmt: skip

        draft(context_length)  # fills the draft cache; a round then adds about one context row
        draft_seconds = min(_timed(functools.partial(draft, 1)) for _ in range(repeats))
        num_drafts = head.config.num_draft_tokens
        verify_seconds = [
            min(_timed(functools.partial(verify, n)) for _ in range(repeats)) for n in range(num_drafts + 1)
        ]
    table = CostTable(
        num_tokens=tuple(batch_size * (1 + n) for n in range(num_drafts + 1)),
        verify_seconds=tuple(verify_seconds),
        draft_seconds=draft_seconds,
    )
    if path is not None:
        table.save(path)
    return table


def _timed(function: Callable[[], object]) -> float:
    """Wall seconds of one call (synchronising CUDA, so queued kernels are counted)."""
    start = time.perf_counter()
    function()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start
