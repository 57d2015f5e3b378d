"""Measuring a head: teacher-forced metrics on held-out documents, and online tau from real decoding.

Teacher-forced metrics (:func:`evaluate_teacher_forced`) use the same blocks and target pass as
training, without gradients, over every batch of a dataset in order. Online metrics
(:func:`evaluate_online`) run real speculative decoding through
:class:`~spark_generate.modeling.DSparkForCausalLM` on prompts and read the statistics the
generation loop records: accepted length tau (bonus token included) and the conditional
acceptance of every draft position.

Online numbers depend on how the prompts are decoded, so every :class:`DomainReport` carries its
:class:`DecodingSettings` (greedy or sampled, temperature, new tokens, seed, batch size and
schedule), and its JSON record says how it was measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from spark_generate.heads import DSparkHead
from spark_generate.modeling import DSparkForCausalLM
from spark_generate.schedule import FixedLength
from spark_generate.training.anchors import sample_anchors
from spark_generate.training.data import TokenDataset
from spark_generate.training.losses import LossWeights
from spark_generate.training.metrics import TeacherForcedMetrics
from spark_generate.training.trainer import BlockModel, teacher_forced_step

__all__ = [
    "DecodingSettings",
    "DomainReport",
    "OnlineMetrics",
    "evaluate_domain",
    "evaluate_online",
    "evaluate_teacher_forced",
    "plot_domains",
]


@dataclass(frozen=True)
class DecodingSettings:
    """How prompts are decoded to measure a head, and the one place the measuring defaults live.

    :func:`evaluate_online`, :func:`evaluate_domain`,
    :func:`~spark_generate.training.calibration.collect_calibration_data` and ``spark-generate``
    take their defaults from here, except greedy-or-sampled, which each states: evaluation
    defaults to greedy decoding, calibration to sampling.

    Measurements decode one prompt at a time and verify every draft of each block, so that tau and
    the per-position acceptance describe the head rather than a batch or a schedule; those two
    choices are fixed and recorded as :attr:`batch_size` and :attr:`schedule`.

    Attributes:
        do_sample: Sample (else greedy decoding).
        max_new_tokens: Tokens generated per prompt.
        temperature: Sampling temperature; unused by greedy decoding.
        seed: Sampling seed.
    """

    do_sample: bool
    max_new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    batch_size: ClassVar[int] = 1
    schedule: ClassVar[str] = "FixedLength() (every draft verified)"

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``generate()`` that carry these settings (the seed excepted)."""
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            kwargs["temperature"] = self.temperature
        return kwargs

    def to_dict(self) -> dict[str, object]:
        """The settings as a JSON record (``temperature`` is None for greedy decoding)."""
        return {
            "do_sample": self.do_sample,
            "temperature": self.temperature if self.do_sample else None,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "schedule": self.schedule,
        }

    @staticmethod
    def describe(record: dict[str, Any]) -> str:
        """One line for a model card from a record of :meth:`to_dict` (e.g. read from ``eval.json``)."""
        mode = f"sampling at temperature {record['temperature']:g}" if record["do_sample"] else "greedy decoding"
        return (
            f"{mode}, {record['max_new_tokens']} new tokens per prompt, seed {record['seed']}, "
            f"batch size {record['batch_size']}, schedule {record['schedule']}"
        )


@dataclass(frozen=True)
class OnlineMetrics:
    """Statistics of real speculative decoding over a set of prompts.

    Attributes:
        tau: Mean tokens emitted per target forward (accepted drafts plus the bonus token).
        acceptance_by_position: ``[S]`` conditional acceptance of each draft position.
        num_rounds: Speculative steps taken over all prompts.
        num_new_tokens: Tokens generated over all prompts.
    """

    tau: float
    acceptance_by_position: list[float]
    num_rounds: int
    num_new_tokens: int


@dataclass(frozen=True)
class DomainReport:
    """Speculative decoding against plain ``generate()`` on one prompt set, in the same run.

    Attributes:
        online: Statistics of the speculative run.
        tokens_per_second: New tokens per second with the head.
        baseline_tokens_per_second: New tokens per second of plain ``generate()``.
        decoding: How both runs decoded.
    """

    online: OnlineMetrics
    tokens_per_second: float
    baseline_tokens_per_second: float
    decoding: DecodingSettings

    @property
    def speedup(self) -> float:
        """Speculative over plain throughput."""
        return self.tokens_per_second / self.baseline_tokens_per_second

    def to_dict(self) -> dict[str, object]:
        """The report as the JSON record that ``spark-generate eval`` writes and ``card`` reads."""
        return {
            "tau": self.online.tau,
            "acceptance_by_position": self.online.acceptance_by_position,
            "num_rounds": self.online.num_rounds,
            "tokens_per_second": self.tokens_per_second,
            "baseline_tokens_per_second": self.baseline_tokens_per_second,
            "speedup": self.speedup,
            "decoding": self.decoding.to_dict(),
        }


