"""Tokens per second and tau of DSpark generation against plain ``generate()``, in the same run.

For a tiny random Llama and a random SmolLM2-135M-shaped Llama (hidden 576, 30 layers, 9 heads,
3 KV heads, vocabulary 49,152), with an *untrained* head (1 draft layer), this runs greedy
generation of ``--new-tokens`` tokens after random prompts of ``--prompt`` tokens, at batch sizes
1, 4 and 16, first with plain ``target.generate()`` and then with
``DSparkForCausalLM(target).generate(..., assistant=head, schedule=FixedLength())`` (every round
drafts, so the machinery is measured, not the adaptive schedule stepping aside), and records:

* ``plain_tok_s`` / ``dspark_tok_s``: new tokens (all rows) per second, and their ratio;
* ``tau``: mean tokens committed per speculative step (an untrained head gives about 1);
* ``target_step_ms``: median target forward of plain decoding (one token per row);
* ``overhead_ms_per_round``: DSpark wall time minus the time inside target forwards, per round
  (drafting, scheduling, processors, rejection sampling, commit and cache bookkeeping), split into
  ``draft_ms_per_round`` (the head's backbone pass, Markov steps and scheduling) and the rest,
  ``bookkeeping_ms_per_round``;
* ``overhead_vs_step``: that overhead as a fraction of one target decode step;
* ``plain_ms_per_step``: plain ``generate()``'s own wall time outside the target forwards, per
  decoding step (its processors, stopping criteria and input bookkeeping);
* ``loop_plain_ms_per_step``: the same for the default loop (head and suffix drafting on,
  :class:`~spark_generate.AdaptiveSchedule`) when drafting never pays, so every round is a plain
  step: the schedule plans with a cost table on which any wider forward costs more than it could
  emit and the head's pass costs a thousand forwards, so it never probes (``max_backoff`` out of
  reach), while the suffix drafter still indexes and proposes every round. What a plain step of
  the loop costs beyond plain decoding (the rounds where speculation does not pay, e.g. batch 16
  on this CPU) is ``loop_plain_ms_per_step - plain_ms_per_step``; ``loop_plain_vs_plain`` is the
  loop's tokens per second over plain decoding's in that setting.

An untrained head only exercises the machinery: its drafts are rejected, so DSpark is slower than
plain decoding here by construction; the overhead fraction is the figure to watch. Results go to
``benchmarks/results/overhead_cpu.csv`` with provenance lines at the top.
Run: ``python benchmarks/bench_overhead.py`` (add ``--models tiny-llama`` for a quick run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

import torch
from _env import smollm2_shaped_config, write_results
from transformers import LlamaConfig, LlamaForCausalLM

from spark_generate import AdaptiveSchedule, CostTable, DSparkForCausalLM, FixedLength
from spark_generate.heads import DSparkHead
from spark_generate.suffix import MAX_DRAFT_TOKENS

RESULTS = Path(__file__).parent / "results"
T = TypeVar("T")
MODELS = {
    "tiny-llama": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None,
    ),
    "smollm2-135m-shape": smollm2_shaped_config(pad_token_id=0, eos_token_id=None),
}  # fmt: skip


@dataclass(frozen=True)
class Row:
    """One CSV row."""

    model: str
    batch_size: int
    block_size: int
    prompt_length: int
    new_tokens: int
    plain_tok_s: float
    dspark_tok_s: float
    speedup: float
    tau: float
    rounds: int
    target_step_ms: float
    overhead_ms_per_round: float
    draft_ms_per_round: float
    bookkeeping_ms_per_round: float
    overhead_vs_step: float
    plain_ms_per_step: float
    loop_plain_ms_per_step: float
    loop_plain_vs_plain: float


def never_drafting(batch_size: int, block_size: int, suffix_tokens: int) -> AdaptiveSchedule:
    """The default schedule on costs where no draft can pay: every round is a plain step.

    A forward over ``n`` tokens costs ``n`` single-row steps (so ``k`` drafts per row cost
    ``1 + k`` plain steps and can emit at most ``1 + k`` tokens: a tie, which plain steps win), and
    the head's pass a thousand forwards; ``max_backoff`` out of reach keeps it from probing.
    """
    widest = batch_size * (1 + max(block_size, suffix_tokens))
    table = CostTable(tuple(range(1, widest + 1)), tuple(float(n) for n in range(1, widest + 1)), 1000.0 * widest)
    return AdaptiveSchedule(cost_table=table, max_backoff=2**62)


class ForwardTimer:
    """Accumulates the wall time spent inside a module's forward, by hooks."""

    def __init__(self, module: torch.nn.Module):
        self.durations: list[float] = []
        self._start = 0.0
        module.register_forward_pre_hook(self._begin)
        module.register_forward_hook(self._end)

    def _begin(self, *args: object) -> None:
        self._start = time.perf_counter()

    def _end(self, *args: object) -> None:
        self.durations.append(time.perf_counter() - self._start)


