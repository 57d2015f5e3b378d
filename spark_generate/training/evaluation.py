"""Measuring a head: teacher-forced metrics on held-out documents, and online tau from real decoding.

Teacher-forced metrics (:func:`evaluate_teacher_forced`) use the same blocks and target pass as
training, without gradients, over every batch of a dataset in order. Online metrics
(:func:`evaluate_online`) run real speculative decoding through
:class:`~spark_generate.modeling.DSparkForCausalLM` on prompts and read the statistics the
generation loop records: accepted length tau (bonus token included) and the acceptance rate of
every draft position (the fraction of blocks verifying draft ``k`` that accept it, after all earlier
drafts).

**Which teacher-forced number predicts online tau.** ``TeacherForcedMetrics.tau`` is the mean over
blocks of the accepted length expected when *sampling at temperature 1* (``1 − TV`` per slot); it is
neither greedy (on a nearly flat random target it is near its maximum while greedy decoding accepts
almost nothing: 5.8 against 1.05 for the same untrained head) nor tokens per round along a decoding path (see
:mod:`~spark_generate.training.metrics`). :func:`evaluate_teacher_forced_decoding` is the number to
compare with online tau: it runs the head teacher-forced at *every* answer position of held-out
documents, with the acceptance definition of the decoding it stands for (greedy argmax agreement,
or ``Σ min(p, q)`` of the temperature-scaled distributions over the target's full vocabulary), and
walks the blocks as decoding does (:func:`~spark_generate.training.metrics.decoding_walk`). On the
target's own greedy answers (``regenerate --greedy``) its greedy tau is online greedy tau on those
prompts, up to argmax ties that float rounding breaks differently in the two passes.

Online numbers depend on how the prompts are decoded, so every :class:`DomainReport` carries its
:class:`DecodingSettings` (greedy or sampled, temperature, new tokens, seed, batch size and
schedule); speeds also depend on the machine, so it carries where it was measured too
(:func:`measurement_environment`: hardware, device, thread count, dtype, versions and commit), and
its JSON record says both. Sampling is temperature sampling only (no top-k or top-p from the
model's generation config or ``generate()``'s defaults), and each prompt samples with its own seed
drawn from the recorded one (:meth:`DecodingSettings.prompt_seed`).
"""

from __future__ import annotations

import platform
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
from spark_generate.training.anchors import AnchorBatch, block_targets, sample_anchors
from spark_generate.training.data import TokenDataset
from spark_generate.training.feature_cache import target_states
from spark_generate.training.losses import LossWeights
from spark_generate.training.metrics import DecodingWalk, TeacherForcedMetrics, decoding_walk
from spark_generate.training.provenance import git_commit, package_versions
from spark_generate.training.trainer import BlockModel, teacher_forced_step

