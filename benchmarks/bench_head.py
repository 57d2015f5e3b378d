"""Parameter counts and CPU latency of a DSpark draft pass against one target decode step.

For a 135M-class target (SmolLM2-135M's shape: hidden 576, 30 layers, vocabulary 49,152) and a
0.5B-class target (Qwen2-0.5B's shape: hidden 896, 24 layers, vocabulary 151,936), both random,
this builds heads with ``DSparkHead.from_target`` and times, with a context of ``--context``
tokens already cached on both sides:

* ``target_decode_ms``: one target forward on one token with its KV cache (cropped back after each
  repetition, so every repetition sees the same cache length);
* ``draft_backbone_ms``: one draft forward for a block of 7 with 4 new context rows (a typical
  round: 3 accepted drafts + the bonus token), then the cache crop back; base logits included;
* ``draft_total_ms``: the same plus the 7 serial Markov/confidence steps (argmax stands in for
  sampling, which is not the head's job).

Each measurement is repeated for 1 thread and for all cores (``--threads``); on a small shared
machine the single-thread numbers are the stable ones. Results go to
``benchmarks/results/head_cpu.csv`` with the hardware, library versions and git
commit in comment lines at the top. Run: ``python benchmarks/bench_head.py``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _env import smollm2_shaped_config, write_results
from transformers import DynamicCache, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from spark_generate.heads import DSparkHead

RESULTS = Path(__file__).parent / "results" / "head_cpu.csv"
BLOCK_SIZE = 7
NEW_CONTEXT_ROWS = 4
TARGETS = {
    "smollm2-135m-shape": (
        LlamaForCausalLM,
        smollm2_shaped_config(pad_token_id=2, eos_token_id=2),
    ),
    "qwen2-0.5b-shape": (
        Qwen2ForCausalLM,
        Qwen2Config(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=True,
            eos_token_id=151643,
        ),
    ),
}  # fmt: skip
HEADS = [(1, None), (1, 32000), (5, None)]  # (draft layers, draft vocabulary size)


@dataclass(frozen=True)
class Row:
    """One CSV row."""

    target: str
    threads: int
    target_params: int
    num_draft_layers: int
    draft_vocab_size: int
    markov_rank: int
    head_trainable_params: int
    backbone_params: int
    markov_params: int
    confidence_params: int
    context_length: int
    block_size: int
    target_decode_ms: float
    draft_backbone_ms: float
    draft_total_ms: float
    backbone_vs_decode: float
    total_vs_decode: float
    disturbed: bool


def interleaved_medians_ms(steps: list[Callable[[], object]], repeats: int) -> list[float]:
    """Times the steps round-robin, so that a change of machine load hits all of them alike."""
    for step in steps * 3:
        step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, samples in zip(steps, times, strict=True):
            start = time.perf_counter()
            step()
            samples.append(time.perf_counter() - start)
    return [1000 * statistics.median(samples) for samples in times]


def measure_undisturbed(
    steps: list[Callable[[], object]], args: argparse.Namespace, reference_decode_ms: float | None
) -> tuple[list[float], bool]:
    """Medians of an attempt whose target decode step is not far slower than the fastest seen.

    On a small shared machine another process can slow a whole attempt down (with several threads
    by far more than its share, through OpenMP barriers), both sides but not proportionally. Such
    an attempt is detected by its decode step against the fastest decode step of the same target,
    and repeated; the best attempt is kept either way, with a flag saying whether it is disturbed.
    """
    attempts: list[list[float]] = []
    for _ in range(args.max_attempts):
        attempts.append(interleaved_medians_ms(steps, args.repeats))
        if reference_decode_ms is None or attempts[-1][0] <= 1.5 * reference_decode_ms:
            return attempts[-1], False
    return min(attempts), True


def target_decode_step(target, context: torch.Tensor) -> Callable[[], object]:
    """One decode step on a cache holding ``context``, cropped back afterwards."""
    cache = DynamicCache(config=target.config)
    target(context, past_key_values=cache)
    token = context[:, -1:]

    def step() -> None:
        target(token, past_key_values=cache)
        cache.crop(-1)  # drop the decoded token again

    return step


def draft_steps(head: DSparkHead, context_length: int) -> tuple[Callable[[], object], Callable[[], object]]:
    """The backbone pass of one round, and the same followed by the serial Markov/confidence steps."""
    width = head.fc.in_features
    cache = head.new_draft_cache()
    anchor_ids = torch.tensor([11])
    block = head.block_input_ids(anchor_ids)
    head(block, torch.tensor([[context_length]]), torch.randn(1, context_length, width), draft_cache=cache)
    new_rows = torch.randn(1, NEW_CONTEXT_ROWS, width)
    anchor = torch.tensor([[context_length + NEW_CONTEXT_ROWS]])
    positions = torch.arange(context_length, context_length + NEW_CONTEXT_ROWS)[None]

    def backbone():
        out = head(block, anchor, new_rows, positions, draft_cache=cache)
        cache.crop(context_length)
        return out

    def full() -> None:
        out = backbone()
        prev, state = anchor_ids, out.first_markov_state(0)
        for j in range(head.config.num_draft_tokens):
            step = head.draft_step(out.base_logits[:, 0, j], out.draft_hidden[:, 0, j], prev, state)
            prev, state = head.draft_to_target_ids(step.draft_logits.argmax(-1)), step.markov_state

    return backbone, full


def count(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=512, help="cached context length")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count()], help="torch threads")
    parser.add_argument("--max-attempts", type=int, default=4, help="re-measure a disturbed configuration")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    fastest_decode_ms: dict[str, float] = {}
    with torch.no_grad():
        for name, (model_class, config) in TARGETS.items():
            target = model_class(config).eval()
            target_params = sum(p.numel() for p in target.parameters())
            context = torch.randint(0, config.vocab_size, (1, args.context))
            heads = [
                DSparkHead.from_target(target, num_draft_layers=layers, block_size=BLOCK_SIZE, draft_vocab_size=vocab)
                for layers, vocab in HEADS
            ]
            for threads, head in itertools.product(args.threads, heads):
                torch.set_num_threads(threads)
                steps = [target_decode_step(target, context), *draft_steps(head, args.context)]
                medians, disturbed = measure_undisturbed(steps, args, fastest_decode_ms.get(name))
                decode_ms, backbone_ms, total_ms = medians
                fastest_decode_ms[name] = min(decode_ms, fastest_decode_ms.get(name, decode_ms))
                markov, confidence, total = count(head.markov_head), count(head.confidence_head), count(head)
                row = Row(
                    target=name,
                    threads=threads,
                    target_params=target_params,
                    num_draft_layers=head.config.num_draft_layers,
                    draft_vocab_size=head.config.draft_vocab_size,
                    markov_rank=head.config.markov_rank,
                    head_trainable_params=total,
                    backbone_params=total - markov - confidence,
                    markov_params=markov,
                    confidence_params=confidence,
                    context_length=args.context,
                    block_size=BLOCK_SIZE,
                    target_decode_ms=round(decode_ms, 2),
                    draft_backbone_ms=round(backbone_ms, 2),
                    draft_total_ms=round(total_ms, 2),
                    backbone_vs_decode=round(backbone_ms / decode_ms, 3),
                    total_vs_decode=round(total_ms / decode_ms, 3),
                    disturbed=disturbed,
                )
                rows.append(row)
                print(row)
    note = (
        "float32, batch 1, medians; the target decode step and the draft passes are timed round-robin so "
        "that both see the same machine load; a configuration whose decode step is over 1.5x the fastest "
        "seen for that target is re-measured (flag: disturbed)"
    )
    write_results(RESULTS, [asdict(row) for row in rows], torch.device("cpu"), [note])


if __name__ == "__main__":
    main()
