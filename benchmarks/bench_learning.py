"""Learning curves of DSpark heads on SmolLM2-135M-Instruct: which recipe choices make a head learn.

Every *arm* trains a new head from the same target-feature cache, on the same documents, for the
same number of optimizer steps, and is evaluated on the same held-out documents every
``--eval-every`` steps: teacher-forced first-slot greedy accuracy (does the draft's argmax equal the
target's?), per-slot acceptance ``1 - TV`` and tau. The floor is a bigram model of the training
answers: the most frequent next token after each token, scored against the held-out answers.

The data is the on-policy corpus of ``spark-generate regenerate`` (the target's own greedy answers,
so the data token after position ``p`` is the target's argmax there). ``--heldout`` documents are
held out (``--split``: by prompt index, all domains alike, or the file's last ones);
training uses the first ``--train`` of the others.

Arms (``--arms``, comma-separated; ``--list`` prints them) differ from ``baseline``, the shipped
head's recipe, in one choice each unless named otherwise: how the tapped features are scaled
(``channel``, ``tap``), the learning rate, draft layers, anchors per document, copying the target's
last layers into the draft layers, the loss (``ce``: argmax agreement for greedy serving), the
draft vocabulary. ``recipe`` is the recipe the head trains with today (one draft layer, 8 documents
x 32 blocks per step), and its arms change one thing each: bfloat16 autocast, two draft layers, a
4,096-token draft vocabulary, 16 documents x 16 blocks (what makes a CPU step cheaper at an equal
curve, and the capacity a larger corpus deserves); ``recipe-bf16-cache-bf16`` also builds its training
cache under bfloat16 autocast (a third of the build's time on a CPU with AMX), evaluated on the same
float32 held-out cache as every arm.

``--data`` takes several corpora (e.g. the slices of ``examples/grow_corpus.py``): they take turns,
for the training documents and the held-out ones alike, so each is represented at any ``--train``.
``--results`` names the CSV and PNG written to ``benchmarks/results``.

Everything lives in ``--workdir`` (default: ``$SPARK_GENERATE_CACHE/learning`` or
``~/.cache/spark_generate/learning``): the feature caches, each arm's checkpoints and
``curves.csv``. ``--max-minutes`` stops between evaluations; the same command continues exactly
where it stopped (arms resume from their last checkpoint). Results: ``learning_smollm2_cpu.csv``
and ``.png`` in ``benchmarks/results``, with hardware, versions and commit.

    python benchmarks/bench_learning.py --arms baseline,channel,tap --steps 300 --max-minutes 60
"""

from __future__ import annotations

import argparse
import collections
import csv
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from _env import write_results
from accelerate.state import AcceleratorState
from tqdm.auto import tqdm

from spark_generate import zoo
from spark_generate.heads import DSparkHead
from spark_generate.training import (
    FeatureCache,
    LossWeights,
    TokenDataset,
    Trainer,
    TrainingConfig,
    build_feature_cache,
    draft_vocab_from_data,
    read_jsonl,
    sample_anchors,
    teacher_forced_step,
)
from spark_generate.training.initialization import feature_scale_from_cache, init_draft_layers_from_target
from spark_generate.training.metrics import TeacherForcedMetrics

TARGET = "smollm2-135m-instruct"
RESULTS = Path(__file__).resolve().parent / "results" / "learning_smollm2_cpu.csv"
CACHE_ROOT = Path(os.environ.get("SPARK_GENERATE_CACHE", Path.home() / ".cache" / "spark_generate"))
DEFAULT_DATA = CACHE_ROOT / "data" / f"{TARGET}-mixed.jsonl"
EVAL_ANCHORS = 64
SCALE_DOCUMENTS = 256


@dataclass(frozen=True)
class Arm:
    """One recipe: the head, the training settings and how the head starts."""

    head: dict[str, object] = field(default_factory=dict)
    training: dict[str, object] = field(default_factory=dict)
    scale: str | None = None  # "channel" / "tap": head.scale_target_features
    init_from_target: bool = False
    cache_autocast: bool = False  # train from a cache whose target forward ran under bfloat16 autocast


