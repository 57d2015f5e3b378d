r"""The peer benchmark: SmolLM2-135M-Instruct on real prompts, every system measured in the same run.

Systems (same target, precision, prompts and decoding settings):

* ``plain``: ``target.generate()``, the baseline every ``speedup`` is taken against;
* ``plain-packed``: ``target.generate()`` inside :func:`spark_generate.packed_linears`, i.e. plain
  decoding with the oneDNN linears the DSpark systems run on a CPU by default: how much of their
  ratio the kernels alone give (``vs_plain_packed`` is taken against it);
* ``plain-compiled`` (only with ``--compile``): ``target.generate()`` with a static cache and the
  decoding forward compiled by ``torch.compile`` (Transformers' automatic compilation, which needs
  its ``CompileConfig`` flagged for a CPU); each batch runs once untimed first, and ``compile_s``
  records how much longer that pass took than the timed one (the compilation, excluded from the
  timing). A failure to compile is recorded in the results' header and the system skipped;
* ``prompt-lookup`` and ``prompt-lookup-packed``: Transformers' prompt-lookup decoding
  (``prompt_lookup_num_tokens``), stock and inside :func:`~spark_generate.packed_linears`; it
  supports batch 1 only, so larger batches are skipped;
* ``suffix``: DSpark decoding without a head, drafting from the suffix index alone
  (``assistant=None, suffix=True``; :mod:`spark_generate.suffix`), default schedule;
* ``dflash``: the DFlash ablation, a head trained with the same recipe but ``markov_rank=0`` and no
  confidence head, verifying its whole block (``suffix=False``); skipped when its folder is missing;
* ``dspark-fixed``: the shipped DSpark head verifying its whole block (``suffix=False``);
* ``dspark-goodput``: the head with the goodput schedule (Algorithm 1) on this machine's cost
  table for each batch size and the shipped STS calibration (``suffix=False``; not run by default);
* ``dspark-head``: the head with the default schedule (:class:`~spark_generate.AdaptiveSchedule`)
  and suffix drafting off (``suffix=False``): the default before suffix drafting;
* ``dspark``: the default, ``generate(assistant=head)``: the head and the suffix drafter chosen per
  row and round, or a plain step, by the default schedule (``suffix=None``).

Cost tables (:func:`spark_generate.profiling.cost_table_for`, profiled once per batch size and
cached) are filled before any timing, by one untimed ``generate(max_new_tokens=1)`` of each
DSpark system and batch size.

Domains: the evaluation split of :mod:`spark_generate.prompt_sets` (HumanEval for ``code``,
GSM-Symbolic for ``math``, MT-Bench first turns for ``chat``) and ``copy``, the copy-heavy
conversations of :mod:`spark_generate.copy_heavy` (code returned with a change, paragraphs
reformatted, records converted, earlier answers repeated; multi-turn included), all in the chat
template with a generation prompt, never seen in training. Each (domain, temperature, batch size)
cell runs the same prompts (the first ``--prompts``, or one full batch when that is more) through
every system in left-padded batches, stopping at EOS or ``--max-new-tokens`` (sampled cells suppress
EOS with ``min_new_tokens``, so every system does the same work: a sample that ends early would
otherwise count as a slower system), ``--repeats`` times
with the systems interleaved, in alternating order (A B C, C B A, A B C, ...; the run with the
median time is kept; this host's speed drifts by 5-20% within minutes), and records per system:

* ``ttft_ms``: time to first token, the mean wall time of ``generate(max_new_tokens=1)`` per batch;
* ``request_tok_s``: mean over requests of its new tokens divided by its latency;
* ``throughput_tok_s``: all new tokens divided by all wall time (aggregate throughput);
* ``p95_latency_s``: 95th percentile of request latency (a request returns with its batch);
* ``tau``: tokens committed per target forward after the prefill (1 for plain decoding), and the
  per-position acceptance of the drafted systems (``-`` for a draft slot never verified);
* ``speedup`` and ``vs_plain_packed``: throughput over plain's and over plain-packed's, the median
  over the repeats of the ratio to that system's run in the same repeat. With an even number of
  repeats a drift of the host's speed that is steady over the cell cancels from these ratios (each
  pair of systems runs once in each order), so ``--repeats 4`` is the recording's setting; a ratio
  may therefore differ from the ratio of the throughput columns, which are the median runs';
* ``identical``: under greedy decoding, how many requests match plain ``generate()`` token for token;
* ``drafters``: per drafter (head, suffix, and the plain steps), ``row-rounds/acceptance/tokens per
  second``, from the generation's per-source statistics (``head 40/0.45/18.2; plain 12/-/11.0``);
* ``compile_s``: the compilation excluded from ``plain-compiled``'s timing (0 for the others).

Results: ``generate_smollm2_cpu.csv`` (with provenance lines), a markdown table per domain ``.md``
and a chart ``.png`` (speed-up per domain, temperature and batch size; acceptance by draft
position) in ``--output`` (default ``benchmarks/results``).

All four domains, greedy and T = 1, batch 1/4/16, the default systems, one run per system per
cell: about 70 minutes on the project's 2-core CPU (the three-domain run of six systems took 33
minutes; a fourth domain and three more systems make it about twice that). The recording runs
``--repeats 4 --compile``, about five hours: ``--compile`` adds the compilation of each batch
shape, minutes each.
A run longer than a working session is taken in parts: ``--max-minutes`` stops after the cell during
which the budget ran out (each call measures at least one), every
finished cell is kept in ``generate_smollm2_cpu.cells.json`` (written atomically, with the run's
settings, the head's digest, a digest of the ``spark_generate`` sources but ``training/`` and the
processor), and the same command continues with the next cell; a run of other settings, another head
or changed sources starts over. A session on another processor starts that processor's own
recording beside the first (never mixing machines in one table) and continues it when it gets that
processor again.
Every ratio is taken within a cell, whose systems always run in one process, and every system runs
with glibc keeping freed memory for reuse (``--allocator retain``,
:func:`spark_generate.retain_freed_memory`; ``--allocator default`` leaves glibc's defaults): with
the defaults a batch-16 call spends seconds faulting in the buffers the previous layer freed, which
moved batch-16 ratios by about ±15% between identical systems.

    python benchmarks/bench_generate.py                      # one run per system per cell
    python benchmarks/bench_generate.py --repeats 4 --compile --max-minutes 150   # the recording; rerun to continue
    python benchmarks/bench_generate.py --prompts 1 --max-new-tokens 8 --batch-sizes 1 --temperatures 0 \
        --domains copy code --output /tmp/bench                  # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from _env import hardware, write_results
from tqdm.auto import tqdm
from transformers import CompileConfig

import spark_generate
from spark_generate import DSparkForCausalLM, copy_heavy, packed_linears, prompt_sets, zoo
from spark_generate.config import cache_folder, retain_freed_memory, write_json_atomically
from spark_generate.heads import DSparkHead
from spark_generate.profiling import cost_table_for
from spark_generate.schedule import FixedLength, GoodputSchedule, load_calibration
from spark_generate.telemetry import DraftSource, SpeculativeStats
from spark_generate.training.regenerate import prompt_ids

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
DSPARK_HEAD = ROOT / "model_cards" / "smollm2-135m-instruct-dspark"
DFLASH_HEAD = cache_folder() / "runs" / "smollm2" / "dflash-export"  # where the recipes export it (both)
DOMAINS = (*prompt_sets.DOMAINS, "copy")
PLAIN_SYSTEMS = ("plain", "plain-packed", "plain-compiled", "prompt-lookup", "prompt-lookup-packed")
SUFFIX_SETTING = {
    "suffix": True, "dflash": False, "dspark-fixed": False, "dspark-goodput": False, "dspark-head": False,
    "dspark": None,
}  # fmt: skip
"""The ``suffix=`` argument of each DSpark system (None: the default, on beside the head)."""
SYSTEMS = (*PLAIN_SYSTEMS, *SUFFIX_SETTING)
DEFAULT_SYSTEMS = (
    "plain", "plain-packed", "prompt-lookup", "prompt-lookup-packed", "suffix", "dflash", "dspark-fixed",
    "dspark-head", "dspark",
)  # fmt: skip
PROMPT_LOOKUP = {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 2}
DRAFTERS = (DraftSource.HEAD, DraftSource.SUFFIX, DraftSource.PLAIN)


def compiled_settings() -> dict[str, object]:
    """``generate()`` settings that compile the decoding forward over a static cache, on a CPU too."""
    config = CompileConfig(mode="default")  # "reduce-overhead" means CUDA graphs
    config._compile_all_devices = True  # Transformers compiles on accelerators only, unless this flag is set
    return {"cache_implementation": "static", "compile_config": config}


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
    vs_plain_packed: float | None
    identical: str
    drafters: str
    compile_s: float


@dataclass
class Outcome:
    """What one system produced on one cell's prompts."""

    sequences: list[list[int]]
    latencies: list[float]
    seconds: float
    ttft_seconds: list[float]
    tau: float
    acceptance: list[float | None]
    drafters: str
    compile_seconds: float = 0.0


