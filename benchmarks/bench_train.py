"""Training throughput on CPU: tokens/s, anchors/s and peak memory of the DSpark trainer.

A random model with SmolLM2-135M's shape (hidden 576, 30 layers, vocab 49,152) is the frozen
target; a new head (block 7, 1 draft layer, full vocabulary) is trained on random documents with
the project's own `Trainer`, the target computing its hidden states on the fly. A one-step run
warms up; a second run of ``--steps`` steps is timed (one checkpoint write included). Results go
to `benchmarks/results/train_cpu.csv` with hardware, versions and commit.

    python benchmarks/bench_train.py --steps 4 --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import tempfile
import time
from pathlib import Path

import torch
from _env import smollm2_shaped_config, write_results
from transformers import LlamaForCausalLM

from spark_generate.heads import DSparkHead
from spark_generate.training import Trainer, TrainingConfig
from spark_generate.training.data import TokenDataset

RESULTS = Path(__file__).resolve().parent / "results" / "train_cpu.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps")
    parser.add_argument("--sequence-length", type=int, default=512, help="tokens per document")
    parser.add_argument("--batch-size", type=int, default=1, help="documents per step")
    parser.add_argument("--num-anchors", type=int, default=128, help="blocks per document")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    target = LlamaForCausalLM(smollm2_shaped_config()).eval()
    head = DSparkHead.from_target(target, block_size=7, num_draft_layers=1)
    documents = torch.randint(
        0, target.config.vocab_size, (args.batch_size * (args.steps + 1), args.sequence_length)
    ).tolist()
    masks = [[0] * 16 + [1] * (args.sequence_length - 16) for _ in documents]
    dataset = TokenDataset(tuple(map(tuple, documents)), tuple(map(tuple, masks)), "random tokens")
    with tempfile.TemporaryDirectory() as output_dir:
        warm_up = TrainingConfig(output_dir=output_dir, num_steps=1, batch_size=args.batch_size,
                                 num_anchors=args.num_anchors, progress=False)  # fmt: skip
        Trainer(head, target, dataset, warm_up).train()
        config = dataclasses.replace(warm_up, num_steps=args.steps, progress=True)
        start = time.perf_counter()
        Trainer(head, target, dataset, config).train()
        seconds = (time.perf_counter() - start) / args.steps
    tokens = args.batch_size * args.sequence_length
    anchors = args.batch_size * args.num_anchors
    row = {
        "target": "smollm2-135m-shape",
        "block_size": 7,
        "draft_layers": 1,
        "sequence_length": args.sequence_length,
        "batch_size": args.batch_size,
        "num_anchors": args.num_anchors,
        "seconds_per_step": round(seconds, 2),
        "tokens_per_second": round(tokens / seconds, 1),
        "anchors_per_second": round(anchors / seconds, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }
    write_results(RESULTS, [row], torch.device("cpu"), ["float32, full vocabulary, random documents"])
    print(row)


if __name__ == "__main__":
    main()
