"""Sequential temperature scaling (STS) of the confidence head (the DSpark paper, arXiv 2607.05147, §3.2.1).

The confidence ``c_k = σ(z_k)`` estimates whether draft ``k`` survives given that drafts ``< k``
did, so the probability that the prefix ``1..k`` survives is the cumulative product
``a_k = Π_{i≤k} σ(z_i / T_i)``. STS fits one temperature per position, in order: for ``k = 1..S``
a 1-D grid search picks the ``T_k`` minimizing the ECE of ``a_k`` against the observed prefix
survival, with ``T_1..T_{k-1}`` already fixed. Temperatures are order-preserving.

The observations come from real speculative decoding on held-out prompts
(:func:`collect_calibration_data`): each step's confidence logits (read through a schedule that
records them and verifies the whole block) and its number of accepted drafts (read through a
streamer: a step commits accepted drafts plus one token). Steps whose verification the
``max_new_tokens`` budget could have cut short are left out.

The grid spans ``[1/8, 8]``. A temperature that ends on either bound is a sign that the fit did
not succeed for that slot: too little data for it (few steps, or a prefix that almost always or
almost never survives), or confidences miscalibrated beyond what the grid covers; :func:`fit_sts`
then issues a :class:`CalibrationWarning` naming the slots.

The fitted temperatures are written as ``{"temperatures": [T_1, ..., T_S], ...}``, the file
:func:`spark_generate.schedule.load_calibration` reads, with the ECE before and after and the
decoding settings the observations were collected with.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from spark_generate.heads import DSparkHead
from spark_generate.modeling import DSparkForCausalLM
from spark_generate.training.evaluation import DecodingSettings

__all__ = [
    "CalibrationData",
    "CalibrationResult",
    "CalibrationWarning",
    "brier_score",
    "collect_calibration_data",
    "expected_calibration_error",
    "fit_sts",
    "plot_reliability",
]

NUM_BINS = 20
TEMPERATURE_GRID = torch.logspace(-3, 3, 97, base=2.0, dtype=torch.float64)  # 0.125 .. 8, includes 1


@dataclass(frozen=True)
class CalibrationData:
    """Observations of speculative steps.

    Attributes:
        confidence_logits: ``[R, S]`` float64 raw confidence logits of ``R`` steps.
        num_accepted: ``[R]`` int64 accepted drafts of each step.
    """

    confidence_logits: torch.Tensor
    num_accepted: torch.Tensor

    @property
    def survived(self) -> torch.Tensor:
        """``[R, S]`` bool: whether the prefix ``1..k`` was accepted."""
        slots = torch.arange(self.confidence_logits.shape[1])
        return slots[None] < self.num_accepted[:, None]


@dataclass(frozen=True)
class CalibrationResult:
    """Fitted STS temperatures, and the per-position ECE and Brier score of the cumulative confidences.

    Attributes:
        temperatures: ``[S]`` float64.
        ece_before: ``[S]`` with all temperatures 1.
        ece_after: ``[S]`` with the fitted temperatures.
        brier_before: ``[S]`` with all temperatures 1.
        brier_after: ``[S]`` with the fitted temperatures.
    """

    temperatures: torch.Tensor
    ece_before: torch.Tensor
    ece_after: torch.Tensor
    brier_before: torch.Tensor
    brier_after: torch.Tensor

    def save(self, path: str | Path, num_steps: int, decoding: DecodingSettings | None = None) -> None:
        """Writes the JSON :func:`~spark_generate.schedule.load_calibration` reads (plus the ECEs).

        Args:
            path: The JSON file to write.
            num_steps: Speculative steps the temperatures were fitted on.
            decoding: How the steps were decoded (recorded when given).
        """
        record = {
            "temperatures": self.temperatures.tolist(),
            "ece_before": self.ece_before.tolist(),
            "ece_after": self.ece_after.tolist(),
            "brier_before": self.brier_before.tolist(),
            "brier_after": self.brier_after.tolist(),
            "num_steps": num_steps,
            "method": f"sequential temperature scaling of cumulative confidences, {NUM_BINS}-bin ECE",
        }
        if decoding is not None:
            record["decoding"] = decoding.to_dict()
        Path(path).write_text(json.dumps(record, indent=2) + "\n")


def expected_calibration_error(probabilities: torch.Tensor, outcomes: torch.Tensor) -> float:
    """ECE with ``NUM_BINS`` equal-width bins: ``Σ_b (n_b / n) |mean p_b − mean y_b|``.

    Args:
        probabilities: ``[R]`` predicted probabilities.
        outcomes: ``[R]`` 0/1 outcomes.
    """
    bins = (probabilities * NUM_BINS).long().clamp(max=NUM_BINS - 1)
    predicted = torch.zeros(NUM_BINS, dtype=torch.float64).index_add_(0, bins, probabilities.double())
    observed = torch.zeros(NUM_BINS, dtype=torch.float64).index_add_(0, bins, outcomes.double())
    return float((predicted - observed).abs().sum() / max(len(probabilities), 1))


def brier_score(probabilities: torch.Tensor, outcomes: torch.Tensor) -> torch.Tensor:
    """Mean squared error of predicted probabilities against 0/1 outcomes, per column.

    Args:
        probabilities: ``[R, S]`` predicted probabilities.
        outcomes: ``[R, S]`` 0/1 outcomes.

    Returns:
        ``[S]`` float64 Brier scores.
    """
    return ((probabilities.double() - outcomes.double()) ** 2).mean(dim=0)


def _cumulative(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits / temperatures).cumprod(dim=-1)


class CalibrationWarning(UserWarning):
    """A fitted STS temperature lies on a bound of the search grid (see :func:`fit_sts`)."""


def _bound_warning(temperatures: torch.Tensor, survived: torch.Tensor) -> str | None:
    """The message naming the slots whose temperature lies on a grid bound, or None if there are none."""
    low, high = float(TEMPERATURE_GRID[0]), float(TEMPERATURE_GRID[-1])
    survivals = survived.sum(dim=0).tolist()
    parts = []
    for name, bound in (("lower", low), ("upper", high)):
        slots = [k for k, t in enumerate(temperatures.tolist()) if t == bound]
        if slots:
            numbers = ", ".join(str(k + 1) for k in slots)
            counts = ", ".join(str(survivals[k]) for k in slots)
            parts.append(
                f"slot{'s' if len(slots) > 1 else ''} {numbers} at the {name} bound T={bound:g} (prefix survived in "
                f"{counts} of {survived.shape[0]} steps)"
            )
    if not parts:
        return None
    return (
        f"STS temperatures on a bound of the grid [{low:g}, {high:g}]: {'; '.join(parts)}. The fit could not "
        "settle inside the grid for these slots: either there is too little data for them (few steps, or prefixes "
        "that almost never or almost always survive), or their confidences are miscalibrated beyond what the grid "
        "covers. Calibrate on more or longer held-out prompts; if a bound persists, train the confidence head longer."
    )


def fit_sts(data: CalibrationData) -> CalibrationResult:
    """Fits per-position temperatures sequentially on the cumulative product (see the module docstring).

    Raises:
        ValueError: If ``data`` holds no steps.

    Warns:
        CalibrationWarning: If a fitted temperature lies on a bound of the search grid.
    """
    logits, survived = data.confidence_logits.double(), data.survived
    if logits.shape[0] == 0:
        raise ValueError("no speculative steps to calibrate on; give more or longer held-out prompts.")
    num_slots = logits.shape[1]
    temperatures = torch.ones(num_slots, dtype=torch.float64)
    before = _cumulative(logits, temperatures)
    ece_before = torch.tensor([expected_calibration_error(before[:, k], survived[:, k]) for k in range(num_slots)])
    for k in range(num_slots):
        prefix = torch.sigmoid(logits[:, :k] / temperatures[:k]).prod(dim=-1)  # [R]
        errors = [
            expected_calibration_error(prefix * torch.sigmoid(logits[:, k] / t), survived[:, k])
            for t in TEMPERATURE_GRID
        ]
        temperatures[k] = TEMPERATURE_GRID[int(torch.tensor(errors).argmin())]
    message = _bound_warning(temperatures, survived)
    if message is not None:
        warnings.warn(message, CalibrationWarning, stacklevel=2)
    after = _cumulative(logits, temperatures)
    ece_after = torch.tensor([expected_calibration_error(after[:, k], survived[:, k]) for k in range(num_slots)])
    return CalibrationResult(
        temperatures, ece_before, ece_after, brier_score(before, survived), brier_score(after, survived)
    )


class _RecordingSchedule:
    """A schedule that verifies the whole block and keeps each step's ``[1, S]`` confidence logits."""

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] = []

    def __call__(self, confidence_logits: torch.Tensor | None, batch_size: int, num_draft_tokens: int) -> torch.Tensor:
        if confidence_logits is None:
            raise ValueError("the head has no confidence head: there is nothing to calibrate.")
        self.logits.append(confidence_logits.detach().double().cpu())
        return torch.full((batch_size,), num_draft_tokens, dtype=torch.int64)