class ForwardCounter:
    """Counts a module's forward passes within ``with counter:`` (tokens per forward for prompt lookup)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.count = 0

    def __enter__(self) -> ForwardCounter:
        self.count = 0
        self._handle = self.module.register_forward_pre_hook(self._count)
        return self

    def __exit__(self, *exception: object) -> None:
        self._handle.remove()

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


def source_counts(stats: SpeculativeStats) -> torch.Tensor:
    """``[4, S]`` float64: row-rounds, drafts verified, drafts accepted and seconds per :class:`DraftSource`."""
    counts = (stats.rounds_by_source, stats.drafted_by_source, stats.accepted_by_source, stats.seconds_by_source)
    return torch.stack([count.double() for count in counts])


def drafter_summary(counts: torch.Tensor) -> str:
    """``source rounds/acceptance/tokens per second`` for each source that ran, from :func:`source_counts`."""
    parts = []
    for source in DRAFTERS:
        rounds, drafted, accepted, seconds = counts[:, source].tolist()
        if rounds:
            acceptance = f"{accepted / drafted:.2f}" if drafted else "-"
            speed = f"{(rounds + accepted) / seconds:.1f}" if seconds > 0 else "-"
            parts.append(f"{source.name.lower()} {rounds:.0f}/{acceptance}/{speed}")
    return "; ".join(parts)


class Bench:
    """The target, the heads and the calibration, loaded once for the whole run, and the systems' calls."""

    def __init__(self, args: argparse.Namespace):
        self.target, self.tokenizer = zoo.load("smollm2-135m-instruct")
        self.eos, self.pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id or self.tokenizer.eos_token_id
        self.model = DSparkForCausalLM(self.target)
        self.counter = ForwardCounter(self.target)
        self.heads = {"dspark": DSparkHead.from_pretrained(DSPARK_HEAD).attach(self.target).float().eval()}
        if Path(args.dflash_head).is_dir():
            self.heads["dflash"] = DSparkHead.from_pretrained(args.dflash_head).attach(self.target).float().eval()
        self.temperatures = load_calibration(DSPARK_HEAD / "calibration.json")
        self.compiled = compiled_settings()
        self.failures: dict[str, str] = {}
        self.args = args

    def schedule(self, system: str, batch_size: int, greedy: bool) -> FixedLength | GoodputSchedule | None:
        """The schedule of a DSpark system at this batch size; None: the default (cost tables: this machine's)."""
        if system in ("dflash", "dspark-fixed"):
            return FixedLength()
        if system == "dspark-goodput":
            return GoodputSchedule(
                cost_table_for(self.target, self.heads["dspark"], batch_size, greedy), self.temperatures
            )
        return None

    def generate(
        self, system: str, inputs: dict[str, torch.Tensor], settings: dict, seed: int
    ) -> tuple[torch.Tensor, SpeculativeStats | None]:
        """One ``generate`` call of a system; returns the output sequences and the DSpark statistics."""
        if system in PLAIN_SYSTEMS:
            torch.manual_seed(seed)
            lookup = system.startswith("prompt-lookup")
            extra = PROMPT_LOOKUP if lookup else self.compiled if system == "plain-compiled" else {}
            # Forwards are counted for prompt lookup only: a hook added per call would recompile plain-compiled.
            counting = self.counter if lookup else contextlib.nullcontext()
            with packed_linears(self.target, enabled=system.endswith("-packed")), counting:
                return self.target.generate(**inputs, **settings, **extra), None
        head = None if system == "suffix" else self.heads["dflash" if system == "dflash" else "dspark"]
        schedule = self.schedule(system, inputs["input_ids"].shape[0], not settings.get("do_sample", False))
        output = self.model.generate(
            **inputs, **settings, assistant=head, suffix=SUFFIX_SETTING[system], schedule=schedule, seed=seed,
            return_dict_in_generate=True,
        )  # fmt: skip
        return output.sequences, output.dspark_stats

    def prepare(self, system: str, batches: list[dict[str, torch.Tensor]], settings: dict) -> float:
        """Untimed work before a system's timing; returns the seconds of a compiling pass (0 for the others).

        A DSpark system runs one ``generate(max_new_tokens=1)`` per batch size, where the default
        and goodput schedules profile that batch size's cost table; ``plain-compiled`` runs every
        batch once, compiling its shapes.
        """
        if system == "plain-compiled":
            start = time.perf_counter()
            for number, inputs in enumerate(batches):
                self.generate(system, inputs, settings, seed=number)
            return time.perf_counter() - start
        if system not in PLAIN_SYSTEMS:
            for inputs in {inputs["input_ids"].shape[0]: inputs for inputs in batches}.values():
                self.generate(system, inputs, first_token(settings), seed=0)
        return 0.0

    def run(self, system: str, prompts: list[list[int]], batch_size: int, temperature: float) -> Outcome:
        """Runs a system over the prompts in batches, timing each batch and its first token."""
        settings = {"max_new_tokens": self.args.max_new_tokens, "pad_token_id": self.pad, "eos_token_id": self.eos}
        if temperature > 0:  # every request samples max_new_tokens: equal work for every system
            settings.update(
                do_sample=True, temperature=temperature, top_k=0, top_p=1.0, min_new_tokens=self.args.max_new_tokens
            )
        else:
            settings.update(do_sample=False)
        batches = [
            left_pad(prompts[first : first + batch_size], self.pad) for first in range(0, len(prompts), batch_size)
        ]
        compile_seconds = self.prepare(system, batches, settings)
        sequences, latencies, ttft = [], [], []
        forwards = committed = 0
        accepted = verified = by_source = None
        total = 0.0
        for number, inputs in enumerate(batches):
            seed, width = number * batch_size, inputs["input_ids"].shape[1]
            start = time.perf_counter()
            self.generate(system, inputs, first_token(settings), seed=seed)
            ttft.append(time.perf_counter() - start)
            start = time.perf_counter()
            output, stats = self.generate(system, inputs, settings, seed=seed)
            seconds = time.perf_counter() - start
            total += seconds
            rows = answers(output, width, self.eos)
            sequences += rows
            latencies += [seconds] * len(rows)
            if stats is None:  # tokens per forward after the prefill, over the batch's longest row
                lookup = system.startswith("prompt-lookup")
                forwards += self.counter.count - 1 if lookup else max(map(len, rows)) - 1
                committed += max(map(len, rows)) - 1
            else:
                forwards += int(stats.num_rounds.sum())
                committed += int((stats.num_accepted + stats.num_rounds).sum())
                accepted = stats.accepted_by_position.sum(0) + (0 if accepted is None else accepted)
                verified = stats.verified_by_position.sum(0) + (0 if verified is None else verified)
                by_source = source_counts(stats) + (0 if by_source is None else by_source)
        acceptance: list[float | None] = []  # per draft slot; None where no draft was verified
        if accepted is not None:
            acceptance = [a / v if v else None for a, v in zip(accepted.tolist(), verified.tolist(), strict=True)]
        drafters = "" if by_source is None else drafter_summary(by_source)
        compile_seconds = max(compile_seconds - total, 0.0) if compile_seconds else 0.0
        return Outcome(sequences, latencies, total, ttft, committed / max(forwards, 1), acceptance, drafters,
                       compile_seconds)  # fmt: skip

    def available(self, system: str, batch_size: int) -> bool:
        """Whether a system runs here: prompt lookup at batch 1, dflash with its head, none that failed."""
        if system.startswith("prompt-lookup"):
            return batch_size == 1
        return system not in self.failures and (system != "dflash" or "dflash" in self.heads)

    def run_or_record(
        self, system: str, prompts: list[list[int]], batch_size: int, temperature: float
    ) -> Outcome | None:
        """:meth:`run`, except that a ``plain-compiled`` failure is recorded (and the system dropped): returns None."""
        if system != "plain-compiled":
            return self.run(system, prompts, batch_size, temperature)
        try:
            return self.run(system, prompts, batch_size, temperature)
        except Exception as error:  # torch.compile fails in many ways on a CPU (compiler, headers, inductor)
            self.failures[system] = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
            print(f"{system} failed, and is skipped from here on: {self.failures[system]}")
            return None


