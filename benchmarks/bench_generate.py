"""The peer benchmark: SmolLM2-135M-Instruct on real prompts, every system measured in the same run.

Systems (same target, precision, prompts and decoding settings):

* ``plain``: ``target.generate()``, the baseline every ratio is taken against;
* ``plain-packed``: ``target.generate()`` inside :func:`spark_generate.packed_linears`, i.e. plain
  decoding with the oneDNN linears the DSpark systems run on a CPU by default: how much of their
  ratio the kernels alone give;
* ``prompt-lookup``: Transformers' prompt-lookup decoding (``prompt_lookup_num_tokens``; it
  supports batch 1 only, so larger batches are skipped);
* ``dflash``: the DFlash ablation, a head trained with the same recipe but ``markov_rank=0`` and no
  confidence head, verifying its whole block;
* ``dspark-fixed``: the shipped DSpark head verifying its whole block;
* ``dspark-goodput``: the same head with the goodput schedule (Algorithm 1) on this machine's cost
  table for each batch size and the shipped STS calibration (the previous recommendation);
* ``dspark``: the same head with the default schedule (:class:`~spark_generate.AdaptiveSchedule`:
  Algorithm 1 on the same costs and calibration, plus plain steps while drafting does not pay).

Cost tables come from :func:`spark_generate.profiling.cost_table_for` (profiled once per batch size
and cached), filled before any timing.

Prompts: the evaluation split of :mod:`spark_generate.prompt_sets` (HumanEval for code,
GSM-Symbolic for math, MT-Bench first turns for chat), in the chat template, never seen in training.
Each (domain, temperature, batch size) cell runs the same prompts (the first ``--prompts``, or
one full batch when that is more) through every system in left-padded batches, stopping at EOS
or ``--max-new-tokens``, ``--repeats`` times with the systems interleaved (the run with the median
time is kept; this host's speed drifts by 5-20% within minutes), and records per system:

* ``ttft_ms``: time to first token, the mean wall time of ``generate(max_new_tokens=1)`` per batch;
* ``request_tok_s``: mean over requests of its new tokens divided by its latency;
* ``throughput_tok_s``: all new tokens divided by all wall time (aggregate throughput);
* ``p95_latency_s``: 95th percentile of request latency (a request returns with its batch);
* ``tau``: tokens committed per target forward after the prefill (1 for plain decoding), and the
  per-position acceptance of the heads;
* ``speedup``: throughput over plain's throughput in the same cell;
* ``identical``: under greedy decoding, how many requests match plain ``generate()`` token for token.

Results: ``benchmarks/results/generate_smollm2_<device>.csv`` (with provenance lines), a markdown
table ``.md`` and a chart ``.png`` next to it.

    python benchmarks/bench_generate.py                      # the recorded run
    python benchmarks/bench_generate.py --repeats 3          # steadier cells, three times as long
    python benchmarks/bench_generate.py --prompts 2 --max-new-tokens 16 --batch-sizes 1 --temperatures 0
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _env import write_results
from tqdm.auto import tqdm

from spark_generate import DSparkForCausalLM, packed_linears, prompt_sets, zoo
from spark_generate.heads import DSparkHead
from spark_generate.profiling import cache_folder, cost_table_for
from spark_generate.schedule import AdaptiveSchedule, FixedLength, GoodputSchedule, load_calibration
from spark_generate.training.regenerate import prompt_ids

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
DSPARK_HEAD = ROOT / "model_cards" / "smollm2-135m-instruct-dspark"
DFLASH_HEAD = cache_folder() / "runs" / "smollm2" / "dflash-export"  # where the recipe exports it
SYSTEMS = ("plain", "plain-packed", "prompt-lookup", "dflash", "dspark-fixed", "dspark-goodput", "dspark")
DEFAULT_SYSTEMS = ("plain", "plain-packed", "prompt-lookup", "dflash", "dspark-fixed", "dspark")
PROMPT_LOOKUP = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}


@dataclass(frozen=True)
class Row:
    """One CSV row: one system in one (domain, temperature, batch size) cell."""

    domain: str
    temperature: float
    batch_size: int
    system: str
    requests: int
    new_tokens: int
    ttft_ms: float
    request_tok_s: float
    throughput_tok_s: float
    p95_latency_s: float
    tau: float
    acceptance: str
    speedup: float
    identical: str


@dataclass
class Outcome:
    """What one system produced on one cell's prompts."""

    sequences: list[list[int]]
    latencies: list[float]
    seconds: float
    ttft_seconds: list[float]
    tau: float
    acceptance: list[float]