def fastest(generate: Callable[[], T], timer: ForwardTimer, repeats: int) -> tuple[float, list[float], T]:
    """Runs ``generate`` ``repeats`` times; the fastest run's seconds, target forward times and output."""
    best = None
    for _ in range(repeats):
        timer.durations.clear()
        start = time.perf_counter()
        output = generate()
        seconds = time.perf_counter() - start
        if best is None or seconds < best[0]:
            best = (seconds, list(timer.durations), output)
    return best


def run(model: str, batch_size: int, args: argparse.Namespace) -> Row:
    torch.manual_seed(0)
    target = LlamaForCausalLM(MODELS[model]).eval()
    head = DSparkHead.from_target(target, num_draft_layers=1, block_size=args.block_size).eval()
    timer = ForwardTimer(target)
    input_ids = torch.randint(1, target.config.vocab_size, (batch_size, args.prompt))
    kwargs = {"do_sample": False, "max_new_tokens": args.new_tokens}  # no EOS: every row runs to the end
    wrapped = DSparkForCausalLM(target)
    wrapped.generate(
        input_ids[:, :8], assistant=head, schedule=FixedLength(), max_new_tokens=4
    )  # warm-up of both paths
    target.generate(input_ids[:, :8], max_new_tokens=4)

    plain_seconds, plain_forwards, plain = fastest(lambda: target.generate(input_ids, **kwargs), timer, args.repeats)
    target_step = statistics.median(plain_forwards[1:])
    dspark_seconds, dspark_forwards, out = fastest(
        lambda: wrapped.generate(
            input_ids, assistant=head, schedule=FixedLength(), return_dict_in_generate=True, **kwargs
        ),
        timer,
        args.repeats,
    )
    assert torch.equal(out.sequences, plain), "greedy DSpark output differs from plain generate()"
    schedule = never_drafting(batch_size, args.block_size, MAX_DRAFT_TOKENS)
    loop_seconds, loop_forwards, looped = fastest(
        lambda: wrapped.generate(input_ids, assistant=head, schedule=schedule, return_dict_in_generate=True, **kwargs),
        timer,
        args.repeats,
    )
    assert torch.equal(looped.sequences, plain), "greedy DSpark output differs from plain generate()"
    loop_stats = looped.dspark_stats
    assert torch.equal(loop_stats.num_plain_steps, loop_stats.num_rounds), "the never-drafting schedule drafted"
    steps = len(plain_forwards) - 1  # the prefill, then one forward per decoding step
    plain_step = (plain_seconds - sum(plain_forwards)) / steps
    loop_step = (loop_seconds - sum(loop_forwards)) / (len(loop_forwards) - 1)
    stats = out.dspark_stats
    rounds = int(stats.num_rounds.max())
    overhead = (dspark_seconds - sum(dspark_forwards)) / rounds
    draft = stats.draft_seconds / rounds
    num_new = batch_size * args.new_tokens
    return Row(
        model=model, batch_size=batch_size, block_size=args.block_size, prompt_length=args.prompt,
        new_tokens=args.new_tokens, plain_tok_s=round(num_new / plain_seconds, 1),
        dspark_tok_s=round(num_new / dspark_seconds, 1), speedup=round(plain_seconds / dspark_seconds, 3),
        tau=round(float(stats.tau.mean()), 3), rounds=rounds, target_step_ms=round(1000 * target_step, 2),
        overhead_ms_per_round=round(1000 * overhead, 2), draft_ms_per_round=round(1000 * draft, 2),
        bookkeeping_ms_per_round=round(1000 * (overhead - draft), 2),
        overhead_vs_step=round(overhead / target_step, 3), plain_ms_per_step=round(1000 * plain_step, 2),
        loop_plain_ms_per_step=round(1000 * loop_step, 2), loop_plain_vs_plain=round(plain_seconds / loop_seconds, 3),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prompt", type=int, default=32, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the fastest is kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on a shared machine)")
    parser.add_argument("--note", default="", help="free text for the header, e.g. machine load")
    parser.add_argument("--output", type=Path, default=RESULTS / "overhead_cpu.csv", help="the CSV to write")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with torch.no_grad():
        for model in args.models:
            for batch_size in args.batch_sizes:
                row = run(model, batch_size, args)
                print(row)
                rows.append(row)
    note = (
        f"float32, greedy, untrained head (1 draft layer), {args.threads} torch thread(s), fastest of "
        f"{args.repeats} runs; {args.note}"
    )
    write_results(args.output, [asdict(row) for row in rows], torch.device("cpu"), [note])


if __name__ == "__main__":
    main()