def median_run(outcomes: list[Outcome]) -> Outcome:
    """The run with the median wall time (the faster of two): the outputs are the same in every run."""
    return sorted(outcomes, key=lambda outcome: outcome.seconds)[(len(outcomes) - 1) // 2]


def run_order(systems: list[str], repeat: int) -> list[str]:
    """The systems in one repeat's order: forwards, then backwards, and so on (each pair runs in both orders)."""
    return systems if repeat % 2 == 0 else systems[::-1]


def throughput(outcome: Outcome) -> float:
    """New tokens per second of wall time over all of a run's batches."""
    return sum(map(len, outcome.sequences)) / outcome.seconds


def paired_ratio(runs: list[Outcome], baseline_runs: list[Outcome] | None) -> float | None:
    """The median over repeats of a system's throughput over the baseline's in the same repeat (None without it)."""
    if not baseline_runs:
        return None
    pairs = zip(runs, baseline_runs, strict=False)  # a system that failed part-way has fewer runs
    return statistics.median(throughput(run) / throughput(baseline) for run, baseline in pairs)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def cell_rows(domain: str, temperature: float, batch_size: int, runs: dict[str, list[Outcome]]) -> list[Row]:
    """The rows of one cell from every system's runs (in repeat order): the median run, and paired ratios."""
    outcomes = {system: median_run(system_runs) for system, system_runs in runs.items()}
    plain = outcomes["plain"]
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
                request_tok_s=round(statistics.mean(per_request), 2), throughput_tok_s=round(throughput(outcome), 2),
                p95_latency_s=round(float(torch.tensor(outcome.latencies).quantile(0.95)), 2),
                tau=round(outcome.tau, 3),
                acceptance=" ".join("-" if rate is None else f"{rate:.2f}" for rate in outcome.acceptance),
                speedup=round(paired_ratio(runs[system], runs["plain"]), 3),
                vs_plain_packed=_rounded(paired_ratio(runs[system], runs.get("plain-packed"))),
                identical=identical, drafters=outcome.drafters, compile_s=round(outcome.compile_seconds, 1),
            )
        )  # fmt: skip
    return rows


