"""Regeneration throughput on CPU: the target answering training prompts, in answer tokens per second.

SmolLM2-135M-Instruct (the zoo model, float32) answers the first ``--num-prompts`` prompts of
:func:`spark_generate.prompt_sets.mixed_training_prompts` (code, math and chat interleaved) greedily,
up to ``--max-new-tokens`` tokens each, two ways, in one process on the same prompts:

* ``generate()``: what regeneration did before, plain ``generate()`` on batches of
  ``--baseline-batch-size`` prompts in their given order, left-padded; finished rows keep being
  computed until the longest answer of their batch ends.
* ``regenerate``: :func:`spark_generate.training.regenerate.regenerate` at each ``--batch-sizes``:
  prompts sorted by length within windows of batches, and rows leaving the batch as they end.

Time is wall time from the first prompt to the last answer (tokenization and writing included,
model loading excluded). ``answers_equal_to_generate`` counts the prompts whose answer equals that
of plain ``generate()``: greedy decoding is the same, but batches of different composition may round
differently, which can flip a near-tie.
Results go to ``benchmarks/results/regenerate_cpu.csv`` with hardware, versions and commit.

    python benchmarks/bench_regenerate.py --num-prompts 64 --threads 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from _env import write_results

from spark_generate import prompt_sets, zoo
from spark_generate.training.regenerate import SamplingSettings, prompt_ids, regenerate

RESULTS = Path(__file__).resolve().parent / "results" / "regenerate_cpu.csv"
TARGET = "smollm2-135m-instruct"


@torch.inference_mode()
def plain_generate(target, tokenizer, encoded: list[list[int]], settings: SamplingSettings, batch_size: int):
    """Answers with plain ``generate()`` on left-padded batches in the given order (the old regeneration)."""
    eos = tokenizer.eos_token_id
    answers = []
    for first in range(0, len(encoded), batch_size):
        batch = encoded[first : first + batch_size]
        width = max(map(len, batch))
        input_ids = torch.tensor([[eos] * (width - len(ids)) + ids for ids in batch])
        lengths = torch.tensor([len(ids) for ids in batch])
        attention_mask = (torch.arange(width) >= width - lengths[:, None]).long()
        output = target.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=settings.max_new_tokens,
            do_sample=False, pad_token_id=eos, eos_token_id=eos,
        )  # fmt: skip
        for row in output[:, width:].tolist():
            answers.append(row[: row.index(eos) + 1] if eos in row else row)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts answered by each method")
    parser.add_argument("--max-new-tokens", type=int, default=192, help="longest answer (the recipe's)")
    parser.add_argument("--baseline-batch-size", type=int, default=32, help="batch of plain generate()")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64], help="batch sizes of regenerate")
    parser.add_argument("--skip-baseline", action="store_true", help="measure regenerate only")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--note", default="", help="a note for the results file (e.g. that the machine was shared)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, tokenizer = zoo.load(TARGET)
    prompts = prompt_sets.mixed_training_prompts()[: args.num_prompts]
    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, do_sample=False)
    encoded = [prompt_ids(tokenizer, prompt) for prompt in prompts]
    prompt_tokens = sum(map(len, encoded))
    results = {}
    if not args.skip_baseline:
        start = time.perf_counter()
        results[("generate()", args.baseline_batch_size)] = (
            plain_generate(target, tokenizer, encoded, settings, args.baseline_batch_size),
            time.perf_counter() - start,
        )
    for batch_size in args.batch_sizes:
        with tempfile.TemporaryDirectory() as folder:
            start = time.perf_counter()
            path = regenerate(target, tokenizer, prompts, Path(folder) / "data.jsonl", settings, batch_size).path
            seconds = time.perf_counter() - start
            records = sorted(map(json.loads, path.read_text().splitlines()), key=lambda record: record["index"])
        answers = [record["input_ids"][len(ids) :] for record, ids in zip(records, encoded, strict=True)]
        results[("regenerate", batch_size)] = (answers, seconds)
    reference = None if args.skip_baseline else next(iter(results.values()))[0]
    rows = []
    for (method, batch_size), (answers, seconds) in results.items():
        answer_tokens = sum(map(len, answers))
        rows.append({
            "target": TARGET, "method": method, "batch_size": batch_size, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "prompt_tokens": prompt_tokens, "answer_tokens": answer_tokens,
            "seconds": round(seconds, 1), "answer_tokens_per_second": round(answer_tokens / seconds, 1),
            "answers_equal_to_generate": "" if reference is None else sum(map(list.__eq__, answers, reference)),
        })  # fmt: skip
        print(rows[-1])
    notes = ["float32, greedy, SmolLM2-135M-Instruct (GGUF Q4_1 de-quantized)", *([args.note] if args.note else [])]
    write_results(RESULTS, rows, torch.device("cpu"), notes)


if __name__ == "__main__":
    main()