__all__ = [
    "DecodingSettings",
    "DomainReport",
    "OnlineMetrics",
    "evaluate_domain",
    "evaluate_online",
    "evaluate_teacher_forced",
    "evaluate_teacher_forced_decoding",
    "measurement_environment",
    "plot_domains",
    "plot_history",
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
    choices are fixed and recorded as :attr:`batch_size` and :attr:`schedule`. Sampling is plain
    temperature sampling over the whole vocabulary, as recorded: :meth:`generate_kwargs` turns off
    the top-k and top-p that ``generate()`` would otherwise take from the target's generation config
    or its own default (``top_k=50``), which would truncate both the target's and the draft's
    distributions and make the measurement depend on the model's config.

    Attributes:
        do_sample: Sample (else greedy decoding).
        max_new_tokens: Tokens generated per prompt.
        temperature: Sampling temperature; unused by greedy decoding.
        seed: Sampling seed; prompt ``i`` samples with its own seed :meth:`prompt_seed` ``(i)``.
    """

    do_sample: bool
    max_new_tokens: int = 128
    temperature: float = 1.0
    seed: int = 0
    batch_size: ClassVar[int] = 1
    schedule: ClassVar[str] = "FixedLength() (every draft verified)"

    def prompt_seed(self, index: int) -> int:
        """The seed prompt ``index`` samples with, drawn from :attr:`seed` and the index.

        Draws are keyed by seed and absolute position, so one seed for every prompt would give
        prompts of equal length the same acceptance uniforms at every position: their acceptances
        would be strongly correlated and a measured rate far noisier than its count suggests.
        """
        return ((self.seed * 1_000_003 + index) * 1_000_033) % 2**63

    def generate_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``generate()`` that carry these settings (the seed excepted)."""
        kwargs: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "do_sample": self.do_sample}
        if self.do_sample:
            kwargs.update(temperature=self.temperature, top_k=0, top_p=1.0)  # no truncation (class docstring)
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
        acceptance_by_position: ``[S]`` acceptance rate of each draft position: among the blocks that
            verify draft ``k``, the fraction that accept it (and so every earlier draft).
        num_rounds: Speculative steps taken over all prompts.
        num_new_tokens: Tokens generated over all prompts.
    """

    tau: float
    acceptance_by_position: list[float]
    num_rounds: int
    num_new_tokens: int


def _hardware_name(device: torch.device) -> str:
    """The GPU's name for a CUDA device, else the CPU's model name (``/proc/cpuinfo``, or ``platform``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def measurement_environment(target: PreTrainedModel) -> dict[str, object]:
    """Where a speed was measured: hardware, device, torch threads, the target's dtype, versions and commit.

    Args:
        target: The target; its first parameter's device and dtype are recorded.

    Returns:
        ``hardware`` (GPU or CPU model), ``device``, ``num_threads`` (``torch.get_num_threads()``),
        ``dtype``, ``versions`` (Python and the packages that shape the numbers, see
        :func:`~spark_generate.training.provenance.package_versions`) and ``git_commit`` (None
        outside a git checkout).
    """
    parameter = next(target.parameters())
    return {
        "hardware": _hardware_name(parameter.device),
        "device": str(parameter.device),
        "num_threads": torch.get_num_threads(),
        "dtype": str(parameter.dtype).removeprefix("torch."),
        "versions": package_versions(),
        "git_commit": git_commit(),
    }


@dataclass(frozen=True)
class DomainReport:
    """Speculative decoding against plain ``generate()`` on one prompt set, in the same run.

    Attributes:
        online: Statistics of the speculative run.
        tokens_per_second: New tokens per second with the head.
        baseline_tokens_per_second: New tokens per second of plain ``generate()``.
        decoding: How both runs decoded.
        environment: Where both ran (:func:`measurement_environment`).
    """

    online: OnlineMetrics
    tokens_per_second: float
    baseline_tokens_per_second: float
    decoding: DecodingSettings
    environment: dict[str, object]

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
            "environment": self.environment,
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

    These are means over blocks at random anchors (``tau`` for sampling at temperature 1); to
    predict online tau use :func:`evaluate_teacher_forced_decoding`.

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


def _answer_start(loss_mask: tuple[int, ...]) -> int:
    """Index of a document's first answer token: its first loss-masked token, after at least one prompt token."""
    first = next((index for index, flag in enumerate(loss_mask) if flag), len(loss_mask))
    return max(first, 1)


def _target_logits(target: PreTrainedModel, final_hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's float32 logits over its full vocabulary at ``positions`` ``[1, N, S]`` of ``final_hidden``."""
    logits = target.get_output_embeddings()(final_hidden[0, positions.flatten()]).float()
    softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    if softcap is not None:  # the target's forward caps its logits (Gemma)
        logits = torch.tanh(logits / softcap) * softcap
    return logits.reshape(*positions.shape, -1)


@torch.no_grad()
def evaluate_teacher_forced_decoding(
    head: DSparkHead,
    target: PreTrainedModel,
    dataset: TokenDataset,
    *,
    do_sample: bool = False,
    temperature: float = DecodingSettings.temperature,
    anchors_per_pass: int = 16,
) -> DecodingWalk:
    """Online tau predicted from one teacher-forced pass per document: blocks at every answer position, walked.

    Each document is a prompt (tokens before the first loss-masked one) and its answer (the rest).
    The head drafts a block at every answer position, teacher-forced on the document; each slot's
    acceptance is what verification would decide there: for greedy decoding whether the draft's
    argmax (mapped to a target id) is the target's argmax over its full vocabulary; for sampling
    ``Σ_v min(p(v), q(v))`` with both distributions at ``temperature`` and the draft's reduced
    vocabulary placed in the target's (no renormalization: target mass outside the draft vocabulary
    is never accepted). The blocks are then walked as decoding with every draft verified does, with
    ``max_new_tokens`` the answer's length (:func:`~spark_generate.training.metrics.decoding_walk`).

    The result compares with :func:`evaluate_online` on the documents' prompts (``max_new_tokens`` the
    answers' length, same ``do_sample`` and ``temperature``). It is exact for greedy decoding when the
    answers are the target's own greedy continuations (decoding then visits exactly these contexts),
    up to argmax near-ties that the two computations round differently; for sampling, and for answers
    the target did not write, it is an estimate along the documents' tokens.

    Args:
        head: The head (attached to ``target`` here).
        target: The frozen target.
        dataset: Held-out documents, ideally regenerated by ``target``.
        do_sample: The acceptance of sampling (else greedy).
        temperature: Sampling temperature (unused when greedy).
        anchors_per_pass: Blocks per head pass (bounds memory: ``anchors_per_pass × S × V`` logits).

    Returns:
        The expected rounds and per-position counts, summed over documents; ``tau`` and
        ``acceptance_by_position`` read as :class:`OnlineMetrics`'.
    """
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature={temperature}: expected a positive sampling temperature.")
    if anchors_per_pass < 1:
        raise ValueError(f"anchors_per_pass={anchors_per_pass}: expected at least 1 block per pass.")
    head.attach(target)
    dataset.check_vocab(head.config.target_vocab_size)
    was_training = head.training
    head.eval()
    model = BlockModel(head)
    config = head.config
    device = head.fc.weight.device
    num_slots = config.num_draft_tokens
    zeros = torch.zeros(num_slots, dtype=torch.float64)
    total = DecodingWalk(0.0, zeros, zeros, 0)
    for index in range(len(dataset)):
        sequence, loss_mask = dataset.sequences[index], dataset.loss_masks[index]
        start = _answer_start(loss_mask)
        if len(sequence) - start < 2:  # no round to take: the prefill's token is the whole answer
            continue
        input_ids = torch.tensor([sequence], device=device)
        states = target_states(target, list(config.target_layer_ids), input_ids, torch.ones_like(input_ids), device)
        acceptance = []
        for first in range(start, len(sequence) - 1, anchors_per_pass):
            positions = torch.arange(first, min(first + anchors_per_pass, len(sequence) - 1), device=device)[None]
            anchors = AnchorBatch(positions, torch.ones_like(positions, dtype=torch.bool))
            blocks = block_targets(
                input_ids, torch.ones_like(input_ids), anchors, block_size=config.block_size,
                num_draft_tokens=num_slots, mask_token_id=config.mask_token_id,
            )  # fmt: skip
            draft_logits, _ = model(blocks.block_input_ids, anchors.positions, states.features, blocks.prev_ids)
            target_logits = _target_logits(target, states.final_hidden, blocks.logit_positions)
            draft_logits = draft_logits.float()
            if do_sample:
                p = torch.softmax(target_logits / temperature, dim=-1)
                q = torch.softmax(draft_logits / temperature, dim=-1)
                draft_ids = torch.arange(q.shape[-1], device=device)
                p_on_draft = p[..., head.draft_to_target_ids(draft_ids)]  # the target's mass on the draft's tokens
                slot_acceptance = torch.minimum(p_on_draft, q).sum(-1)
            else:
                drafted = head.draft_to_target_ids(draft_logits.argmax(-1))
                slot_acceptance = (drafted == target_logits.argmax(-1)).double()
            acceptance.append(slot_acceptance[0].double().cpu())
        total = total + decoding_walk(torch.cat(acceptance))
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
        seed: Seed of the sampling (prompt ``i`` samples with ``DecodingSettings.prompt_seed(i)``).
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
    for index, prompt in enumerate(tqdm(prompts, desc=progress, unit="prompt", disable=progress is None)):
        output = model.generate(
            input_ids=torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            assistant=head,
            schedule=FixedLength(),
            seed=settings.prompt_seed(index),
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
        Both throughputs, the online statistics, the decoding settings and the machine.
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
    for index, prompt in enumerate(tqdm(prompts, desc=baseline_label, unit="prompt", disable=progress is None)):
        torch.manual_seed(settings.prompt_seed(index))
        output = target.generate(
            input_ids=torch.tensor([prompt], device=device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
            **settings.generate_kwargs(),
        )
        baseline_tokens += output.shape[1] - len(prompt)
    baseline_seconds = time.perf_counter() - start
    return DomainReport(
        online,
        online.num_new_tokens / speculative_seconds,
        baseline_tokens / baseline_seconds,
        settings,
        measurement_environment(target),
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
    curves.set_ylabel("acceptance rate")
    curves.set_ylim(0, 1)
    curves.legend()
    bars.bar(list(reports), [report.online.tau for report in reports.values()])
    bars.set_ylabel("tau (tokens per target forward)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def plot_history(history: list[dict[str, float]], path: str | Path, window: int = 50) -> None:
    """Saves a training run's learning curve (``history.json`` of its checkpoint) as a PNG.

    Args:
        history: Per-step records of :class:`~spark_generate.training.Trainer`.
        path: Where the PNG goes.
        window: Steps in the trailing moving average (each step's metrics come from one small
            training batch, so single steps are noisy).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [record["step"] for record in history]

    def smoothed(key: str) -> list[float]:
        values = torch.tensor([record[key] for record in history], dtype=torch.float64)
        sums = torch.cat([torch.zeros(1, dtype=torch.float64), values.cumsum(0)])
        ends = torch.arange(1, len(values) + 1)
        starts = (ends - window).clamp(min=0)
        return ((sums[ends] - sums[starts]) / (ends - starts)).tolist()

    figure, (loss, quality) = plt.subplots(1, 2, figsize=(9, 3.5))
    loss.plot(steps, smoothed("loss"))
    loss.set_xlabel("optimizer step")
    loss.set_ylabel(f"training loss ({window}-step mean)")
    quality.plot(steps, smoothed("first_slot_greedy_accuracy"), label="first-slot greedy accuracy")
    quality.plot(steps, smoothed("first_slot_acceptance"), label="first-slot acceptance (1 - TV)")
    quality.set_xlabel("optimizer step")
    quality.set_ylim(0, 1)
    tau = quality.twinx()
    tau.plot(steps, smoothed("greedy_tau"), color="tab:red", label="greedy tau")
    tau.set_ylabel("greedy tau (teacher-forced)")
    handles = quality.get_legend_handles_labels()[0] + tau.get_legend_handles_labels()[0]
    quality.legend(handles=handles, loc="upper left", fontsize="small")
    figure.suptitle("teacher-forced metrics on the training batches")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