def markdown(rows: list[Row], notes: list[str]) -> str:
    """``notes``, then one markdown table per domain (ratios against plain generate() in the same cell)."""
    sections = list(notes)
    for domain in dict.fromkeys(row.domain for row in rows):
        lines = [
            f"### {domain}",
            "",
            "| T | batch | system | tau | tok/s per request | throughput tok/s | speed-up | vs plain-packed | "
            "TTFT ms | p95 latency s | greedy identical | drafters (rounds/acceptance/tok/s) |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for row in rows:
            if row.domain == domain:
                versus = "-" if row.vs_plain_packed is None else f"{row.vs_plain_packed:.2f}"
                system = row.system + (f" (compiled in {row.compile_s:.0f} s)" if row.compile_s else "")
                lines.append(
                    f"| {row.temperature:g} | {row.batch_size} | {system} | {row.tau:.2f} | "
                    f"{row.request_tok_s:.1f} | {row.throughput_tok_s:.1f} | {row.speedup:.2f}x | {versus} | "
                    f"{row.ttft_ms:.0f} | {row.p95_latency_s:.2f} | {row.identical or '-'} | {row.drafters or '-'} |"
                )
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def plot(rows: list[Row], path: Path) -> None:
    """One panel per domain and temperature (speed-up by batch size and system), and acceptance by draft slot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    systems = [system for system in SYSTEMS if system != "plain" and any(row.system == system for row in rows)]
    colors = {system: plt.get_cmap("tab10")(index % 10) for index, system in enumerate(SYSTEMS[1:])}
    temperatures = sorted({row.temperature for row in rows})
    domains = list(dict.fromkeys(row.domain for row in rows))
    batch_sizes = sorted({row.batch_size for row in rows})
    shape = (len(temperatures), len(domains) + 1)
    figure, axes = plt.subplots(
        *shape, figsize=(4.5 * shape[1], 3.6 * shape[0] + 0.6), squeeze=False, layout="constrained"
    )
    width = 0.8 / max(len(systems), 1)
    for line, temperature in enumerate(temperatures):
        for column, domain in enumerate(domains):
            axis = axes[line, column]
            for index, system in enumerate(systems):
                values = [
                    next((r.speedup for r in rows if (r.domain, r.temperature, r.batch_size, r.system)
                          == (domain, temperature, batch_size, system)), 0.0)
                    for batch_size in batch_sizes
                ]  # fmt: skip
                positions = [b + index * width for b in range(len(batch_sizes))]
                axis.bar(positions, values, width, label=system, color=colors[system])
            axis.axhline(1.0, color="black", linewidth=0.8)
            axis.set_xticks([b + width * (len(systems) - 1) / 2 for b in range(len(batch_sizes))], batch_sizes)
            axis.set(xlabel="batch size", ylabel="speed-up vs plain generate()")
            axis.set_title(f"{domain}, T={temperature:g}")
        acceptance_axis = axes[line, -1]
        for system in systems:
            curves = [r.acceptance for r in rows if r.system == system and r.acceptance and r.batch_size == 1
                      and r.temperature == temperature]  # fmt: skip
            if curves:
                table = torch.tensor([[float("nan" if x == "-" else x) for x in curve.split()] for curve in curves])
                positions = range(1, table.shape[1] + 1)
                acceptance_axis.plot(
                    positions, table.nanmean(0).tolist(), marker="o", label=system, color=colors[system]
                )
        acceptance_axis.set(xlabel="draft slot", ylabel="acceptance rate", ylim=(0, 1))
        acceptance_axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        acceptance_axis.set_title(f"acceptance by draft slot, batch 1, T={temperature:g}")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6), fontsize=8)
    figure.savefig(path, dpi=110)


def domain_prompts(domain: str) -> list[str | copy_heavy.Conversation]:
    """The evaluation prompts of a domain: plain user turns, or the copy-heavy conversations."""
    return copy_heavy.copy_heavy_prompts() if domain == "copy" else prompt_sets.load_prompts(domain, "eval")


def sources_digest() -> str:
    """sha256 over the Python sources generation runs and this benchmark: cells measured otherwise are not kept.

    That is the ``spark_generate`` package without ``training/``, which nothing in generation
    imports (the layering test keeps it so), so that a recording can span sessions of training work.
    """
    digest = hashlib.sha256(Path(__file__).read_bytes())
    package = Path(spark_generate.__file__).parent
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] != "training":
            digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def first_token(settings: dict) -> dict:
    """``settings`` for a one-token call (time to first token, warm-up): no ``min_new_tokens`` beyond it."""
    return {**settings, "max_new_tokens": 1, "min_new_tokens": 0}


class CellLog:
    """The finished cells of a run, kept on disk so that a run can span sessions.

    A session may get another machine than the last: the file keeps one recording per machine
    (``key["hardware"]``), so cells of different processors are never mixed in one table, and
    each machine's part continues when a later session gets that machine again.

    Args:
        path: The JSON file (replaced atomically after every cell).
        key: What the cells are measured with and on; recordings of other settings, head or sources
            are dropped, those of other hardware kept.
    """

    def __init__(self, path: Path, key: dict):
        self.path, self.key = path, json.loads(json.dumps(key))
        self.cells: dict[str, list[dict]] = {}
        self.failures: dict[str, str] = {}
        self.finished: dict[str, str] = {}  # cell -> when it finished (UTC)
        self.elsewhere: list[dict] = []  # the recordings of the same run on other hardware
        recordings = json.loads(path.read_text()).get("recordings", []) if path.exists() else []
        stale = 0
        for saved in recordings:
            if saved["key"] == self.key:
                self.cells, self.failures, self.finished = saved["cells"], saved["failures"], saved["finished"]
            elif {**saved["key"], "hardware": None} == {**self.key, "hardware": None}:
                self.elsewhere.append(saved)
            else:
                stale += 1
        if stale:
            print(f"{path} holds cells of other settings, head or sources: those start over")

    @staticmethod
    def name(domain: str, temperature: float, batch_size: int) -> str:
        """The cell's key in the file."""
        return f"{domain}/T={temperature:g}/batch={batch_size}"

    def rows(self, domain: str, temperature: float, batch_size: int) -> list[Row] | None:
        """The rows of a finished cell, or None."""
        cell = self.cells.get(self.name(domain, temperature, batch_size))
        return None if cell is None else [Row(**row) for row in cell]

    def add(self, rows: list[Row], failures: dict[str, str]) -> None:
        """Keeps a finished cell's rows (and the systems that failed so far) on disk."""
        first = rows[0]
        name = self.name(first.domain, first.temperature, first.batch_size)
        self.cells[name] = [asdict(row) for row in rows]
        self.finished[name] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        self.failures = dict(failures)
        record = {"key": self.key, "cells": self.cells, "failures": self.failures, "finished": self.finished}
        write_json_atomically(self.path, {"recordings": [*self.elsewhere, record]})

    def span(self) -> str:
        """When the cells were measured: ``first - last`` (UTC)."""
        times = sorted(self.finished.values())
        return f"cells finished {times[0]} - {times[-1]} UTC" if times else "no cell finished"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--domains", nargs="+", default=list(DOMAINS), choices=DOMAINS)
    parser.add_argument("--systems", nargs="+", default=list(DEFAULT_SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--compile", action="store_true", help="add plain-compiled (torch.compile, static cache)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts per cell (at least one full batch)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="new tokens per request at most")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 means greedy")
    parser.add_argument("--dflash-head", default=str(DFLASH_HEAD), help="the DFlash ablation head folder")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each system per cell, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--output", type=Path, default=RESULTS, help="folder for the CSV, markdown and chart")
    parser.add_argument("--note", default="", help="free text for the header, e.g. machine load")
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="stop between cells after this long; rerun to continue"
    )
    parser.add_argument(
        "--allocator", choices=("retain", "default"), default="retain",
        help="retain: glibc keeps freed memory for reuse, for every system (spark_generate.retain_freed_memory)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.allocator == "retain" and not retain_freed_memory():
        args.allocator = "default (the C library is not glibc)"
    if "plain-compiled" in args.systems and not args.compile:
        parser.error("plain-compiled runs only with --compile")
    if args.compile and "plain-compiled" not in args.systems:
        args.systems.append("plain-compiled")
    torch.set_num_threads(args.threads)
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    bench = Bench(args)
    stem = args.output / "generate_smollm2_cpu"
    head_digest = hashlib.sha256((DSPARK_HEAD / "model.safetensors").read_bytes()).hexdigest()
    settings = {key: value for key, value in vars(args).items() if key not in ("output", "note", "max_minutes")}
    key = {
        "settings": settings, "head_sha256": head_digest, "sources_sha256": sources_digest(),
        "hardware": hardware(torch.device("cpu")),
    }  # fmt: skip
    args.output.mkdir(parents=True, exist_ok=True)
    log = CellLog(stem.with_suffix(".cells.json"), key)
    bench.failures.update(log.failures)
    rows: list[Row] = []
    cells = [(d, t, b) for d in args.domains for t in args.temperatures for b in args.batch_sizes]
    with torch.no_grad():
        for domain, temperature, batch_size in tqdm(cells, desc="cells"):
            kept = log.rows(domain, temperature, batch_size)
            if kept is not None:
                rows += kept
                continue
            texts = domain_prompts(domain)[: max(args.prompts, batch_size)]
            prompts = [prompt_ids(bench.tokenizer, text) for text in texts]
            systems = ["plain"] + [s for s in args.systems if s != "plain" and bench.available(s, batch_size)]
            bench.run("plain", prompts[:1], 1, temperature)  # warm-up
            runs: dict[str, list[Outcome]] = {system: [] for system in systems}
            for repeat in range(args.repeats):  # interleaved, so a slow spell of the host reaches every system alike
                for system in run_order(systems, repeat):
                    if bench.available(system, batch_size):
                        outcome = bench.run_or_record(system, prompts, batch_size, temperature)
                        runs[system] += [] if outcome is None else [outcome]
            found = {system: system_runs for system, system_runs in runs.items() if system_runs}
            cell = cell_rows(domain, temperature, batch_size, found)
            for row in cell:
                print(row)
            rows += cell
            log.add(cell, bench.failures)
            if deadline is not None and time.monotonic() >= deadline and len(log.cells) < len(cells):
                raise SystemExit(
                    f"stopped at the budget with {len(log.cells)} of {len(cells)} cells done ({log.path}): run the "
                    "same command again to continue."
                )
    note = (
        f"SmolLM2-135M-Instruct (Q4_1 GGUF, de-quantized), float32, {args.threads} torch threads, "
        f"{args.prompts} prompts per cell (one full batch when larger), up to {args.max_new_tokens} new tokens, "
        f"median of {args.repeats} interleaved runs per system (ratios: medians of paired ratios, "
        f"systems in alternating order); allocator: {args.allocator}; {log.span()}; "
        f"{args.note}"
    )
    head = f"head: {DSPARK_HEAD.name}/model.safetensors sha256 {head_digest}"  # the card checks it
    failures = [f"{system} failed: {reason}" for system, reason in bench.failures.items()]
    write_results(
        stem.with_suffix(".csv"), [asdict(row) for row in rows], torch.device("cpu"), [note, head, *failures]
    )
    stem.with_suffix(".md").write_text(markdown(rows, failures))
    plot(rows, stem.with_suffix(".png"))
    print(markdown(rows, failures))


if __name__ == "__main__":
    main()