BASELINE_HEAD = {"block_size": 7, "num_draft_layers": 2, "markov_rank": 64, "draft_vocab_size": 8192}
BASELINE_TRAINING = {"batch_size": 2, "num_anchors": 128, "learning_rate": 1e-3, "warmup_ratio": 0.04}
RECIPE_HEAD = {"num_draft_layers": 1}
RECIPE_TRAINING = {"batch_size": 8, "num_anchors": 32}
DOCS16X16 = {"batch_size": 16, "num_anchors": 16}  # the same blocks per step from twice the documents
ARMS = {
    "baseline": Arm(),
    "channel": Arm(scale="channel"),
    "tap": Arm(scale="tap"),
    "channel-init": Arm(scale="channel", init_from_target=True),
    "channel-lr3e-4": Arm(scale="channel", training={"learning_rate": 3e-4}),
    "channel-lr3e-3": Arm(scale="channel", training={"learning_rate": 3e-3}),
    "channel-1layer": Arm(scale="channel", head={"num_draft_layers": 1}),
    "channel-3layers": Arm(scale="channel", head={"num_draft_layers": 3}),
    "channel-anchors32": Arm(scale="channel", training={"num_anchors": 32}),
    "channel-anchors512": Arm(scale="channel", training={"num_anchors": 512}),
    "channel-docs8x32": Arm(scale="channel", training={"batch_size": 8, "num_anchors": 32}),  # same blocks/step
    "channel-ce": Arm(scale="channel", training={"loss_weights": LossWeights(ce=1.0, l1=0.0)}),
    "channel-kl": Arm(scale="channel", training={"loss_weights": LossWeights(ce=0.0, l1=0.0, kl=1.0)}),
    "channel-kl-l1": Arm(scale="channel", training={"loss_weights": LossWeights(ce=0.0, l1=0.5, kl=0.5)}),
    "channel-vocab16k": Arm(scale="channel", head={"draft_vocab_size": 16384}),
    "channel-dflash": Arm(scale="channel", head={"markov_rank": 0, "enable_confidence_head": False}),
    # The recipe the shipped head trains with (examples/train_smollm2_head.py), and one change each:
    # what makes a CPU step cheaper at an equal curve, and the capacity a larger corpus deserves.
    "recipe": Arm(scale="channel", head=RECIPE_HEAD, training=RECIPE_TRAINING),
    "recipe-bf16": Arm(scale="channel", head=RECIPE_HEAD, training={**RECIPE_TRAINING, "mixed_precision": "bf16"}),
    "recipe-bf16-cache-bf16": Arm(
        scale="channel", head=RECIPE_HEAD, training={**RECIPE_TRAINING, "mixed_precision": "bf16"}, cache_autocast=True
    ),
    "recipe-2layers": Arm(scale="channel", head={**RECIPE_HEAD, "num_draft_layers": 2}, training=RECIPE_TRAINING),
    "recipe-vocab4k": Arm(scale="channel", head={**RECIPE_HEAD, "draft_vocab_size": 4096}, training=RECIPE_TRAINING),
    "recipe-docs16x16": Arm(scale="channel", head=RECIPE_HEAD, training={**RECIPE_TRAINING, **DOCS16X16}),
}


def subset(dataset: TokenDataset, indices: list[int], name: str) -> TokenDataset:
    """Documents ``indices`` (file order) of ``dataset`` as a dataset of their own (its own feature cache)."""
    return TokenDataset(
        tuple(dataset.sequences[i] for i in indices),
        tuple(dataset.loss_masks[i] for i in indices),
        f"{dataset.description}, {len(indices)} {name} documents from file line {indices[0] + 1}",
    )


def prompt_indices(paths: list[Path]) -> tuple[list[int], list[int]]:
    """Each document's file (its position in ``paths``) and prompt index, in the order the files are read."""
    files, indices = [], []
    for number, path in enumerate(paths):
        for line in path.read_text().splitlines():
            if line.strip():
                files.append(number)
                indices.append(json.loads(line)["index"])
    return files, indices


def interleaved(positions: list[int], files: list[int]) -> list[int]:
    """``positions`` taken from the files in turn (the first of each file, then the second, ...): every file alike."""
    rank, seen = {}, collections.Counter()
    for position in positions:
        rank[position] = seen[files[position]]
        seen[files[position]] += 1
    return sorted(positions, key=lambda position: (rank[position], files[position]))


