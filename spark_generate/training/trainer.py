"""Training a DSpark head against a frozen target, in one process or many (Accelerate).

One optimizer step reads, top to bottom::

    for each of `gradient_accumulation_steps` micro-batches:
        batch   = dataset.batch(dataset.batch_indices(micro_step, ...))   # order = f(seed, epoch)
        anchors = sample_anchors(batch.loss_mask, num_anchors, rng(seed, process, micro_step))
        states  = target forward (tap-layer features, final hidden state), or the feature cache's
        blocks  = block_targets(...)                                     # inputs, labels, prefix masks
        target  : frozen LM head on the final hidden state, only at the positions that supervise a slot
        head    : one parallel pass over all blocks, Markov + confidence teacher-forced
        loss    = dspark_loss(...) / gradient_accumulation_steps ; backward
    clip gradients ; AdamW step ; warmup + cosine schedule step

By default the target runs inside the trainer, on every batch. With a
:class:`~spark_generate.training.feature_cache.FeatureCache` (built once by ``build_feature_cache``)
its tapped features and final hidden states are read from disk instead, in bfloat16, and only the
head and the target's LM head run. Either way the target's logits are computed with its frozen LM
head only at the (distinct) positions that supervise a slot. Trainable: ``fc``, ``hidden_norm``, the
draft layers, the final ``norm``, the Markov and confidence heads; the target, its embedding and
LM head (and a reduced-vocabulary copy of it) stay frozen.

Every random choice is a pure function of ``(seed, process, step)``: the batch order and the
anchors. A checkpoint therefore needs only the head, the optimizer, the scheduler and the step to
resume bit for bit. Checkpoints are written to a temporary folder and renamed into place, so a
crash never leaves a partial ``checkpoint-*`` folder; each carries ``provenance.json``.
The same script runs unchanged under ``accelerate launch`` (the head is wrapped for DDP; each
process takes its own shard of every batch order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from spark_generate.heads import DSparkHead
from spark_generate.training.anchors import AnchorBatch, block_targets, sample_anchors
from spark_generate.training.data import TokenBatch, TokenDataset
from spark_generate.training.feature_cache import (
    FeatureCache,
    FeatureCacheError,
    TargetStates,
    data_fingerprint,
    target_states,
)
from spark_generate.training.losses import DIVERGENCE_CHOICES, LossTerms, LossWeights, dspark_loss
from spark_generate.training.metrics import TeacherForcedMetrics, teacher_forced_metrics
from spark_generate.training.provenance import git_commit, package_versions, target_identity

__all__ = ["BlockModel", "TrainResult", "Trainer", "TrainingConfig", "teacher_forced_step"]

TRAINER_STATE = "trainer_state.pt"
PROVENANCE = "provenance.json"
HISTORY = "history.json"


@dataclass(frozen=True)
class TrainingConfig:
    """Settings of a training run; the one place their defaults live, which follow DeepSpec's DSpark recipe.

    Attributes:
        output_dir: Where ``checkpoint-{step}`` folders go.
        num_steps: Optimizer steps.
        batch_size: Documents per micro-batch and process.
        gradient_accumulation_steps: Micro-batches per optimizer step.
        learning_rate: Peak AdamW learning rate.
        warmup_ratio: Fraction of the steps with a linear warmup; a cosine decay to 0 follows.
        weight_decay: AdamW weight decay.
        max_grad_norm: Gradient clipping norm.
        num_anchors: Blocks per document and micro-batch.
        mixed_precision: ``"no"`` (float32) or ``"bf16"`` (autocast, float32 master weights).
        seed: Fixes the batch order and the anchors.
        save_every: Write a checkpoint every this many steps (0: only at the end).
        save_total_limit: Keep only this many of the newest checkpoints (None: keep every one).
        loss_weights: The objective's coefficients.
        compile_loss: Run the objective through ``torch.compile``, which fuses its passes over the
            ``[B, N, S, V_d]`` logits (on 2 CPU cores and SmolLM2's 8 x 32 blocks of a 8,192-token
            vocabulary, about 0.3 s of a 1.7 s step). Changes float32 rounding only; needs a C++
            compiler on a CPU, and costs a compilation (~30 s) per process.
        progress: Show a tqdm bar with the loss and the teacher-forced metrics.
    """

    output_dir: str
    num_steps: int
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    num_anchors: int = 512
    mixed_precision: str = "no"
    seed: int = 0
    save_every: int = 0
    save_total_limit: int | None = None
    loss_weights: LossWeights = dataclasses.field(default_factory=LossWeights)
    compile_loss: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_size", "gradient_accumulation_steps", "num_anchors"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: expected a positive integer.")
        if self.save_total_limit is not None and self.save_total_limit < 1:
            raise ValueError(
                f"save_total_limit={self.save_total_limit}: expected a positive number of checkpoints to keep, "
                "or None to keep every one."
            )
        if self.mixed_precision not in ("no", "bf16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: expected 'no' (float32) or 'bf16'.")


@dataclass(frozen=True)
class TrainResult:
    """What :meth:`Trainer.train` returns.

    Attributes:
        checkpoint: The last checkpoint folder.
        loss: Loss of the last optimizer step (mean over its micro-batches).
        metrics: Teacher-forced metrics accumulated over the last optimizer step.
    """

    checkpoint: Path
    loss: float
    metrics: TeacherForcedMetrics


class BlockModel(nn.Module):
    """The head's trainable computation as one ``forward``, so DDP sees every parameter used."""

    def __init__(self, head: DSparkHead):
        super().__init__()
        self.head = head

    def forward(
        self, block_input_ids: torch.Tensor, anchor_positions: torch.Tensor, features: torch.Tensor,
        prev_ids: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Blocks ``[B, N, K]`` over features ``[B, T, m·H]`` -> draft ``[B, N, S, V_d]``, confidence ``[B, N, S]``."""
        positions = torch.arange(features.shape[1], device=features.device).expand(features.shape[0], -1)
        backbone = self.head(block_input_ids, anchor_positions, features, context_position_ids=positions)
        block = self.head.teacher_forced(
            backbone.base_logits, backbone.draft_hidden, prev_ids, markov_state=backbone.markov_state
        )
        return block.draft_logits, block.confidence_logits


def _supervising_logits(
    target: PreTrainedModel, head: DSparkHead, final_hidden: torch.Tensor, logit_positions: torch.Tensor
) -> torch.Tensor:
    """The frozen LM head at the supervising positions: ``[B, N, S, V_d]`` float32 target logits.

    Args:
        target: The frozen target (its LM head and soft-cap).
        head: The head, for its draft vocabulary.
        final_hidden: ``[B, T, H]`` the target's final-normed hidden states.
        logit_positions: ``[B, N, S]`` the position supervising each slot.

    Blocks overlap (slot ``k`` of the block at ``p`` and slot ``k - 1`` of the block at ``p + 1``
    read the same position), so the LM head runs once per distinct (row, position). With a reduced
    draft vocabulary only its rows of the LM head are multiplied (6x fewer FLOPs at 8k of 49k: most
    of a CPU training step otherwise); each logit is the same dot product either way.
    """
    with torch.no_grad():
        rows = torch.arange(final_hidden.shape[0], device=logit_positions.device)[:, None, None]
        distinct, inverse = torch.unique(rows * final_hidden.shape[1] + logit_positions, return_inverse=True)
        lm_head = target.get_output_embeddings()
        weight, bias = lm_head.weight, lm_head.bias
        if head.has_reduced_vocab:
            weight, bias = weight[head.t2d], None if bias is None else bias[head.t2d]
        logits = F.linear(final_hidden.flatten(0, 1)[distinct], weight, bias).float()
        # The target's forward soft-caps its logits (Gemma); the draft head's logits are never capped.
        softcap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
    return logits[inverse]


def teacher_forced_step(
    model: nn.Module,
    target: PreTrainedModel,
    head: DSparkHead,
    batch: TokenBatch,
    anchors: AnchorBatch,
    weights: LossWeights,
    states: TargetStates | None = None,
    loss: Callable[..., LossTerms] = dspark_loss,
) -> tuple[LossTerms, TeacherForcedMetrics]:
    """Loss and metrics of one batch of documents, teacher-forced (training and evaluation).

    Args:
        model: The head's block computation (the head wrapped by :class:`Trainer`, possibly DDP).
        target: The frozen target.
        head: The (unwrapped) head, for its config and vocabulary maps.
        batch: Documents.
        anchors: From :func:`sample_anchors`.
        weights: The objective's coefficients.
        states: The target's states of ``batch`` (from a :class:`FeatureCache`); None runs the target.
        loss: :func:`dspark_loss`, or a compiled version of it.
    """
    config = head.config
    blocks = block_targets(
        batch.input_ids,
        batch.loss_mask,
        anchors,
        block_size=config.block_size,
        num_draft_tokens=config.num_draft_tokens,
        mask_token_id=config.mask_token_id,
    )
    if states is None:
        layer_ids = list(config.target_layer_ids)
        states = target_states(target, layer_ids, batch.input_ids, batch.attention_mask, batch.input_ids.device)
    target_logits = _supervising_logits(target, head, states.final_hidden, blocks.logit_positions)
    draft_logits, confidence_logits = model(
        blocks.block_input_ids, anchors.positions, states.features, blocks.prev_ids
    )
    labels = head.target_to_draft_ids(blocks.label_ids)
    terms = loss(draft_logits, confidence_logits, target_logits, labels, blocks.slot_mask, weights)
    metrics = teacher_forced_metrics(
        terms.acceptance, draft_logits, target_logits, confidence_logits, blocks.slot_mask
    )
    return terms, metrics


def _check_cache(cache: FeatureCache, target_sha256: str, head: DSparkHead, dataset: TokenDataset) -> None:
    """Raises FeatureCacheError unless ``cache`` holds this target's states, at the head's taps, of these documents."""
    problems = []
    if cache.target_sha256 != target_sha256:
        problems.append(f"target weights SHA-256 {cache.target_sha256}, the target's is {target_sha256}")
    if cache.layer_ids != list(head.config.target_layer_ids):
        problems.append(f"tap layer ids {cache.layer_ids}, the head reads {list(head.config.target_layer_ids)}")
    if cache.data_sha256 != data_fingerprint(dataset):
        problems.append(f"documents of SHA-256 {cache.data_sha256}, not those of {dataset.description}")
    if problems:
        raise FeatureCacheError(
            f"the feature cache {', '.join(map(str, cache.paths))} does not serve this run: it has "
            f"{'; '.join(problems)}. Open the cache with this run's target, head taps and dataset, or build one "
            "for them."
        )


def _reparametrized(head: DSparkHead) -> dict[str, torch.Tensor]:
    """The head's parametrisation entries (``fc``'s ``W`` and feature scale), which a saved head folds."""
    return {name: tensor for name, tensor in head.state_dict().items() if ".parametrizations." in name}


def _history_record(step: int, loss: float, learning_rate: float, metrics: TeacherForcedMetrics) -> dict[str, float]:
    """One optimizer step of the learning curve (metrics of the step's own training batch)."""
    return {
        "step": step,
        "loss": round(loss, 6),
        "learning_rate": learning_rate,
        "tau": round(metrics.tau, 6),
        "greedy_tau": round(metrics.greedy_tau, 6),
        "first_slot_greedy_accuracy": round(float(metrics.greedy_accuracy[0]), 6),
        "first_slot_acceptance": round(float(metrics.acceptance[0]), 6),
    }


def _all_past(deadline: float, accelerator: Accelerator) -> bool:
    """Whether any process is past ``deadline``: every process gets the same answer, so they stop together."""
    past = time.monotonic() > deadline
    if accelerator.num_processes == 1:
        return past
    return bool(accelerator.reduce(torch.tensor([float(past)], device=accelerator.device), reduction="max").item())


def anchor_generator(seed: int, process_index: int, micro_step: int) -> torch.Generator:
    """The CPU generator that draws the anchors of one micro-batch of one process."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + process_index) * 1_000_033 + micro_step) % 2**63)


def _schedule(num_steps: int, warmup_ratio: float) -> Callable[[int], float]:
    """Learning-rate factor of each step: linear warmup, then cosine decay to 0."""
    warmup = max(1, round(num_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, num_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return factor


class Trainer:
    """Trains a head attached to a frozen target on tokenized documents.

    Args:
        head: The head to train (attached to ``target`` here; its weights change in place).
        target: The target; frozen and put in eval mode.
        dataset: Training documents, tokenized with the target's tokenizer.
        config: Training settings.
        accelerator: Default: a new ``Accelerator`` (which reads ``accelerate launch`` settings).
        feature_cache: The target's states of ``dataset``, read instead of running the target
            (see :mod:`~spark_generate.training.feature_cache`). None: the target runs on every batch.

    Every checkpoint holds ``history.json``: one record per optimizer step since step 0 (loss,
    learning rate and the step's teacher-forced metrics on its training batch), the learning curve
    of the run however many sessions it took (:func:`spark_generate.training.evaluation.plot_history`).

    Raises:
        DSparkConfigError: If the head does not fit the target.
        ValueError: If the data holds ids outside the target's vocabulary, or ``output_dir`` is
            not writable.
        FeatureCacheError: If ``feature_cache`` was built for another target, other taps or other
            documents.
    """

    def __init__(
        self,
        head: DSparkHead,
        target: PreTrainedModel,
        dataset: TokenDataset,
        config: TrainingConfig,
        accelerator: Accelerator | None = None,
        feature_cache: FeatureCache | None = None,
    ):
        head.attach(target)
        dataset.check_vocab(head.config.target_vocab_size)
        self.config = config
        self.output_dir = Path(config.output_dir)
        try:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            probe = self.output_dir / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as error:
            raise ValueError(
                f"output_dir={str(self.output_dir)!r} is not a writable folder ({error.strerror}); "
                "choose a folder you can write to."
            ) from error
        self.accelerator = accelerator or Accelerator(mixed_precision=config.mixed_precision)
        self.head = head
        self.target = target.requires_grad_(False).eval()
        if getattr(target, "hf_device_map", None) is None:  # a target split by device_map stays where it is
            self.target.to(self.accelerator.device)
        self.dataset = dataset
        head.train()
        trainable = [parameter for parameter in head.parameters() if parameter.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(config.num_steps, config.warmup_ratio))
        self.model, self.optimizer = self.accelerator.prepare(BlockModel(head), optimizer)
        self.trainable = trainable
        self._target_identity = target_identity(target)
        if feature_cache is not None:
            _check_cache(feature_cache, self._target_identity["weights_sha256"], head, dataset)
        self.feature_cache = feature_cache
        self.loss = torch.compile(dspark_loss) if config.compile_loss else dspark_loss
        self.history: list[dict[str, float]] = []
        self.warm_start: dict | None = None  # {"checkpoint", "step"} of a run started from another's weights

    def train(
        self,
        resume_from: str | os.PathLike | None = None,
        stop_after: int | None = None,
        max_minutes: float | None = None,
        warm_start_from: str | os.PathLike | None = None,
    ) -> TrainResult:
        """Runs the optimizer steps, from scratch or from a checkpoint.

        Args:
            resume_from: A ``checkpoint-*`` folder written by this trainer (this run, continued).
            stop_after: Stop (with a checkpoint) after this many steps in total, e.g. to split a run.
            max_minutes: Stop (with a checkpoint) after the step during which this much time has
                passed; resuming from that checkpoint continues the run bit for bit.
            warm_start_from: A ``checkpoint-*`` folder of another run of the same head, or a saved
                head of the same configuration (e.g. a shipped one, without trainer state): this run
                starts from its weights with a new optimizer and its own schedule and history (a
                next stage; recorded as ``warm_start`` in the provenance, with the checkpoint's step,
                or None for a saved head). Not with ``resume_from``: a warm-started run is resumed
                like any other, from its own checkpoints.

        Returns:
            The last checkpoint and the last step's loss and metrics.
        """
        config, accelerator = self.config, self.accelerator
        deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
        if resume_from is not None and warm_start_from is not None:
            raise ValueError(
                f"resume_from={str(resume_from)!r} and warm_start_from={str(warm_start_from)!r}: give one. "
                "warm_start_from begins a run from another run's weights; resume_from continues this run."
            )
        if warm_start_from is not None:
            self._warm_start(Path(warm_start_from))
        step = 0 if resume_from is None else self._load(Path(resume_from))
        last_step = config.num_steps if stop_after is None else min(stop_after, config.num_steps)
        progress = tqdm(
            total=config.num_steps, initial=step, disable=not (config.progress and accelerator.is_main_process)
        )
        checkpoint, loss, metrics = None, float("nan"), None
        while step < last_step:
            learning_rate = self.scheduler.get_last_lr()[0]
            loss, metrics = self._optimizer_step(step)
            step += 1
            self.history.append(_history_record(step, loss, learning_rate, metrics))
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.3f}", tau=f"{metrics.tau:.2f}", acc0=f"{metrics.acceptance[0]:.2f}")
            if deadline is not None and _all_past(deadline, accelerator):
                last_step = step
            if step == last_step or (config.save_every and step % config.save_every == 0):
                checkpoint = self.save(step, metrics)
        progress.close()
        if checkpoint is None:
            raise ValueError(f"nothing to train: the run is already at step {step} of {config.num_steps}.")
        return TrainResult(checkpoint, loss, metrics)

    def _optimizer_step(self, step: int) -> tuple[float, TeacherForcedMetrics]:
        config, accelerator = self.config, self.accelerator
        accumulation = config.gradient_accumulation_steps
        total, metrics = 0.0, None
        for micro in range(accumulation):
            micro_step = step * accumulation + micro
            indices = self.dataset.batch_indices(
                micro_step, config.batch_size, config.seed, accelerator.process_index, accelerator.num_processes
            )
            batch = self.dataset.batch(indices).to(accelerator.device)
            generator = anchor_generator(config.seed, accelerator.process_index, micro_step)
            anchors = sample_anchors(batch.loss_mask, config.num_anchors, generator)
            states = None
            if self.feature_cache is not None:
                states = self.feature_cache.states(indices, accelerator.device, self.target.dtype)
            sync = contextlib.nullcontext() if micro == accumulation - 1 else accelerator.no_sync(self.model)
            with sync, accelerator.autocast():
                terms, batch_metrics = teacher_forced_step(
                    self.model, self.target, self.head, batch, anchors, config.loss_weights, states, self.loss
                )
                accelerator.backward(terms.total / accumulation)
            total += float(terms.total.detach()) / accumulation
            metrics = batch_metrics if metrics is None else metrics + batch_metrics
        accelerator.clip_grad_norm_(self.trainable, config.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, metrics

    # -------------------------------------------------------------------------------- checkpoints

    def save(self, step: int, metrics: TeacherForcedMetrics | None = None) -> Path:
        """Writes ``checkpoint-{step}`` atomically (a temporary folder renamed into place).

        It holds the head (speculators format, with a model card), ``trainer_state.pt``
        (optimizer, scheduler, step) and ``provenance.json``.
        """
        final = self.output_dir / f"checkpoint-{step:07d}"
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            temporary = self.output_dir / f".tmp-checkpoint-{step:07d}-{os.getpid()}"
            shutil.rmtree(temporary, ignore_errors=True)
            try:
                self.head.save_pretrained(temporary)
                state = {
                    "step": step,
                    "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(),
                    "reparametrized": _reparametrized(self.head),
                    "warm_start": self.warm_start,
                }
                torch.save(state, temporary / TRAINER_STATE)
                provenance = self._provenance(step, metrics)
                (temporary / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
                (temporary / HISTORY).write_text(json.dumps(self.history) + "\n")
                shutil.rmtree(final, ignore_errors=True)
                os.replace(temporary, final)
            finally:
                shutil.rmtree(temporary, ignore_errors=True)
            self._prune_checkpoints()
        self.accelerator.wait_for_everyone()
        return final

    def _prune_checkpoints(self) -> None:
        """Deletes all but the newest ``save_total_limit`` checkpoints.

        Each is renamed away before it is deleted, so a crash never leaves a partial ``checkpoint-*``.
        """
        limit = self.config.save_total_limit
        if limit is None:
            return
        checkpoints = sorted(self.output_dir.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
        for old in checkpoints[:-limit]:
            doomed = old.with_name(f".tmp-delete-{old.name}-{os.getpid()}")
            os.replace(old, doomed)
            shutil.rmtree(doomed)

    def _provenance(self, step: int, metrics: TeacherForcedMetrics | None) -> dict:
        cache = self.feature_cache
        return {
            "step": step,
            "target": self._target_identity,
            "data": {"description": self.dataset.description, "num_sequences": len(self.dataset)},
            "feature_cache": None
            if cache is None
            else {"paths": list(map(str, cache.paths)), "dtype": cache.dtype, "autocast": list(cache.autocast)},
            "git_commit": git_commit(),
            "packages": package_versions(),
            "argv": list(sys.argv),
            "warm_start": self.warm_start,
            "num_processes": self.accelerator.num_processes,
            "training": dataclasses.asdict(self.config),
            "loss_divergences": DIVERGENCE_CHOICES,
            "teacher_forced_metrics": None if metrics is None else metrics.as_dict(),
        }

    def _read_head(self, folder: Path) -> DSparkHead:
        """The head saved in ``folder``, checked against the head being trained."""
        loaded = DSparkHead.from_pretrained(folder)
        ignored = ("dtype", "transformers_version")  # set when saving
        saved = {key: value for key, value in loaded.config.to_dict().items() if key not in ignored}
        if saved != {key: value for key, value in self.head.config.to_dict().items() if key not in ignored}:
            raise ValueError(
                f"{folder} holds a head with another configuration than the one being trained; "
                "resume with the same head settings, or start a new run."
            )
        return loaded

    def _read(self, checkpoint: Path) -> tuple[DSparkHead, dict]:
        """The head and trainer state of a checkpoint, checked against the head being trained."""
        loaded = self._read_head(checkpoint)
        try:
            state = torch.load(checkpoint / TRAINER_STATE, map_location="cpu", weights_only=True)
            state["step"] = int(state["step"])
        except Exception as error:
            raise ValueError(
                f"{checkpoint / TRAINER_STATE} is missing or corrupt ({error!r}); expected the trainer state "
                "written with the checkpoint. Resume from another checkpoint."
            ) from error
        reparametrized = state.setdefault("reparametrized", {})  # absent in checkpoints of older versions
        if set(reparametrized) != set(_reparametrized(self.head)):
            scaled = "trained on scaled features" if reparametrized else "trained on raw features"
            raise ValueError(
                f"{checkpoint} was {scaled}, the head given to this trainer is not: resume with a head set up as "
                "the run began (head.scale_target_features(scale) before the Trainer, or not), any scale."
            )
        return loaded, state

    def _copy_weights(self, loaded: DSparkHead, state: dict) -> None:
        """Overwrites the head's weights with a checkpoint's.

        The saved head holds the folded fc.weight; the trained parameters behind it (W and its
        scale) come from the trainer state, so a resumed run continues bit for bit.
        """
        own = self.head.state_dict()
        with torch.no_grad():
            for name, tensor in [*loaded.state_dict().items(), *state["reparametrized"].items()]:
                if name in own:
                    own[name].copy_(tensor)

    def _load(self, checkpoint: Path) -> int:
        """Restores the head, optimizer, scheduler and history from a checkpoint; returns its step."""
        loaded, state = self._read(checkpoint)
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except Exception as error:
            raise ValueError(
                f"{checkpoint / TRAINER_STATE} holds an optimizer or scheduler state this run cannot take "
                f"({error!r}); resume with the settings the run began with, or start a new run."
            ) from error
        self.warm_start = state.get("warm_start")
        history = checkpoint / HISTORY  # absent in checkpoints of older versions: the curve starts here
        self.history = json.loads(history.read_text()) if history.exists() else []
        self._copy_weights(loaded, state)
        return state["step"]

    def _warm_start(self, source: Path) -> None:
        """Starts this run from another run's checkpoint, or from a saved head: new optimizer, schedule and history.

        A saved head without trainer state (an exported or shipped head) holds ``fc``'s folded
        weight; a head trained on scaled features starts from ``W = fc.weight / scale``, so that it
        computes the saved head's logits (up to the rounding of that division), whatever its scale.
        """
        if (source / TRAINER_STATE).exists():
            loaded, state = self._read(source)
            step = state["step"]
        else:
            loaded, step = self._read_head(source), None
            state = {"reparametrized": self._unfolded(loaded.fc.weight)}
        self.warm_start = {"checkpoint": str(source), "step": step}
        self._copy_weights(loaded, state)

    def _unfolded(self, fc_weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The head's parametrisation entries that make its ``fc.weight`` equal ``fc_weight`` (none if unscaled)."""
        scale = self.head.target_feature_scale
        entries = _reparametrized(self.head)
        for name in entries:
            if name.endswith(".original"):  # W, of which fc.weight = W · diag(scale)
                entries[name] = fc_weight.to(scale.device, torch.float32) / scale
        return entries
