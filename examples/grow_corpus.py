r"""The larger training corpus of the SmolLM2 head: synthesized prompts, answered by the target, kept in slices.

The recipe's first corpus (``examples/train_smollm2_head.py``) answers the ~4,400 prompts of
:mod:`spark_generate.prompt_sets`; the head trained on it memorises them. This script grows a corpus
several times larger, session after session, and keeps every step of it committed:

1. ``prompts``: :func:`~spark_generate.training.prompt_synthesis.synthesize_prompts` writes requests
   about the Python standard library (:class:`~spark_generate.training.prompt_synthesis.StdlibSource`)
   and reasoning-gym problems of 81 task families
   (:class:`~spark_generate.training.prompt_synthesis.ReasoningGymSource`, ``per_family=130``),
   deduplicated against each other and the recipe's prompts and kept away from the evaluation
   prompts; about 20 seconds. The file depends on the installed standard library and reasoning-gym,
   so it is committed (``examples/data/synthetic/prompts.jsonl.xz``) and restored, never rebuilt
   where a committed one exists. Likewise the completion requests of ``COMPLETION_SETS``, functions
   in HumanEval's form, "complete this function": the standard library's (``prompts-complete.jsonl``,
   source ``stdlib_complete``), then those of installed packages (numpy, scipy, networkx, sympy, ...:
   ``prompts-complete-packages.jsonl``, source ``package_complete``), then those of pure-Python
   utility libraries, the closest to HumanEval's small functions on sequences, strings and dicts
   (more-itertools, toolz, boltons, pydash, funcy, ...: ``prompts-complete-utilities.jsonl``, source
   ``utility_complete``; the ``data`` extra pins them), then a library of classic algorithms and
   one of string utilities (``prompts-complete-algorithms.jsonl``, ``algorithm_complete``), then
   the CodeIO programs of reasoning-gym that the recipe does not ask for, each ``main_solution``
   with its task and input/output spec as the docstring (``prompts-complete-codeio.jsonl``,
   ``codeio_complete``).
2. ``magpie``: the target writes requests itself
   (:class:`~spark_generate.training.prompt_synthesis.MagpieSource`: its chat template's opening of
   a user turn, steered toward code, math or chat), pool after pool of ``MAGPIE_POOLS`` (another
   seed draws other requests), each filtered and deduplicated against the recipe's prompts, the
   synthesized ones and the earlier pools', under ``--max-minutes`` and resumable (``magpie.jsonl``,
   ``magpie-s1.jsonl``, archived with their reports after each run). A pool's requests join the
   slices (a source of its own: ``magpie``, ``magpie_s1``; earlier slices never change) as they fill
   whole slices, and all of them once its synthesis is done.
3. ``regenerate``: the target answers them greedily (up to ``MAX_NEW_TOKENS`` tokens, the recipe's
   cap), in slices of ``SLICE_PROMPTS`` prompts of one source each (``<source>-<k>.jsonl``, each a
   resumable :func:`~spark_generate.training.regenerate.regenerate` file with packed linears),
   the sources' slices taken in turn so that a partial corpus mixes them; under ``--max-minutes``.
   ``--workers N`` runs N processes of one torch thread each; a worker claims a slice with a lock
   file the kernel releases when it exits, so workers never share a slice, even after a kill.
4. ``archive`` (after every ``regenerate`` run, and on its own, also beside running workers): each
   slice as far as it is answered, and the Magpie requests as far as they are written,
   xz-compressed with their settings and progress, into ``examples/data/synthetic/``; a machine
   without the cache folder restores them first and continues where they stop.

    python examples/grow_corpus.py --max-minutes 90     # prompts if missing, Magpie requests, then answers
    python examples/grow_corpus.py --stage magpie --max-minutes 90 --threads 1
    python examples/grow_corpus.py --stage regenerate --max-minutes 90 --workers 2  # two slices at once
    python examples/grow_corpus.py --stage archive

The answered slices are read back with :func:`answered_slices` (or :func:`synthetic_documents`, all in one list).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import multiprocessing
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from spark_generate import prompt_sets, retain_freed_memory, zoo
from spark_generate.training.prompt_synthesis import (
    MagpieSettings,
    MagpieSource,
    PromptListSource,
    ReasoningGymSettings,
    ReasoningGymSource,
    StdlibSettings,
    StdlibSource,
    codeio_completions,
    synthesize_prompts,
)
from spark_generate.training.regenerate import (
    SamplingSettings,
    archive_file,
    data_directory,
    regenerate,
    restore_archived,
)

TARGET = "smollm2-135m-instruct"
MAX_NEW_TOKENS = 192
SLICE_PROMPTS = 2000
BATCH_SIZE = 32  # with packed linears, 83-90 answer tokens/s on 2 cores (64: 54, one batch of 64 prompts)
SAMPLING = SamplingSettings(max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
ARCHIVE = Path(__file__).resolve().parent / "data" / "synthetic"
SIDECARS = (".meta.json", ".progress.json")  # regenerate's settings and progress files
REPORT = ".report.json"  # synthesize_prompts' settings, counts and progress


@dataclass(frozen=True)
class MagpiePool:
    """Requests the target writes under one seed.

    Attributes:
        file: Where they are written (in :func:`folder`, archived as ``<file>.xz``).
        source: The source their slices are named after (``<source>-<k>.jsonl``).
        settings: What is asked for: ``num_prompts`` candidates before filtering, the seed, the domains.
    """

    file: str
    source: str
    settings: MagpieSettings


@dataclass(frozen=True)
class CompletionSet:
    """Functions to complete in HumanEval's form, read from modules (:class:`StdlibSource`, kind ``complete``).

    Attributes:
        file: Where they are written (in :func:`folder`, archived as ``<file>.xz``).
        source: The source recorded per prompt, and the name of their slices.
        modules: The modules read (None: the whole standard library).
    """

    file: str
    source: str
    modules: tuple[str, ...] | None

    def prompt_source(self) -> StdlibSource:
        """One ``complete`` request of each function and method whose signature can be read."""
        return StdlibSource(StdlibSettings(self.modules, kinds=("complete",), kinds_per_object=1), name=self.source)


PACKAGE_MODULES = (
    "numpy", "numpy.linalg", "numpy.random", "numpy.fft", "scipy.stats", "scipy.linalg", "scipy.optimize",
    "scipy.special", "scipy.signal", "scipy.integrate", "scipy.interpolate", "scipy.sparse", "scipy.spatial",
    "scipy.ndimage", "networkx", "sympy", "sortedcontainers", "dateutil.parser", "dateutil.relativedelta",
    "dateutil.rrule", "regex",
)  # fmt: skip
"""Modules of installed packages (reasoning-gym's dependencies and their own) whose functions are asked for."""

UTILITY_MODULES = (
    "more_itertools.more", "more_itertools.recipes", "toolz.dicttoolz", "toolz.functoolz", "toolz.itertoolz",
    "toolz.recipes", "boltons.cacheutils", "boltons.dictutils", "boltons.fileutils", "boltons.formatutils",
    "boltons.funcutils", "boltons.iterutils", "boltons.listutils", "boltons.mathutils", "boltons.queueutils",
    "boltons.setutils", "boltons.statsutils", "boltons.strutils", "boltons.tableutils", "boltons.timeutils",
    "boltons.typeutils", "boltons.urlutils", "pydash.arrays", "pydash.collections", "pydash.functions",
    "pydash.numerical", "pydash.objects", "pydash.predicates", "pydash.strings", "pydash.utilities", "funcy.calc",
    "funcy.colls", "funcy.debug", "funcy.decorators", "funcy.flow", "funcy.funcmakers", "funcy.funcolls",
    "funcy.funcs", "funcy.objects", "funcy.seqs", "funcy.strings", "funcy.tree", "funcy.types", "humanize.filesize",
    "humanize.lists", "humanize.number", "humanize.time", "inflection",
)  # fmt: skip
"""Modules of pure-Python utility libraries (the ``data`` extra) whose functions are asked for."""

ALGORITHM_MODULES = (
    "algorithms.array", "algorithms.backtracking", "algorithms.bit_manipulation", "algorithms.common",
    "algorithms.compression", "algorithms.data_structures", "algorithms.dynamic_programming", "algorithms.graph",
    "algorithms.greedy", "algorithms.heap", "algorithms.linked_list", "algorithms.map", "algorithms.math",
    "algorithms.matrix", "algorithms.queue", "algorithms.searching", "algorithms.set", "algorithms.sorting",
    "algorithms.stack", "algorithms.streaming", "algorithms.string", "algorithms.tree", "string_utils",
)  # fmt: skip
"""Modules of a library of classic algorithms (arrays, strings, graphs, dynamic programming) and string utilities."""


@dataclass(frozen=True)
class CodeIOCompletionSet:
    """CodeIO's tasks to complete in HumanEval's form (:func:`codeio_completions`).

    Attributes:
        file: Where they are written (in :func:`folder`, archived as ``<file>.xz``).
        source: The source recorded per prompt, and the name of their slices.
    """

    file: str
    source: str

    def prompt_source(self) -> PromptListSource:
        """The tasks past those the recipe's prompts ask for, each as its ``main_solution`` to complete."""
        return PromptListSource(self.source, codeio_completions(), domain="code")


COMPLETION_SETS = (
    CompletionSet("prompts-complete.jsonl", "stdlib_complete", None),  # 3,161 kept
    CompletionSet("prompts-complete-packages.jsonl", "package_complete", PACKAGE_MODULES),  # 3,169 kept
    CompletionSet("prompts-complete-utilities.jsonl", "utility_complete", UTILITY_MODULES),  # 955 kept
    CompletionSet("prompts-complete-algorithms.jsonl", "algorithm_complete", ALGORITHM_MODULES),
    CodeIOCompletionSet("prompts-complete-codeio.jsonl", "codeio_complete"),
)

MAGPIE_POOLS = (
    MagpiePool("magpie.jsonl", "magpie", MagpieSettings(num_prompts=18_000)),  # 15,169 kept
    # Code is the domain furthest from its goal: every second request of the next pool is steered there.
    MagpiePool("magpie-s1.jsonl", "magpie_s1",
               MagpieSettings(num_prompts=12_000, seed=1, domains=("code", "math", "code", "chat"))),
)  # fmt: skip


def folder() -> Path:
    """Where the corpus is worked on: ``<data directory>/synthetic`` (outside the repository)."""
    return data_directory() / "synthetic"


def _restore(name: str, sidecars: tuple[str, ...] = SIDECARS) -> None:
    """Unpacks ``<name>.xz`` (and its sidecars) from the archive if the folder lacks it."""
    if restore_archived(folder() / name, ARCHIVE / f"{name}.xz", sidecars):
        print(f"restored {folder() / name} from {ARCHIVE / f'{name}.xz'}")


def _archive(name: str) -> None:
    """Writes ``<name>`` xz-compressed with its sidecars, as far as its progress vouches (all of it without one)."""
    archive_file(folder() / name, ARCHIVE / f"{name}.xz", (*SIDECARS, REPORT))


def stage_prompts() -> Path:
    """The synthesized prompts: restored from the archive, else written (and archived) here."""
    path = folder() / "prompts.jsonl"
    _restore("prompts.jsonl")
    if path.exists():
        return path
    sources = [StdlibSource(), ReasoningGymSource(ReasoningGymSettings(per_family=130))]
    result = synthesize_prompts(sources, path, exclude=prompt_sets.mixed_training_prompts(), progress="prompts")
    print(f"prompts: {result.num_kept} kept of {result.num_candidates} candidates, {result.counts}")
    _archive("prompts.jsonl")  # with its report
    return path


def _completion_prompts(prompts_path: Path) -> list[dict]:
    """The completion requests of ``COMPLETION_SETS`` in turn: each restored from the archive, else written here.

    The evaluation's code prompts are HumanEval's: complete a function from its signature and
    docstring. The standard-library requests of ``prompts_path`` ask to write, test or explain one;
    these ask it in HumanEval's form, of each function and method whose signature can be read
    (each set deduplicated against ``prompts_path``, the recipe's prompts and the sets before it,
    kept away from the evaluation).
    """
    earlier = [*prompt_sets.mixed_training_prompts()]
    earlier += [json.loads(line)["prompt"] for line in prompts_path.read_text().splitlines()]
    records = []
    for completion_set in COMPLETION_SETS:
        path = folder() / completion_set.file
        _restore(completion_set.file)
        if not path.exists():
            result = synthesize_prompts([completion_set.prompt_source()], path, exclude=earlier,
                                        progress=completion_set.source)  # fmt: skip
            print(f"{completion_set.source}: {result.num_kept} kept of {result.num_candidates}, {result.counts}")
            _archive(completion_set.file)  # with its report
        written = [json.loads(line) for line in path.read_text().splitlines()]
        earlier += [record["prompt"] for record in written]
        records += written
    return records


def _pool_prompts(pool: MagpiePool) -> tuple[list[dict], bool]:
    """A pool's requests as written so far (tagged with its source), and whether its synthesis is done."""
    path = folder() / pool.file
    _restore(pool.file, (REPORT,))
    if not path.exists() or not path.with_name(path.name + REPORT).exists():
        return [], False
    progress = json.loads(path.with_name(path.name + REPORT).read_text())["progress"]
    records = [json.loads(line) for line in path.read_bytes()[: progress["committed_bytes"]].splitlines()]
    return [{**record, "source": pool.source} for record in records], progress["num_done"] == pool.settings.num_prompts


def _magpie_prompts() -> list[dict]:
    """The Magpie requests usable in slices: per pool, all once its synthesis is done, else whole slices' worth."""
    usable = []
    for pool in MAGPIE_POOLS:
        records, finished = _pool_prompts(pool)
        usable += records if finished else records[: len(records) // SLICE_PROMPTS * SLICE_PROMPTS]
    return usable


def slices(prompts_path: Path) -> dict[str, list[str]]:
    """``<source>-<k>.jsonl`` -> its prompts: each source's prompts in file order, ``SLICE_PROMPTS`` a slice.

    The sources are those of ``prompts_path``, the completion requests (:func:`_completion_prompts`)
    and the Magpie requests (:func:`stage_magpie`), whose slices appear as they fill. Ordered by
    ``k``, then source, so that slices are answered in turn across the sources.
    """
    by_source: dict[str, list[str]] = {}
    records = [json.loads(line) for line in prompts_path.read_text().splitlines()]
    for record in [*records, *_completion_prompts(prompts_path), *_magpie_prompts()]:
        by_source.setdefault(record["source"], []).append(record["prompt"])
    named = {
        (k // SLICE_PROMPTS, source): prompts[k : k + SLICE_PROMPTS]
        for source, prompts in by_source.items()
        for k in range(0, len(prompts), SLICE_PROMPTS)
    }
    return {f"{source}-{k:03d}.jsonl": named[k, source] for k, source in sorted(named)}


def stage_magpie(target, tokenizer, prompts_path: Path, max_minutes: float | None) -> bool:
    """Lets the target write the requests of ``MAGPIE_POOLS`` in turn (resumable, archived after each run).

    Repeats of the recipe's training prompts, of the synthesized prompts and of earlier pools' requests are dropped.

    Returns:
        True once every pool is done.
    """
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    earlier = [*prompt_sets.mixed_training_prompts()]
    earlier += [json.loads(line)["prompt"] for line in prompts_path.read_text().splitlines()]
    earlier += [record["prompt"] for record in _completion_prompts(prompts_path)]
    for pool in MAGPIE_POOLS:
        records, finished = _pool_prompts(pool)
        if not finished:
            left = None if deadline is None else max(0.0, (deadline - time.monotonic()) / 60)
            result = synthesize_prompts([MagpieSource(target, tokenizer, pool.settings)], folder() / pool.file,
                                        exclude=earlier, max_minutes=left, progress=pool.source)  # fmt: skip
            _archive(pool.file)
            print(f"{pool.source}: {result.num_kept} kept of {result.num_done} requests written "
                  f"({result.session_seconds:.0f} s)")  # fmt: skip
            if result.num_done < result.num_candidates:
                return False
            records, _ = _pool_prompts(pool)
        earlier += [record["prompt"] for record in records]
    return True


@contextmanager
def _claim(name: str) -> Iterator[bool]:
    """True while this process holds ``<name>.lock`` (another worker's slice: False); released on exit."""
    folder().mkdir(parents=True, exist_ok=True)
    with open(folder() / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def stage_regenerate(target, tokenizer, prompts_path: Path, max_minutes: float | None) -> bool:
    """Answers the unclaimed slices in turn within ``max_minutes``, archiving each after its run.

    Returns:
        True once every slice this process saw is finished (none left to it and none claimed by another).
    """
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    finished = True
    for name, prompts in slices(prompts_path).items():
        with _claim(name) as claimed:
            if not claimed:
                finished = False
                continue
            _restore(name)
            left = None if deadline is None else (deadline - time.monotonic()) / 60
            if left is not None and left <= 0:
                return False
            result = regenerate(target, tokenizer, prompts, folder() / name, SAMPLING, batch_size=BATCH_SIZE,
                                max_minutes=left, progress=name)  # fmt: skip
            if result.session_answer_tokens:
                _archive(name)
                print(
                    f"{name}: {result.num_done}/{result.num_prompts} prompts, {result.answer_tokens:,} answer "
                    f"tokens; this run {result.session_answer_tokens:,} in {result.session_seconds:.0f} s "
                    f"({result.session_tokens_per_second:.1f} tokens/s)"
                )
            if not result.finished:
                return False
    return finished


def _worker(prompts_path: Path, max_minutes: float | None, threads: int) -> bool:
    """One regeneration process: loads the target and answers unclaimed slices (``stage_regenerate``)."""
    retain_freed_memory()  # a spawned worker starts with glibc's defaults
    if threads:
        torch.set_num_threads(threads)
    target, tokenizer = zoo.load(TARGET)
    return stage_regenerate(target, tokenizer, prompts_path, max_minutes)


def _run_workers(prompts_path: Path, max_minutes: float | None, workers: int) -> bool:
    """``workers`` processes of one thread each (``spawn``: no forked torch state); True if all finished.

    Every worker is waited for before the pool closes (closing terminates the workers): one that
    stops at the budget must not cut short another still writing and archiving its slice. A SIGTERM
    to this process leaves the pool the same way, so the workers stop with it instead of running on
    (their slices resume from the last committed answer).
    """

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(f"stopped by signal {signum} with the workers: run the same command again to continue.")

    signal.signal(signal.SIGTERM, stop)
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers) as pool:
        results = [pool.apply_async(_worker, (prompts_path, max_minutes, 1)) for _ in range(workers)]
        finished = [result.get() for result in results]
    return all(finished)


def answered_slices() -> dict[str, list[dict]]:
    """Each slice's answered documents (restored from the archive where needed), slices in order."""
    answered = {}
    for name in slices(stage_prompts()):
        _restore(name)
        path = folder() / name
        if path.exists():
            progress = json.loads((folder() / f"{name}.progress.json").read_text())
            data = path.read_bytes()[: progress["committed_bytes"]]
            answered[name] = [json.loads(line) for line in data.splitlines()]
    return answered


def synthetic_documents() -> list[dict]:
    """Every answered document of every slice, slice by slice."""
    return [record for records in answered_slices().values() for record in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", default="all", choices=["all", "prompts", "magpie", "regenerate", "archive"])
    parser.add_argument(
        "--max-minutes", type=float, default=None, help="budget of the Magpie requests and answers; rerun to continue"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--workers", type=int, default=1, help="regeneration processes, one torch thread each when more than 1"
    )
    args = parser.parse_args()
    retain_freed_memory()  # batched forwards free large buffers every layer: reuse them, not fault them in again
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    prompts_path = stage_prompts()
    _completion_prompts(prompts_path)
    if args.stage == "archive":  # beside running workers too: each file as far as its progress vouches
        for pool in MAGPIE_POOLS:
            if (folder() / f"{pool.file}{REPORT}").exists():
                _archive(pool.file)
        for name in slices(prompts_path):
            if (folder() / f"{name}.progress.json").exists():
                _archive(name)
        return
    deadline = None if args.max_minutes is None else time.monotonic() + 60 * args.max_minutes
    if args.stage in ("all", "magpie"):
        if args.threads:
            torch.set_num_threads(args.threads)
        target, tokenizer = zoo.load(TARGET)
        if not stage_magpie(target, tokenizer, prompts_path, args.max_minutes):
            raise SystemExit("the Magpie requests stopped at their budget: run the same command again to continue.")
    if args.stage in ("all", "regenerate"):
        left = None if deadline is None else (deadline - time.monotonic()) / 60
        if args.workers > 1:
            finished = _run_workers(prompts_path, left, args.workers)
        else:
            finished = _worker(prompts_path, left, args.threads)
        if not finished:
            raise SystemExit("regeneration stopped at its budget: run the same command again to continue.")


if __name__ == "__main__":
    main()