def split(
    paths: list[Path], data: TokenDataset, how: str, num_train: int, num_heldout: int
) -> tuple[list[int], list[int]]:
    """Positions (in the files read one after another) of the training and held-out documents.

    ``last``: the last ``num_heldout`` documents of a single file are held out (regeneration writes
    length-sorted windows, so they are the longest prompts of the last window: mostly one kind of
    task). ``stride``: the documents whose prompt index is ``63 mod 64`` are held out, as
    ``examples/train_smollm2_head.py`` holds them out (all domains alike). Training takes the first
    ``num_train`` documents of the rest; from several files, the files take turns (held out alike),
    so every corpus is represented at any size.
    """
    files, indices = prompt_indices(paths)
    if how == "last":
        if len(paths) > 1:
            raise SystemExit(f"--split last takes one --data file, got {len(paths)}: use --split stride.")
        heldout = list(range(len(data) - num_heldout, len(data)))
    else:
        heldout = interleaved([p for p, index in enumerate(indices) if index % 64 == 63], files)[:num_heldout]
    chosen = set(heldout)
    train = interleaved([position for position in range(len(data)) if position not in chosen], files)[:num_train]
    if len(train) < num_train or len(heldout) < num_heldout:
        raise SystemExit(
            f"{', '.join(map(str, paths))} hold {len(train)} training and {len(heldout)} held-out documents for "
            f"--split {how}: fewer than --train {num_train} and --heldout {num_heldout}. Regenerate more, or ask "
            "for fewer."
        )
    return train, heldout


def bigram_accuracy(train: TokenDataset, heldout: TokenDataset) -> float:
    """How often the most frequent follower (in the training answers) of an answer token is the next one held out."""
    followers: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for ids, mask in zip(train.sequences, train.loss_masks, strict=True):
        for p in range(len(ids) - 1):
            if mask[p] and mask[p + 1]:
                followers[ids[p]][ids[p + 1]] += 1
    best = {token: counts.most_common(1)[0][0] for token, counts in followers.items()}
    hits = total = 0
    for ids, mask in zip(heldout.sequences, heldout.loss_masks, strict=True):
        for p in range(len(ids) - 1):
            if mask[p] and mask[p + 1]:
                hits += best.get(ids[p]) == ids[p + 1]
                total += 1
    return hits / max(total, 1)


def evaluate(trainer: Trainer, heldout: TokenDataset, cache: FeatureCache) -> TeacherForcedMetrics:
    """Teacher-forced metrics on the held-out documents, at the same anchors for every arm and step."""
    head, metrics = trainer.head, None
    head.eval()
    with torch.no_grad():
        for start in range(0, len(heldout), 4):
            indices = list(range(start, min(start + 4, len(heldout))))
            batch = heldout.batch(indices)
            anchors = sample_anchors(batch.loss_mask, EVAL_ANCHORS, torch.Generator().manual_seed(start))
            states = cache.states(indices, torch.device("cpu"), trainer.target.dtype)
            _, batch_metrics = teacher_forced_step(
                trainer.model, trainer.target, head, batch, anchors, trainer.config.loss_weights, states
            )
            metrics = batch_metrics if metrics is None else metrics + batch_metrics
    head.train()
    return metrics


