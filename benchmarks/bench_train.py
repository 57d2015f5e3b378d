"""Training throughput on CPU: the DSpark trainer with the target in process and from the feature cache.

A random model with SmolLM2-135M's shape (hidden 576, 30 layers, vocab 49,152) is the frozen
target; a new head (block 7, 1 draft layer, full vocabulary, 5 taps) is trained on random documents
with the project's own `Trainer`, in these modes at equal settings:

* ``in-process``: the target computes its tapped features and final hidden states on every batch;
* ``feature-cache``: they are read from a cache built once beforehand (`build_feature_cache`,
  bfloat16 on disk), so a step runs only the head and the target's LM head;
* ``feature-cache-compiled``: the same with ``compile_loss=True`` (the objective through
  ``torch.compile``; its compilation happens in the warm-up step);
* ``in-process-bf16`` and ``feature-cache-compiled-bf16``: the same under bfloat16 autocast
  (``mixed_precision="bf16"``, float32 master weights; with the target in process its forward runs
  in bfloat16 too), which pays where the CPU multiplies bfloat16 in hardware (AMX).

The cache is built first (its build rate and size are recorded). Each mode then runs in its own
process, so its peak memory is its own: a one-step run warms up, and a second run of ``--steps``
steps is timed. Its trainer is set up before the clock starts (hashing the target's weights is a
one-time cost), and the one checkpoint it writes is timed again on its own and taken out of the
step time (recorded as ``checkpoint_seconds``). Results go to `benchmarks/results/train_cpu.csv`
with hardware, versions and commit.

    python benchmarks/bench_train.py --steps 4 --threads 2
    python benchmarks/bench_train.py --steps 4 --threads 2 --batch-size 8 --num-anchors 32 \
        --sequence-length 384 --draft-vocab-size 8192      # the SmolLM2 recipe's step
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _env import smollm2_shaped_config, write_results
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from spark_generate.heads import DSparkHead
from spark_generate.training import FeatureCache, Trainer, TrainingConfig, build_feature_cache
from spark_generate.training.data import TokenDataset

RESULTS = Path(__file__).resolve().parent / "results" / "train_cpu.csv"
MODES = ("in-process", "feature-cache", "feature-cache-compiled", "in-process-bf16", "feature-cache-compiled-bf16")


def setup(args: argparse.Namespace) -> tuple[LlamaForCausalLM, DSparkHead, TokenDataset, PreTrainedTokenizerFast]:
    """The seeded random target, a new head, random documents and a stand-in tokenizer (its vocabulary only)."""
    torch.manual_seed(0)
    target = LlamaForCausalLM(smollm2_shaped_config()).eval()
    head = DSparkHead.from_target(target, block_size=7, num_draft_layers=1, draft_vocab_size=args.draft_vocab_size)
    vocab_size = target.config.vocab_size
    documents = torch.randint(0, vocab_size, (args.batch_size * (args.steps + 1), args.sequence_length)).tolist()
    masks = [[0] * 16 + [1] * (args.sequence_length - 16) for _ in documents]
    dataset = TokenDataset(tuple(map(tuple, documents)), tuple(map(tuple, masks)), "random tokens")
    vocab = WordLevel({f"t{i}": i for i in range(vocab_size)}, "t0")
    return target, head, dataset, PreTrainedTokenizerFast(tokenizer_object=Tokenizer(vocab))


def measure(args: argparse.Namespace) -> dict[str, object]:
    """Trains in ``args.mode`` (warm-up step, then ``args.steps`` timed steps); returns the mode's row."""
    target, head, dataset, tokenizer = setup(args)
    cache = None
    if args.mode.startswith("feature-cache"):
        taps = list(head.config.target_layer_ids)
        cache = FeatureCache.open(args.cache, target=target, tokenizer=tokenizer, dataset=dataset, layer_ids=taps)
    with tempfile.TemporaryDirectory() as output_dir:
        warm_up = TrainingConfig(output_dir=output_dir, num_steps=1, batch_size=args.batch_size,
                                 num_anchors=args.num_anchors, compile_loss="compiled" in args.mode,
                                 mixed_precision="bf16" if args.mode.endswith("bf16") else "no",
                                 progress=False)  # fmt: skip
        Trainer(head, target, dataset, warm_up, feature_cache=cache).train()
        timed = dataclasses.replace(warm_up, num_steps=args.steps)
        trainer = Trainer(head, target, dataset, timed, feature_cache=cache)
        start = time.perf_counter()
        trainer.train()
        run_seconds = time.perf_counter() - start
        start = time.perf_counter()
        trainer.save(args.steps)  # the run's checkpoint again: what writing it took
        checkpoint_seconds = time.perf_counter() - start
    seconds = (run_seconds - checkpoint_seconds) / args.steps
    return {
        "mode": args.mode,
        "seconds_per_step": round(seconds, 2),
        "checkpoint_seconds": round(checkpoint_seconds, 2),
        "tokens_per_second": round(args.batch_size * args.sequence_length / seconds, 1),
        "anchors_per_second": round(args.batch_size * args.num_anchors / seconds, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    parser.add_argument("--sequence-length", type=int, default=512, help="tokens per document")
    parser.add_argument("--batch-size", type=int, default=1, help="documents per step")
    parser.add_argument("--num-anchors", type=int, default=128, help="blocks per document")
    parser.add_argument("--draft-vocab-size", type=int, default=None, help="draft vocabulary (default: full)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="modes to time, in order")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the results CSV")
    parser.add_argument("--note", action="append", default=[], help="a line for the results header (repeatable)")
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # one mode, in a child process
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.mode is not None:
        print(json.dumps(measure(args)))
        return

    target, head, dataset, tokenizer = setup(args)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        taps = list(head.config.target_layer_ids)
        build_feature_cache(cache, target, tokenizer, dataset, taps, progress=False)
        build_seconds = time.perf_counter() - start  # the weights' SHA-256 included
        cache_mib = sum(path.stat().st_size for path in Path(cache).glob("shard-*.bin")) / 2**20
        target_vocab_size = target.config.vocab_size
        del target, head
        measured = []
        for mode in args.modes:
            child = [sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--cache", cache]
            completed = subprocess.run(child, capture_output=True, text=True, check=True)
            measured.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    baseline_rate = measured[0]["anchors_per_second"]  # speed-ups are over the first mode timed
    num_tokens = len(dataset) * args.sequence_length
    rows = []
    for row in measured:
        cached = row is next((r for r in measured if r["mode"].startswith("feature-cache")), None)  # the build, once
        rows.append({
            "target": "smollm2-135m-shape", "block_size": 7, "draft_layers": 1, "taps": len(taps),
            "draft_vocab_size": args.draft_vocab_size or target_vocab_size,
            "sequence_length": args.sequence_length, "batch_size": args.batch_size, "num_anchors": args.num_anchors,
            **row,
            "speedup": round(row["anchors_per_second"] / baseline_rate, 2),
            "cache_build_tokens_per_second": round(num_tokens / build_seconds, 1) if cached else "",
            "cache_mib_per_1k_tokens": round(cache_mib / num_tokens * 1000, 2) if cached else "",
        })  # fmt: skip
    notes = ["float32 unless the mode says bf16, random documents; the feature cache in bfloat16", *args.note]
    write_results(args.output, rows, torch.device("cpu"), notes)
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