@torch.no_grad()
def evaluate_teacher_forced(
    head: DSparkHead,
    target: PreTrainedModel,
    dataset: TokenDataset,
    *,
    num_anchors: int = 64,
    batch_size: int = 4,
    seed: int = 0,
) -> TeacherForcedMetrics:
    """Teacher-forced metrics of ``head`` over all documents of ``dataset``, in order.

    Args:
        head: The head (attached to ``target`` here).
        target: The frozen target.
        dataset: Held-out documents.
        num_anchors: Blocks per document (anchors drawn with ``seed``).
        batch_size: Documents per forward.
        seed: Fixes the anchors, so two heads are compared on the same blocks.
    """
    head.attach(target)
    dataset.check_vocab(head.config.target_vocab_size)
    was_training = head.training
    head.eval()
    model = BlockModel(head)
    device = head.fc.weight.device
    generator = torch.Generator().manual_seed(seed)
    total = None
    for start in range(0, len(dataset), batch_size):
        batch = dataset.batch(list(range(start, min(start + batch_size, len(dataset))))).to(device)
        anchors = sample_anchors(batch.loss_mask, num_anchors, generator)
        _, metrics = teacher_forced_step(model, target, head, batch, anchors, LossWeights())
        total = metrics if total is None else total + metrics
    head.train(was_training)
    return total


@torch.no_grad()
def evaluate_online(
    head: DSparkHead,
    target: PreTrainedModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = DecodingSettings.max_new_tokens,
    do_sample: bool = False,
    temperature: float = DecodingSettings.temperature,
    seed: int = DecodingSettings.seed,
    progress: str | None = None,
) -> OnlineMetrics:
    """Runs real speculative decoding on each prompt (batch 1, every draft verified) and pools its statistics.

    Args:
        head: The head.
        target: The target.
        prompts: Token ids of each prompt.
        max_new_tokens: Tokens to generate per prompt.
        do_sample: Sample instead of greedy decoding.
        temperature: Sampling temperature (unused when greedy).
        seed: Seed of the sampling.
        progress: Label of a tqdm progress bar over the prompts (on stderr); None shows no bar.
    """
    if not prompts:
        raise ValueError("prompts is empty; expected at least one prompt (a list of token ids).")
    settings = DecodingSettings(do_sample=do_sample, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    was_training = head.training
    head.eval()
    model = DSparkForCausalLM(target)
    device = head.fc.weight.device
    accepted = verified = None
    num_rounds = num_accepted = num_new_tokens = 0
    for prompt in tqdm(prompts, desc=progress, unit="prompt", disable=progress is None):
        output = model.generate(
            input_ids=torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            assistant=head,
            schedule=FixedLength(),
            seed=seed,
            return_dict_in_generate=True,
            **settings.generate_kwargs(),
        )
        stats = output.dspark_stats
        num_new_tokens += output.sequences.shape[1] - len(prompt)
        num_rounds += int(stats.num_rounds.sum())
        num_accepted += int(stats.num_accepted.sum())
        accepted = stats.accepted_by_position.sum(0) + (0 if accepted is None else accepted)
        verified = stats.verified_by_position.sum(0) + (0 if verified is None else verified)
    head.train(was_training)
    return OnlineMetrics(
        tau=(num_accepted + num_rounds) / max(num_rounds, 1),
        acceptance_by_position=(accepted / verified.clamp(min=1)).tolist(),
        num_rounds=num_rounds,
        num_new_tokens=num_new_tokens,
    )


@torch.no_grad()
def evaluate_domain(
    head: DSparkHead,
    target: PreTrainedModel,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = DecodingSettings.max_new_tokens,
    do_sample: bool = False,
    temperature: float = DecodingSettings.temperature,
    seed: int = DecodingSettings.seed,
    progress: str | None = None,
) -> DomainReport:
    """Times speculative decoding and plain ``generate()`` on the same prompts (batch 1 each).

    Args:
        head: The head.
        target: The target.
        prompts: Token ids of each prompt.
        max_new_tokens: Tokens to generate per prompt.
        do_sample: Sample instead of greedy decoding.
        temperature: Sampling temperature (unused when greedy).
        seed: Seed of the sampling.
        progress: Label of the tqdm progress bars of both runs (on stderr); None shows none.

    Returns:
        Both throughputs, the online statistics and the decoding settings.
    """
    settings = DecodingSettings(do_sample=do_sample, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    start = time.perf_counter()
    online = evaluate_online(
        head, target, prompts, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
        seed=seed, progress=None if progress is None else f"{progress}: DSpark",
    )  # fmt: skip
    speculative_seconds = time.perf_counter() - start
    device = head.fc.weight.device
    baseline_tokens = 0
    start = time.perf_counter()
    baseline_label = None if progress is None else f"{progress}: plain generate()"
    for prompt in tqdm(prompts, desc=baseline_label, unit="prompt", disable=progress is None):
        torch.manual_seed(seed)
        output = target.generate(
            input_ids=torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            **settings.generate_kwargs(),
        )
        baseline_tokens += output.shape[1] - len(prompt)
    baseline_seconds = time.perf_counter() - start
    return DomainReport(
        online, online.num_new_tokens / speculative_seconds, baseline_tokens / baseline_seconds, settings
    )


def plot_domains(reports: dict[str, DomainReport], path: str | Path) -> None:
    """Saves per-position acceptance curves and tau per prompt set as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curves, bars) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name, report in reports.items():
        positions = range(1, len(report.online.acceptance_by_position) + 1)
        curves.plot(positions, report.online.acceptance_by_position, marker="o", label=name)
    curves.set_xlabel("draft position")
    curves.set_ylabel("conditional acceptance")
    curves.set_ylim(0, 1)
    curves.legend()
    bars.bar(list(reports), [report.online.tau for report in reports.values()])
    bars.set_ylabel("tau (tokens per target forward)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