class ForwardCounter:
    """Counts the target's forward passes, by a hook (tokens per forward for prompt lookup)."""

    def __init__(self, module: torch.nn.Module):
        self.count = 0
        module.register_forward_pre_hook(self._count)

    def _count(self, *args: object) -> None:
        self.count += 1


def left_pad(prompts: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    lengths = torch.tensor([len(ids) for ids in prompts])
    return {"input_ids": input_ids, "attention_mask": (torch.arange(width) >= width - lengths[:, None]).long()}


def answers(output: torch.Tensor, width: int, eos: int) -> list[list[int]]:
    """New tokens of each row, cut after the first EOS."""
    rows = []
    for row in output[:, width:].tolist():
        rows.append(row[: row.index(eos) + 1] if eos in row else row)
    return rows


class Bench:
    """The target, both heads and the per-batch-size schedules, loaded once for the whole run."""

    def __init__(self, args: argparse.Namespace):
        self.target, self.tokenizer = zoo.load("smollm2-135m-instruct")
        self.eos, self.pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id or self.tokenizer.eos_token_id
        self.model = DSparkForCausalLM(self.target)
        self.counter = ForwardCounter(self.target)
        self.heads = {"dspark": DSparkHead.from_pretrained(DSPARK_HEAD).attach(self.target).float().eval()}
        if Path(args.dflash_head).is_dir():
            self.heads["dflash"] = DSparkHead.from_pretrained(args.dflash_head).attach(self.target).float().eval()
        self.temperatures = load_calibration(DSPARK_HEAD / "calibration.json")
        self.args = args

    def schedule(self, system: str, batch_size: int, greedy: bool) -> FixedLength | GoodputSchedule | AdaptiveSchedule:
        """The schedule of a DSpark system at this batch size (cost tables: this machine's, cached)."""
        if system in ("dflash", "dspark-fixed"):
            return FixedLength()
        costs = cost_table_for(self.target, self.heads["dspark"], batch_size, greedy)
        if system == "dspark-goodput":
            return GoodputSchedule(costs, self.temperatures)
        return AdaptiveSchedule(costs, self.temperatures)

    def generate(self, system: str, inputs: dict[str, torch.Tensor], settings: dict, seed: int):
        """One ``generate`` call of a system; returns the output sequences and the DSpark statistics."""
        if system in ("plain", "plain-packed", "prompt-lookup"):
            torch.manual_seed(seed)
            extra = PROMPT_LOOKUP if system == "prompt-lookup" else {}
            with packed_linears(self.target, enabled=system == "plain-packed"):
                return self.target.generate(**inputs, **settings, **extra), None
        head = self.heads["dflash" if system == "dflash" else "dspark"]
        schedule = self.schedule(system, inputs["input_ids"].shape[0], not settings.get("do_sample", False))
        output = self.model.generate(
            **inputs, **settings, assistant=head, schedule=schedule, seed=seed, return_dict_in_generate=True
        )
        return output.sequences, output.dspark_stats

    def run(self, system: str, prompts: list[list[int]], batch_size: int, temperature: float) -> Outcome:
        """Runs a system over the prompts in batches, timing each batch and its first token."""
        settings = {"max_new_tokens": self.args.max_new_tokens, "pad_token_id": self.pad, "eos_token_id": self.eos}
        if temperature > 0:
            settings.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            settings.update(do_sample=False)
        if system in ("dspark-goodput", "dspark"):  # profile the costs of every batch shape before any timing
            for first in range(0, len(prompts), batch_size):
                self.schedule(system, len(prompts[first : first + batch_size]), temperature == 0)
        sequences, latencies, ttft = [], [], []
        forwards = committed = 0
        accepted = verified = None
        total = 0.0
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            inputs = left_pad(batch, self.pad)
            width = inputs["input_ids"].shape[1]
            start = time.perf_counter()
            self.generate(system, inputs, {**settings, "max_new_tokens": 1}, seed=first)
            ttft.append(time.perf_counter() - start)
            self.counter.count = 0
            start = time.perf_counter()
            output, stats = self.generate(system, inputs, settings, seed=first)
            seconds = time.perf_counter() - start
            total += seconds
            rows = answers(output, width, self.eos)
            sequences += rows
            latencies += [seconds] * len(rows)
            if stats is None:  # tokens per forward after the prefill, over the batch's longest row
                forwards += self.counter.count - 1
                committed += max(map(len, rows)) - 1
            else:
                forwards += int(stats.num_rounds.sum())
                committed += int((stats.num_accepted + stats.num_rounds).sum())
                accepted = stats.accepted_by_position.sum(0) + (0 if accepted is None else accepted)
                verified = stats.verified_by_position.sum(0) + (0 if verified is None else verified)
        acceptance = [] if accepted is None else (accepted / verified.clamp(min=1)).tolist()
        return Outcome(sequences, latencies, total, ttft, committed / max(forwards, 1), acceptance)

    def available(self, system: str, batch_size: int) -> bool:
        """Whether a system runs at this batch size (prompt lookup: batch 1; dflash: when its head exists)."""
        if system == "prompt-lookup":
            return batch_size == 1
        return system != "dflash" or "dflash" in self.heads


def median_run(outcomes: list[Outcome]) -> Outcome:
    """The run with the median wall time (the faster of two): the outputs are the same in every run."""
    return sorted(outcomes, key=lambda outcome: outcome.seconds)[(len(outcomes) - 1) // 2]


def cell_rows(domain: str, temperature: float, batch_size: int, outcomes: dict[str, Outcome]) -> list[Row]:
    plain = outcomes["plain"]
    plain_throughput = sum(map(len, plain.sequences)) / plain.seconds
    rows = []
    for system, outcome in outcomes.items():
        new_tokens = sum(map(len, outcome.sequences))
        per_request = [len(seq) / latency for seq, latency in zip(outcome.sequences, outcome.latencies, strict=True)]
        identical = ""
        if temperature == 0:
            same = sum(a == b for a, b in zip(outcome.sequences, plain.sequences, strict=True))
            identical = f"{same}/{len(plain.sequences)}"
        rows.append(
            Row(
                domain=domain, temperature=temperature, batch_size=batch_size, system=system,
                requests=len(outcome.sequences), new_tokens=new_tokens,
                ttft_ms=round(1000 * statistics.mean(outcome.ttft_seconds), 1),
                request_tok_s=round(statistics.mean(per_request), 2),
                throughput_tok_s=round(new_tokens / outcome.seconds, 2),
                p95_latency_s=round(float(torch.tensor(outcome.latencies).quantile(0.95)), 2),
                tau=round(outcome.tau, 3), acceptance=" ".join(f"{rate:.2f}" for rate in outcome.acceptance),
                speedup=round(new_tokens / outcome.seconds / plain_throughput, 3), identical=identical,
            )
        )  # fmt: skip
    return rows


def markdown(rows: list[Row]) -> str:
    """The results as one markdown table (speed-ups against plain generate() in the same cell)."""
    lines = [
        "| domain | T | batch | system | tau | tok/s per request | throughput tok/s | speed-up | TTFT ms | "
        "p95 latency s | greedy identical |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row.domain} | {row.temperature:g} | {row.batch_size} | {row.system} | {row.tau:.2f} | "
            f"{row.request_tok_s:.1f} | {row.throughput_tok_s:.1f} | {row.speedup:.2f}x | {row.ttft_ms:.0f} | "
            f"{row.p95_latency_s:.2f} | {row.identical or '-'} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    """Speed-up per domain at batch 1 (greedy and T=1), throughput by batch size, acceptance by position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [system for system in SYSTEMS if any(row.system == system for row in rows)]
    temperatures = sorted({row.temperature for row in rows})
    domains = list(dict.fromkeys(row.domain for row in rows))
    figure, axes = plt.subplots(1, len(temperatures) + 2, figsize=(5 * (len(temperatures) + 2), 4))
    width = 0.8 / len(systems)
    for axis, temperature in zip(axes, temperatures, strict=False):
        for index, system in enumerate(systems):
            values = [
                next((r.speedup for r in rows if (r.domain, r.temperature, r.batch_size, r.system)
                      == (domain, temperature, 1, system)), 0.0)
                for domain in domains
            ]  # fmt: skip
            axis.bar([d + index * width for d in range(len(domains))], values, width, label=system)
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set_xticks([d + width * (len(systems) - 1) / 2 for d in range(len(domains))], domains)
        axis.set_title(f"speed-up vs plain generate(), batch 1, T={temperature:g}")
    axes[0].legend(fontsize=8)
    throughput_axis, acceptance_axis = axes[-2], axes[-1]
    for system in systems:
        points = sorted(
            (r.batch_size, r.throughput_tok_s) for r in rows if r.system == system and r.temperature == temperatures[0]
        )
        by_batch: dict[int, list[float]] = {}
        for batch_size, value in points:
            by_batch.setdefault(batch_size, []).append(value)
        throughput_axis.plot(list(by_batch), [statistics.mean(v) for v in by_batch.values()], marker="o", label=system)
        curves = [r.acceptance for r in rows if r.system == system and r.acceptance and r.batch_size == 1]
        if curves:
            table = torch.tensor([[float(x) for x in curve.split()] for curve in curves])
            positions = range(1, table.shape[1] + 1)
            acceptance_axis.plot(positions, table.mean(0).tolist(), marker="o", label=system)
    throughput_axis.set(xscale="log", xlabel="batch size", ylabel="tokens/s (all domains, mean)")
    throughput_axis.set_title(f"aggregate throughput, T={temperatures[0]:g}")
    throughput_axis.legend(fontsize=8)
    acceptance_axis.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1))
    acceptance_axis.set_title("per-position acceptance, batch 1 (mean of cells)")
    acceptance_axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domains", nargs="+", default=list(prompt_sets.DOMAINS), choices=prompt_sets.DOMAINS)
    parser.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per cell (at least one full batch)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="new tokens per request at most")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 means greedy")
    parser.add_argument("--dflash-head", default=str(DFLASH_HEAD), help="the DFlash ablation head folder")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each system per cell, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--note", default="", help="free text for the header, e.g. machine load")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bench = Bench(args)
    rows: list[Row] = []
    cells = [(d, t, b) for d in args.domains for t in args.temperatures for b in args.batch_sizes]
    with torch.no_grad():
        for domain, temperature, batch_size in tqdm(cells, desc="cells"):
            texts = prompt_sets.load_prompts(domain, "eval")[: max(args.prompts, batch_size)]
            prompts = [prompt_ids(bench.tokenizer, text) for text in texts]
            systems = ["plain"] + [s for s in args.systems if s != "plain" and bench.available(s, batch_size)]
            bench.run("plain", prompts[:1], 1, temperature)  # warm-up
            runs: dict[str, list[Outcome]] = {system: [] for system in systems}
            for _ in range(args.repeats):  # interleaved, so a slow spell of the host reaches every system alike
                for system in systems:
                    runs[system].append(bench.run(system, prompts, batch_size, temperature))
            outcomes = {system: median_run(system_runs) for system, system_runs in runs.items()}
            cell = cell_rows(domain, temperature, batch_size, outcomes)
            for row in cell:
                print(row)
            rows += cell
    stem = RESULTS / "generate_smollm2_cpu"
    note = (
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized), float32, {args.threads} torch threads, "
        f"{args.prompts} prompts per cell (one full batch when larger), up to {args.max_new_tokens} new tokens, "
        f"median of {args.repeats} interleaved runs per system; "
        f"{args.note}"
    )
    head_digest = hashlib.sha256((DSPARK_HEAD / "model.safetensors").read_bytes()).hexdigest()
    head = f"head: {DSPARK_HEAD.name}/model.safetensors sha256 {head_digest}"  # the card checks it
    write_results(stem.with_suffix(".csv"), [asdict(row) for row in rows], torch.device("cpu"), [note, head])
    stem.with_suffix(".md").write_text(markdown(rows))
    plot(rows, stem.with_suffix(".png"))
    print(markdown(rows))


if __name__ == "__main__":
    main()