def latest_checkpoint(folder: Path) -> Path | None:
    checkpoints = sorted(folder.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    return checkpoints[-1] if checkpoints else None


def build_head(arm: Arm, target, train: TokenDataset, train_cache: FeatureCache) -> DSparkHead:
    """A new head of the arm's recipe (same seed for every arm)."""
    torch.manual_seed(0)
    fields = {**BASELINE_HEAD, **arm.head}
    vocab = draft_vocab_from_data(train, int(fields["draft_vocab_size"]), target.config.vocab_size)
    head = DSparkHead.from_target(target, draft_vocab_ids=vocab, **fields)
    if arm.init_from_target:
        init_draft_layers_from_target(head, target)
    if arm.scale is not None:
        num_taps = len(head.config.target_layer_ids)
        head.scale_target_features(
            feature_scale_from_cache(train_cache, range(min(SCALE_DOCUMENTS, len(train))), num_taps, arm.scale)
        )
    return head


def run_arm(name: str, args, target, train, heldout, caches, writer, done: set, deadline: float) -> bool:
    """Trains and evaluates one arm up to ``args.steps``; returns False when the deadline stopped it."""
    arm = ARMS[name]
    output = args.workdir / "arms" / name
    training = {**BASELINE_TRAINING, **arm.training}
    config = TrainingConfig(str(output), num_steps=args.steps, progress=False, **training)
    train_cache = caches["train-bf16" if arm.cache_autocast else "train"]
    head = build_head(arm, target, train, train_cache)
    # Arms differ in mixed precision, which Accelerate fixes once per process: forget the previous
    # arm's (one process, so there is no distributed state to keep).
    AcceleratorState._reset_state()
    trainer = Trainer(head, target, train, config, feature_cache=train_cache)
    checkpoint = latest_checkpoint(output)
    step = 0 if checkpoint is None else int(checkpoint.name.split("-")[1])
    wall = None if checkpoint is None else checkpoint / "wall.json"
    seconds = json.loads(wall.read_text())["seconds"] if wall is not None and wall.exists() else 0.0
    if (name, 0) not in done:
        writer(name, 0, seconds, float("nan"), evaluate(trainer, heldout, caches["heldout"]))
    bar = tqdm(total=args.steps, initial=step, desc=name)
    while step < args.steps:
        if time.monotonic() > deadline:
            return False
        start = time.monotonic()
        stop = min(step + args.eval_every, args.steps)
        result = trainer.train(resume_from=checkpoint, stop_after=stop)
        seconds += time.monotonic() - start
        checkpoint, step = result.checkpoint, stop
        (checkpoint / "wall.json").write_text(json.dumps({"seconds": seconds}))
        for old in output.glob("checkpoint-*"):
            if old != checkpoint:
                shutil.rmtree(old)
        writer(name, step, seconds, result.loss, evaluate(trainer, heldout, caches["heldout"]))
        bar.update(stop - bar.n)
    bar.close()
    return True


def plot(rows: list[dict[str, str]], floor: float, path: Path) -> None:
    """First-slot greedy accuracy and tau against step, per arm, and acceptance by slot at the last step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(row["arm"] for row in rows))
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for arm in arms:
        mine = [row for row in rows if row["arm"] == arm]
        steps = [int(row["step"]) for row in mine]
        axes[0].plot(steps, [float(row["greedy_accuracy_0"]) for row in mine], marker="o", ms=3, label=arm)
        line = axes[1].plot(steps, [float(row["tau"]) for row in mine], marker="o", ms=3, label=f"{arm} (1 - TV)")
        axes[1].plot(steps, [float(row["greedy_tau"]) for row in mine], linestyle="--", color=line[0].get_color(),
                     label=f"{arm} (greedy)")  # fmt: skip
        last = mine[-1]
        slots = [key for key in last if key.startswith("acceptance_")]
        axes[2].plot(range(1, len(slots) + 1), [float(last[key]) for key in slots], marker="o", label=arm)
    axes[0].axhline(floor, color="gray", linestyle="--", label=f"bigram floor ({floor:.2f})")
    axes[0].set(xlabel="optimizer step", ylabel="first-slot greedy accuracy (held out)", ylim=(0, 1))
    axes[1].set(xlabel="optimizer step", ylabel="teacher-forced tau per block (held out)")
    axes[1].legend(fontsize=6)
    axes[2].set(xlabel="draft slot", ylabel="acceptance 1 - TV at the last step", ylim=(0, 1))
    axes[0].legend(fontsize=7)
    axes[2].legend(fontsize=7)
    figure.suptitle("DSpark heads on SmolLM2-135M-Instruct: learning curves from the same feature cache (CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", default=[DEFAULT_DATA],
                        help="on-policy JSONL file(s) (regenerate's output); several take turns")  # fmt: skip
    parser.add_argument("--train", type=int, default=1024, help="training documents (the first of the file)")
    parser.add_argument("--heldout", type=int, default=64, help="held-out documents")
    parser.add_argument("--split", choices=["stride", "last"], default="stride",
                        help="held out: prompt index 63 mod 64 (stride), or the file's last documents")  # fmt: skip
    parser.add_argument("--arms", default="baseline,channel", help="comma-separated arm names")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per arm")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between held-out evaluations")
    parser.add_argument("--workdir", type=Path, default=CACHE_ROOT / "learning", help="caches, checkpoints, curves")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop between evaluations after this long")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--results", default=RESULTS.stem, help="name of the CSV and PNG in benchmarks/results")
    parser.add_argument("--list", action="store_true", help="print the arms and exit")
    args = parser.parse_args()
    if args.list:
        for name, arm in ARMS.items():
            print(f"{name}: {arm}")
        return
    unknown = [name for name in args.arms.split(",") if name not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; expected names from: {', '.join(ARMS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    deadline = time.monotonic() + 60 * args.max_minutes if args.max_minutes else float("inf")
    target, tokenizer = zoo.load(TARGET)
    target.requires_grad_(False)
    data = TokenDataset.concatenate([read_jsonl(path) for path in args.data])
    train_positions, heldout_positions = split(args.data, data, args.split, args.train, args.heldout)
    train = subset(data, train_positions, "training")
    heldout = subset(data, heldout_positions, "held-out")
    layer_ids = list(DSparkHead.from_target(target, **BASELINE_HEAD).config.target_layer_ids)
    args.workdir.mkdir(parents=True, exist_ok=True)
    caches = {}
    wanted = [("train", train, None), ("heldout", heldout, None)]
    if any(ARMS[name].cache_autocast for name in args.arms.split(",")):
        wanted.append(("train-bf16", train, torch.bfloat16))
    for name, documents, dtype in wanted:
        suffix = "" if args.split == "last" else f"-{args.split}"
        if len(args.data) > 1:  # the documents depend on the files: one cache per set of files
            suffix += "-" + hashlib.sha256("\n".join(path.name for path in args.data).encode()).hexdigest()[:8]
        folder = args.workdir / f"features-{name}-{args.train}-{args.heldout}{suffix}"
        build = build_feature_cache(
            folder, target, tokenizer, documents, layer_ids, max_minutes=args.max_minutes, autocast_dtype=dtype
        )
        if not build.complete:
            raise SystemExit(f"the {name} feature cache is not finished yet: run the same command again.")
        caches[name] = FeatureCache.open(
            folder, target=target, tokenizer=tokenizer, dataset=documents, layer_ids=layer_ids, verify_checksums=False
        )
    floor = bigram_accuracy(train, heldout)

    curves = args.workdir / "curves.csv"
    done: set[tuple[str, int]] = set()
    if curves.exists():
        with curves.open() as file:
            done = {(row["arm"], int(row["step"])) for row in csv.DictReader(file)}

    def writer(arm: str, step: int, seconds: float, loss: float, metrics: TeacherForcedMetrics) -> None:
        row = {"arm": arm, "step": step, "train_seconds": round(seconds, 1), "train_loss": round(loss, 4),
               "tau": round(metrics.tau, 4), "greedy_tau": round(metrics.greedy_tau, 4)}  # fmt: skip
        row.update({f"greedy_accuracy_{k}": round(v, 4) for k, v in enumerate(metrics.greedy_accuracy.tolist())})
        row.update({f"acceptance_{k}": round(v, 4) for k, v in enumerate(metrics.acceptance.tolist())})
        new_file = not curves.exists()
        with curves.open("a", newline="") as file:
            out = csv.DictWriter(file, fieldnames=list(row))
            if new_file:
                out.writeheader()
            out.writerow(row)
        done.add((arm, step))
        print(
            f"{arm} step {step}: tau {metrics.tau:.3f}, greedy tau {metrics.greedy_tau:.3f}, "
            f"first-slot greedy {metrics.greedy_accuracy[0]:.3f}"
        )

    for name in args.arms.split(","):
        if not run_arm(name, args, target, train, heldout, caches, writer, done, deadline):
            print("stopped by --max-minutes: run the same command again to continue")
            return
    with curves.open() as file:
        rows = [row for row in csv.DictReader(file) if row["arm"] in args.arms.split(",")]
    notes = [
        f"data: {', '.join(path.name for path in args.data)}, {args.train} training and {args.heldout} held-out "
        f"documents (--split {args.split})",
        f"{args.steps} steps per arm; baseline head {BASELINE_HEAD}, training {BASELINE_TRAINING}",
        f"bigram floor (first-slot greedy accuracy, held out): {floor:.4f}",
    ]
    results = RESULTS.with_name(f"{args.results}.csv")
    write_results(results, rows, torch.device("cpu"), notes)
    plot(rows, floor, results.with_suffix(".png"))


if __name__ == "__main__":
    main()