class _ChunkCounter(BaseStreamer):
    """A streamer that keeps the size of each committed chunk (the first put is the prompt)."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.sizes.append(value.numel())
        self._prompt_seen = True

    def end(self) -> None:
        """Nothing to flush."""


@torch.no_grad()
def collect_calibration_data(
    head: DSparkHead,
    target: PreTrainedModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = DecodingSettings.max_new_tokens,
    do_sample: bool = True,
    temperature: float = DecodingSettings.temperature,
    seed: int = DecodingSettings.seed,
    progress: str | None = None,
) -> CalibrationData:
    """Runs real speculative decoding (full blocks, batch 1) on each prompt and records every step.

    Calibrate with the decoding the head will serve: the confidences estimate acceptance under it.

    Args:
        head: A head with a confidence head.
        target: The target.
        prompts: Token ids of each held-out prompt.
        max_new_tokens: Tokens per prompt.
        do_sample: Sample (else decode greedily).
        temperature: Sampling temperature (unused when greedy).
        seed: Sampling seed; prompt ``i`` samples with ``DecodingSettings.prompt_seed(i)``.
        progress: Label of a tqdm progress bar over the prompts (on stderr); None shows no bar.
    """
    if not prompts:
        raise ValueError("prompts is empty; expected held-out prompts (lists of token ids) to calibrate on.")
    model = DSparkForCausalLM(target)
    device = head.fc.weight.device
    num_slots = head.config.num_draft_tokens
    settings = DecodingSettings(do_sample=do_sample, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    logits, accepted = [], []
    for index, prompt in enumerate(tqdm(prompts, desc=progress, unit="prompt", disable=progress is None)):
        schedule, counter = _RecordingSchedule(), _ChunkCounter()
        # Each prompt samples with its own seed: one seed for all would give prompts of equal
        # length the same uniforms at every position, and correlated acceptances.
        model.generate(
            input_ids=torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            assistant=head, schedule=schedule, streamer=counter, seed=settings.prompt_seed(index),
            **settings.generate_kwargs(),
        )  # fmt: skip
        generated = 0
        for step_logits, size in zip(schedule.logits, counter.sizes, strict=False):
            if generated + num_slots + 1 <= max_new_tokens:  # the budget could not cut this step short
                logits.append(step_logits[0])
                accepted.append(size - 1)
            generated += size
    return CalibrationData(
        torch.stack(logits) if logits else torch.zeros(0, num_slots, dtype=torch.float64),
        torch.tensor(accepted, dtype=torch.long),
    )


def plot_reliability(data: CalibrationData, result: CalibrationResult, path: str | Path) -> None:
    """Saves a reliability diagram of the cumulative confidences, before and after STS, per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_slots = data.confidence_logits.shape[1]
    figure, axes = plt.subplots(1, num_slots, figsize=(3 * num_slots, 3), squeeze=False)
    survived = data.survived
    for k, axis in enumerate(axes[0]):
        for label, temperatures in (("raw", torch.ones(num_slots, dtype=torch.float64)), ("STS", result.temperatures)):
            confidence = _cumulative(data.confidence_logits.double(), temperatures)[:, k]
            bins = (confidence * 10).long().clamp(max=9)
            centers, rates = [], []
            for b in range(10):
                chosen = bins == b
                if chosen.any():
                    centers.append(float(confidence[chosen].mean()))
                    rates.append(float(survived[chosen, k].double().mean()))
            axis.plot(centers, rates, marker="o", label=label)
        axis.plot([0, 1], [0, 1], color="grey", linestyle=":")
        axis.set_title(f"prefix 1..{k + 1}: ECE {result.ece_before[k]:.3f} → {result.ece_after[k]:.3f}", fontsize=8)
        axis.set_xlabel("cumulative confidence")
    axes[0][0].set_ylabel("observed prefix survival")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
