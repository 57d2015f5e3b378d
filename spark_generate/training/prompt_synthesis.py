"""Training prompts without a dataset: a chat model writes them, generators pose them, the stdlib inspires them.

A draft head learns from its target's answers, and the answers are only as varied as the prompts
(:mod:`spark_generate.prompt_sets` holds about 4,400). This module makes tens of thousands more,
from three sources, and writes them in the prompt format of :func:`~spark_generate.training.regenerate.read_prompts`:

* **Magpie** (:class:`MagpieSource`, `arXiv 2406.08464 <https://arxiv.org/abs/2406.08464>`_): an
  aligned chat model, shown only the opening of a user turn of its own chat template, writes a user
  request itself. The opening (the *pre-query template*, :func:`pre_query_template`) is read off the
  tokenizer's template, so any chat model serves: a user message holding a sentinel is rendered and
  cut at the sentinel, and the template's text after it tells what ends a user turn. Each prompt is
  steered toward ``code``, ``math`` or ``chat`` by a system message and, for most prompts, the first
  few words of the request (an *opener* such as "Write a Python function"), drawn for that prompt
  from a generator seeded by its index. The model samples the rest until the end of the user turn,
  with ``generate()``'s warpers and counter-based noise keyed by a seed derived from the index.
* **reasoning-gym** (:class:`ReasoningGymSource`): ``per_family`` problems from each of 81 of its
  procedural task families (arithmetic, algebra, geometry, logic, graphs, games, puzzles, string
  and matrix algorithms), each family under a seed of its own. Families whose
  problems depend on Python's hash seed, that take a tenth of a second or more a problem, or whose
  prompts are pictures or pages long are left out (:data:`REASONING_GYM_LEFT_OUT` says why).
* **the standard library** (:class:`StdlibSource`): the public functions, classes and methods of the
  Python standard library installed here, with their signatures and the summary of their
  docstrings (:func:`stdlib_objects`), each asked for in ``kinds_per_object`` of several ways:
  implement it, test it, explain it, use it, its pitfalls, document it; or, a source of its own,
  complete it in HumanEval's form (its signature and docstring as a stub; functions and methods).
  Named modules of installed packages (``numpy``, ``networkx``, ...) are read the same way.

**Filters.** Text a model wrote must look like a request: it is dropped when empty, truncated (no end
of turn within the token budget), leaking template tokens, too long, too short (in words, or
without a letter), starting like an answer ("Sure", "Here is", "I'm sorry", "As an AI", ...) or
repetitive (a character run, a repeated line, few distinct word 3-grams); generated problems are
only checked for emptiness and length. Every prompt is then checked against the evaluation prompts
(:func:`spark_generate.prompt_sets.evaluation_prompts`, by the test that keeps them out of the
shipped training set, :class:`~spark_generate.prompt_sets.NearDuplicateIndex`), and against the
kept prompts and any ``exclude`` corpus for an exact repeat (case, spacing and sentence
punctuation ignored) and, for model-written text, a near-repeat (a Jaccard similarity of word
5-grams, numbers masked, of 0.5 or more with a kept prompt), looked up in an index that reads only
the kept prompts sharing a rare 5-gram, so 30,000 prompts are deduplicated in seconds
(:class:`Deduplicator`). The report counts what each filter removed, per source, with examples,
and the evaluation overlap per source (how many were dropped, the largest containment seen).

**Cost.** Requests are sampled a batch at a time by the regeneration's decoder
(:func:`~spark_generate.training.regenerate.answer_rows`, packed linears on a CPU): a row leaves
the batch as soon as its request ends, where ``generate()`` would decode it until the batch's
longest request is done (on SmolLM2-135M-Instruct, batch 32, 160 new tokens at most, requests
average 48 tokens and ``generate()`` spent two thirds of its row-steps on finished rows: about 28
requests a minute on 2 CPU cores).

**Files, budget and resume.** :func:`synthesize_prompts` writes one JSONL line per kept prompt::

    {"prompt": "...", "domain": "math", "source": "magpie", "index": 7, "system": null, "opener": "Solve"}

and ``<output>.report.json`` (settings: the sources with the model, its template and the sampling,
the filters, the evaluation set's digest; counts; evaluation overlap; progress; the package versions
and the candidate each set of them started from), replaced atomically after each chunk of
candidates. ``max_minutes`` stops a run between chunks; a rerun with the same arguments cuts the
file back to its last whole chunk, rebuilds the deduplication state from the kept prompts and
continues, so the file is byte for byte that of one uninterrupted run (Magpie batches are fixed by
the batch size and seeded by their index, as the regeneration seeds answers by prompt index in
:mod:`~spark_generate.training.regenerate`). A rerun under other package versions (a
``transformers`` upgrade between sessions) continues too, and the report's ``versions`` history
says from which candidate on they wrote the file.

Example::

    model, tokenizer = zoo.load("smollm2-135m-instruct")
    magpie = MagpieSource(model, tokenizer, MagpieSettings(num_prompts=20_000))
    sources = [StdlibSource(), ReasoningGymSource(), magpie]
    synthesize_prompts(sources, "prompts.jsonl", exclude=prompt_sets.mixed_training_prompts(), max_minutes=60)
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import io
import json
import os
import pkgutil
import random
import re
import sys
import textwrap
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

import spark_generate.prompt_sets as prompt_sets
from spark_generate.config import write_json_atomically
from spark_generate.packing import packed_linears
from spark_generate.training.provenance import package_versions, target_identity
from spark_generate.training.regenerate import (
    SamplingSettings,
    answer_rows,
    append_lines,
    open_lines,
)

__all__ = [
    "ANSWER_OPENINGS",
    "DEFAULT_STEERING",
    "REASONING_GYM_FAMILIES",
    "REASONING_GYM_LEFT_OUT",
    "REASONS",
    "REQUEST_KINDS",
    "SENTINEL",
    "STDLIB_SKIPPED",
    "Candidate",
    "Deduplicator",
    "FilterSettings",
    "MagpieSettings",
    "MagpieSource",
    "PreQueryTemplate",
    "PromptListSource",
    "PromptSource",
    "ReasoningGymSettings",
    "ReasoningGymSource",
    "StdlibObject",
    "StdlibSettings",
    "StdlibSource",
    "Steering",
    "SynthesisResult",
    "codeio_completions",
    "pre_query_template",
    "rejection_reason",
    "stdlib_objects",
    "synthesize_prompts",
]

SENTINEL = "SPARKGENERATEUSERREQUEST"
"""The user message rendered to find where a request begins (letters only: it survives ``trim`` and escaping)."""

REASONS = (
    "empty", "truncated", "special_tokens", "too_long", "too_short", "answer_like", "repetitive",
    "evaluation_overlap", "duplicate", "near_duplicate",
)  # fmt: skip
"""Why a candidate is dropped, in the order the checks run."""

# ---------------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Steering:
    """How Magpie prompts of one domain are steered.

    Attributes:
        system_messages: System messages to draw from (None: the template's own default, if any).
        openers: First words of the request to draw from.
        opener_share: Probability that a prompt begins with an opener (a system message alone steers
            a small model weakly: SmolLM2-135M-Instruct asks about code or math about half the time).
    """

    system_messages: tuple[str | None, ...]
    openers: tuple[str, ...]
    opener_share: float = 0.9


DEFAULT_STEERING: dict[str, Steering] = {
    "code": Steering(
        system_messages=(
            "You are a Python programming assistant. Users ask you to write, fix, explain and test Python code.",
            "You are a coding assistant. Users ask about Python, JavaScript, SQL, shell scripts and algorithms.",
        ),
        openers=(
            "Write a Python function", "Write a Python script", "Write a Python class", "Implement",
            "How do I", "How can I read", "Explain what this Python code does", "Fix the bug in",
            "Why does my Python code", "Write unit tests for", "Refactor", "What is the difference between",
            "Explain the time complexity of", "Write a SQL query", "Write a JavaScript function",
            "Write a bash script", "Write a program", "Create a",
        ),
    ),
    "math": Steering(
        system_messages=(
            "You are a math tutor. Users ask you to solve math problems step by step.",
            "You are an assistant that solves word problems, algebra, geometry and probability questions.",
        ),
        openers=(
            "Solve", "Calculate", "Find", "What is", "Prove that", "How many", "Simplify", "Evaluate",
            "Determine", "Compute", "If", "A train", "A store sells", "The sum of",
            "What is the probability that", "Factor", "Explain how to solve", "Convert",
        ),
    ),
    "chat": Steering(
        system_messages=(
            None,
            "You are a helpful assistant.",
            "You are a friendly assistant who helps with writing, planning, advice and general knowledge.",
        ),
        openers=(
            "How do I", "What are", "Can you help me", "Write a short story", "Write an email", "Explain",
            "Give me", "I'm planning", "What is the best way to", "Summarize", "Write a poem", "Describe",
            "Compare", "Why do", "Suggest", "Write a blog post", "I need advice", "What should I",
        ),
        opener_share=0.5,
    ),
}  # fmt: skip
"""Per-domain system messages and openers of :class:`MagpieSettings`."""


@dataclass(frozen=True)
class MagpieSettings:
    """What a Magpie run asks its model for, and how it samples.

    Attributes:
        num_prompts: Requests to sample (before filtering).
        domains: Domains in turn: prompt ``i`` is steered toward ``domains[i % len(domains)]``.
        temperature: Sampling temperature.
        top_p: Nucleus mass (1 for all).
        top_k: Candidates kept (0 for all).
        max_new_tokens: Token budget of a request; a request not ended within it is truncated.
        batch_size: Requests sampled together (each is seeded by its index: the batch changes only the speed).
        seed: Base seed of the steering draws and of the sampling.
        steering: System messages and openers of each domain.
    """

    num_prompts: int = 30_000
    domains: tuple[str, ...] = prompt_sets.DOMAINS
    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 0
    max_new_tokens: int = 160
    batch_size: int = 32
    seed: int = 0
    steering: Mapping[str, Steering] = field(default_factory=lambda: dict(DEFAULT_STEERING))


REASONING_GYM_FAMILIES = (
    # arithmetic
    "basic_arithmetic", "bitwise_arithmetic", "calendar_arithmetic", "chain_sum", "count_bits", "decimal_arithmetic",
    "decimal_chain_sum", "dice", "fraction_simplification", "gcd", "lcm", "leg_counting", "number_format",
    "power_function", "prime_factorization", "products", "time_intervals",
    # algebra, geometry, probability
    "complex_arithmetic", "polynomial_equations", "simple_equations", "simple_integration", "advanced_geometry",
    "simple_geometry", "coin_flip",
    # logic
    "aiw", "circuit_logic", "knights_knaves", "propositional_logic", "self_reference", "syllogism",
    # graphs
    "course_schedule", "family_relationships", "largest_island", "path_star", "quantum_lock", "shortest_path",
    # games and puzzles
    "kakurasu", "maze", "mini_sudoku", "n_queens", "rush_hour", "survo", "tower_of_hanoi", "tsumego", "sudoku",
    "countdown",
    # cognition and induction
    "color_cube_rotation", "modulo_grid", "rubiks_cube", "acre",
    # algorithms on numbers, strings and matrices
    "base_conversion", "binary_alternation", "binary_matrix", "caesar_cipher", "count_primes", "cryptarithm",
    "game_of_life", "group_anagrams", "graph_color", "jugs", "letter_counting", "letter_jumble", "manipulate_matrix",
    "number_filtering", "number_sorting", "palindrome_generation", "palindrome_partitioning", "pool_matrix",
    "rotate_matrix", "rotten_oranges", "sentence_reordering", "spell_backward", "spiral_matrix", "string_insertion",
    "string_manipulation", "string_splitting", "string_synthesis", "word_ladder", "word_sequence_reversal",
    "word_sorting",
    # code
    "bf",
)  # fmt: skip
"""The reasoning-gym 0.1.25 task families :class:`ReasoningGymSource` draws from."""

REASONING_GYM_LEFT_OUT = {
    "gsm_symbolic": "in the shipped training set already, with its evaluation templates kept apart",
    "codeio": "in the shipped training set already",
    "polynomial_multiplication": "its problems change with Python's hash seed",
    "list_functions": "its problems change with Python's hash seed",
    "isomorphic_strings": "its problems change with Python's hash seed",
    "ransom_note": "its problems change with Python's hash seed",
    "futoshiki": "about 0.5 s a problem",
    "knight_swap": "about 0.8 s a problem",
    "number_sequence": "about 0.1 s a problem",
    "sokoban": "about 0.15 s a problem",
    "zebra_puzzles": "about 0.15 s a problem",
    "puzzle24": "about 0.1 s a problem",
    "intermediate_integration": "about 0.1 s a problem",
    "boxnet": "prompts of 3,000 characters and more",
    "mahjong_puzzle": "prompts of 2,000 characters and more",
    "rectangle_count": "a 7,000-character picture",
    "needle_haystack": "pages of filler text",
    "figlet_font": "ASCII-art letters",
    "emoji_mystery": "emoji-encoded text",
    "arc_1d": "ARC grids",
    "arc_agi": "ARC grids",
    "rearc": "ARC grids",
    "ab": "a rewriting system with no words",
    "game_of_life_halting": "the same board picture as game_of_life",
    "composite": "a mixture of the others",
}
"""The other registered families, and why they are not drawn from."""

_CODE_CATEGORIES = {"code"}  # reasoning-gym categories tagged "code"; the rest are "math"


@dataclass(frozen=True)
class ReasoningGymSettings:
    """Which reasoning-gym problems to pose.

    Attributes:
        families: Task families (registered reasoning-gym dataset names).
        per_family: Problems drawn from each family (exact repeats are dropped later).
        seed: Base seed; each family draws under a seed derived from it and the family's name.
    """

    families: tuple[str, ...] = REASONING_GYM_FAMILIES
    per_family: int = 200
    seed: int = 0


REQUEST_KINDS = {
    "implement": "Write your own Python implementation of the {what} `{name}{signature}`, without using it. "
    "What it does: {summary}",
    "tests": "Write pytest unit tests for the {what} `{name}{signature}`, covering normal use and edge cases. "
    "Its documentation says: {summary}",
    "explain": "Explain what `{name}` does in Python and when to use it, with a short example. "
    "Its documentation says: {summary}",
    "example": "Write a short, practical Python script that uses `{name}{signature}`, and explain each step.",
    "pitfalls": "What are common mistakes when using `{name}` in Python, and how can I avoid them?",
    "document": "Write a Google-style docstring and type hints for a Python {what} `{short}{signature}` that does "
    "this: {summary}",
    # HumanEval's form (the evaluation's code prompts): a function's stub, its signature and docstring, to complete.
    "complete": "Complete the following Python function.\n\n```python\n{stub}```",
}
"""How :class:`StdlibSource` asks about an object: templates filled from a :class:`StdlibObject`.

``complete`` asks about functions and methods whose signature can be read; the others about every object.
"""

STDLIB_SKIPPED = frozenset({
    # side effects on import, or a GUI, a REPL or a test suite
    "antigravity", "this", "__hello__", "__phello__", "tkinter", "turtle", "turtledemo", "idlelib", "test", "tests",
    "idle_test", "readline", "rlcompleter", "ensurepip", "venv", "lib2to3", "pydoc_data", "site", "__main__",
    # nothing to ask about, or another platform's
    "encodings", "distutils", "msilib", "winreg", "winsound", "msvcrt", "nt", "ntpath", "nturl2path",
})  # fmt: skip
"""Standard-library modules (any part of a dotted name) :func:`stdlib_objects` never imports."""

_MODULE_DISPLAY = {"builtins": "", "posix": "os", "posixpath": "os.path"}


@dataclass(frozen=True)
class StdlibSettings:
    """Which standard-library requests to make.

    Attributes:
        modules: Modules to read (their own objects only), of the standard library or of any
            installed package (whose version :meth:`StdlibSource.describe` records); None walks
            every public module and submodule of the standard library installed here, except
            :data:`STDLIB_SKIPPED` and modules deprecated on import.
        kinds: Request kinds (keys of :data:`REQUEST_KINDS`; by default all but ``complete``, which
            a source of its own asks).
        kinds_per_object: Kinds asked per object, drawn for each object from a seeded generator
            among those that can be asked about it.
        max_summary_chars: Longest docstring summary quoted in a request.
        seed: Seed of the draws of kinds.
    """

    modules: tuple[str, ...] | None = None
    kinds: tuple[str, ...] = ("implement", "tests", "explain", "example", "pitfalls", "document")
    kinds_per_object: int = 2
    max_summary_chars: int = 400
    seed: int = 0


ANSWER_OPENINGS = (
    "sure", "certainly", "of course", "absolutely", "here is", "here's", "here are", "i'm sorry", "i am sorry",
    "i apologize", "as an ai", "as a language model", "i cannot", "i can't", "great question", "thank you for",
    "you're welcome", "hello! how can i", "hi! how can i", "how can i assist", "how can i help",
)  # fmt: skip
"""Openings (lower case) of text that answers rather than asks."""

ANSWER_PHRASES = ("how can i assist you", "how can i help you today", "as an ai language model")
"""Phrases (lower case) of an assistant's answer, wherever they occur."""


@dataclass(frozen=True)
class FilterSettings:
    """What a kept prompt must satisfy.

    Attributes:
        min_words: Fewest words (with a letter or digit; model-written text, which needs a letter too).
        max_chars: Longest prompt, in characters (every source).
        max_char_run: Longest run of one repeated character (model-written text).
        max_line_repeats: Most occurrences of one non-empty line (model-written text).
        min_distinct_trigrams: Least share of distinct word 3-grams, in texts of 12 words or more.
        answer_openings: Openings of an answer rather than a request (compared in lower case).
        answer_phrases: Phrases of an answer anywhere in the text (compared in lower case).
        near_duplicate_jaccard: Jaccard similarity of word 5-grams from which model-written text
            nearly repeats a kept prompt.
        boilerplate_min: A 5-gram in this many kept prompts is an opening, not content, and is
            ignored by the near-repeat test.
        evaluation_containment: Containment from which a prompt nearly repeats an evaluation prompt
            (:data:`spark_generate.prompt_sets.NEAR_DUPLICATE_CONTAINMENT`, the shipped set's test).
    """

    min_words: int = 3
    max_chars: int = 2000
    max_char_run: int = 16
    max_line_repeats: int = 2
    min_distinct_trigrams: float = 0.6
    answer_openings: tuple[str, ...] = ANSWER_OPENINGS
    answer_phrases: tuple[str, ...] = ANSWER_PHRASES
    near_duplicate_jaccard: float = 0.5
    boilerplate_min: int = 20
    evaluation_containment: float = prompt_sets.NEAR_DUPLICATE_CONTAINMENT


# ------------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    """A prompt a source proposes.

    Attributes:
        prompt: The request.
        domain: ``"code"``, ``"math"`` or ``"chat"``.
        index: Its index in its source (which keys its seeds).
        details: Further fields of its record (opener and system message, family, object and kind).
        rejection: A reason of :data:`REASONS` the source found itself (truncated, leaked template tokens).
    """

    prompt: str
    domain: str
    index: int
    details: dict[str, Any] = field(default_factory=dict)
    rejection: str | None = None


class PromptSource(Protocol):
    """What :func:`synthesize_prompts` reads prompts from.

    Attributes:
        name: Recorded as each prompt's ``source``.
        model_written: Whether its text gets the request heuristics and the near-repeat test.
        chunk_size: Candidates made together; a run stops and resumes between chunks.
    """

    name: str
    model_written: bool
    chunk_size: int

    def __len__(self) -> int:
        """Candidates in all."""
        ...

    def describe(self) -> dict[str, Any]:
        """Its settings as JSON; a run is resumed only with equal settings."""
        ...

    def candidates(self, start: int, stop: int) -> list[Candidate]:
        """Candidates ``start`` to ``stop - 1`` (a chunk: ``start`` is a multiple of ``chunk_size``)."""
        ...


def _derived_seed(*parts: object) -> int:
    """A 63-bit seed from SHA-256 of the parts (the same on every machine and Python hash seed)."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


# ---------------------------------------------------------------------------------- Magpie


@dataclass(frozen=True)
class PreQueryTemplate:
    """The opening of a user turn in a chat template, and what ends the turn.

    Attributes:
        prefix: The rendered template up to where the user's text begins.
        end_of_turn: The text the template writes right after a user's text (first line, stripped).
        system: The system message rendered (None: the template's default).
    """

    prefix: str
    end_of_turn: str
    system: str | None = None


def _tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    return tokenizer.name_or_path or type(tokenizer).__name__


def pre_query_template(
    tokenizer: PreTrainedTokenizerBase, system: str | None = None, end_of_turn: str | None = None
) -> PreQueryTemplate:
    """Reads the opening of a user turn off a tokenizer's chat template.

    A conversation of ``system`` (when given) and a user message holding :data:`SENTINEL` is
    rendered without a generation prompt and cut at the sentinel.

    Example: for a ChatML template, ``prefix`` ends with ``"<|im_start|>user"`` and a newline, and
    ``end_of_turn`` is ``"<|im_end|>"``.

    Args:
        tokenizer: A chat model's tokenizer.
        system: A system message to render before the user turn.
        end_of_turn: What ends a user turn, when the template does not say (it writes nothing after
            a user message); default: read off the template.

    Raises:
        ValueError: If the tokenizer has no chat template, the template refuses the conversation,
            does not copy the user's text exactly once, writes nothing before it, or (without
            ``end_of_turn``) nothing after it.
    """
    name = _tokenizer_name(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer {name!r} has no chat template, so it does not say how a user turn begins; Magpie "
            "expected a chat model's tokenizer with tokenizer.chat_template set. Load the tokenizer of an "
            "instruction-tuned model, or set tokenizer.chat_template to the model's Jinja chat template."
        )
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": SENTINEL})
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as error:  # Jinja raises its own errors (e.g. "System role not supported")
        advice = "use system messages of None (openers only)" if system is not None else "fix the chat template"
        raise ValueError(
            f"the chat template of {name!r} refused the conversation {[m['role'] for m in messages]}: {error}; "
            f"expected it to render a user message{' after a system message' if system else ''}: {advice}."
        ) from error
    if text.count(SENTINEL) != 1:
        raise ValueError(
            f"the chat template of {name!r} rendered the user's text {text.count(SENTINEL)} times (in {text!r}); "
            "expected it once, verbatim, to find where a request begins. Use a template that copies the "
            "message content unchanged."
        )
    prefix, suffix = text.split(SENTINEL)
    if not prefix.strip():
        raise ValueError(
            f"the chat template of {name!r} writes nothing before the user's text (it rendered {text!r}); "
            "expected the opening of a user turn. Set tokenizer.chat_template to the model's chat template."
        )
    if end_of_turn is None:
        lines = suffix.strip().splitlines()
        end_of_turn = lines[0].strip() if lines else ""
        if not end_of_turn:
            raise ValueError(
                f"the chat template of {name!r} writes nothing after a user's text (it rendered {text!r}), so it "
                "does not say what ends a user turn; pass end_of_turn= the text that ends one."
            )
    return PreQueryTemplate(prefix=prefix, end_of_turn=end_of_turn, system=system)


class MagpieSource:
    """Requests a chat model writes itself, shown only the opening of a user turn (Magpie).

    Prompt ``i`` is steered toward ``domains[i % len(domains)]``: its system message and opener
    are drawn from that domain's :class:`Steering` by a generator seeded with ``(seed, i)``.
    Its request is sampled with Philox noise keyed by a seed derived from ``(seed, i)`` (and each
    token's position), so a rerun samples the same requests, whatever the batch. A request ends at
    the end-of-turn token (or the end-of-sequence token); an end of turn of several tokens
    (``stop_strings``) is looked for in the decoded text, the row decoding on to ``max_new_tokens``.

    Args:
        model: The chat model.
        tokenizer: Its tokenizer, with a chat template.
        settings: What to ask for and how to sample.
        end_of_turn: What ends a user turn, when the template does not say (see :func:`pre_query_template`).

    Raises:
        ValueError: If a setting is out of range, a domain has no steering, or the template cannot be read.
    """

    name = "magpie"
    model_written = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        settings: MagpieSettings = MagpieSettings(),
        end_of_turn: str | None = None,
    ) -> None:
        _check_magpie_settings(settings)
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.chunk_size = settings.batch_size
        systems = dict.fromkeys(s for d in settings.domains for s in settings.steering[d].system_messages or (None,))
        self.templates = {system: pre_query_template(tokenizer, system, end_of_turn) for system in systems}
        ends = {template.end_of_turn for template in self.templates.values()}
        if len(ends) != 1:
            raise ValueError(
                f"the chat template of {_tokenizer_name(tokenizer)!r} ends user turns differently by system message "
                f"({sorted(ends)}); expected one end of turn: pass end_of_turn= explicitly."
            )
        self.end_of_turn = ends.pop()
        end_ids = tokenizer.encode(self.end_of_turn, add_special_tokens=False)
        self.stop_strings = () if len(end_ids) == 1 else (self.end_of_turn,)
        stops = set(end_ids if len(end_ids) == 1 else [])
        if tokenizer.eos_token_id is not None:
            stops.add(tokenizer.eos_token_id)
        self.stop_ids = tuple(sorted(stops))
        if not self.stop_ids and not self.stop_strings:
            raise ValueError(f"no token ends a request of {_tokenizer_name(tokenizer)!r}; pass end_of_turn=.")
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.stop_ids or (0,))[0]
        self._special_tokens = tuple(token for token in tokenizer.all_special_tokens if token)

    def __len__(self) -> int:
        return self.settings.num_prompts

    def plan(self, index: int) -> tuple[str, str | None, str]:
        """The domain, system message and opener (``""`` for none) of prompt ``index``."""
        settings = self.settings
        domain = settings.domains[index % len(settings.domains)]
        steering = settings.steering[domain]
        draw = random.Random(f"magpie/{settings.seed}/{index}")
        system = draw.choice(steering.system_messages) if steering.system_messages else None
        use_opener = draw.random() < steering.opener_share
        opener = draw.choice(steering.openers) if steering.openers and use_opener else ""
        return domain, system, opener

    def describe(self) -> dict[str, Any]:
        """The settings, the model's identity, the pre-query templates and the stops, as JSON."""
        return {
            "name": self.name,
            "num_candidates": len(self),
            "settings": dataclasses.asdict(self.settings),
            "model": target_identity(self.model),
            "tokenizer": _tokenizer_name(self.tokenizer),
            "pre_query_templates": [
                {"system": system, "prefix": template.prefix} for system, template in self.templates.items()
            ],
            "end_of_turn": self.end_of_turn,
            "stop_ids": list(self.stop_ids),
            "stop_strings": list(self.stop_strings),
        }

    def _prompt_ids(self, system: str | None, opener: str) -> tuple[list[int], int]:
        """Token ids of the pre-query template and the opener, and where the opener begins."""
        prefix = self.tokenizer(self.templates[system].prefix, add_special_tokens=False).input_ids
        opener_ids = self.tokenizer(opener, add_special_tokens=False).input_ids if opener else []
        return prefix + opener_ids, len(prefix)

    def _sample(self, prompts: list[list[int]], indices: range) -> list[list[int]]:
        """The model's continuations of the prompts of ``indices``, each drawn under the seed of its index."""
        settings = self.settings
        sampling = SamplingSettings(
            max_new_tokens=settings.max_new_tokens, do_sample=True, temperature=settings.temperature,
            top_p=settings.top_p, top_k=settings.top_k,
        )  # fmt: skip
        seeds = [_derived_seed("magpie", settings.seed, index) >> 1 for index in indices]
        continuations: list[list[int]] = [[] for _ in prompts]
        with packed_linears(self.model):
            for ended in answer_rows(self.model, prompts, seeds, sampling, self.stop_ids, self.pad_id):
                for row, continuation in ended:
                    continuations[row] = continuation
        return continuations

    def _request(self, opener: str, opener_ids: list[int], continuation: list[int]) -> tuple[str, str | None]:
        """The request text of a continuation, and a rejection (truncated, leaked tokens) if any."""
        stops = [position for position, token in enumerate(continuation) if token in self.stop_ids]
        ended = bool(stops)
        continuation = continuation[: stops[0]] if stops else continuation
        text = self.tokenizer.decode(opener_ids + continuation, skip_special_tokens=False) if continuation else opener
        if self.stop_strings and self.end_of_turn in text:
            text, ended = text.split(self.end_of_turn, 1)[0], True
        text = text.strip()
        if not text:
            return text, "empty"
        if not ended:
            return text, "truncated"
        if any(token in text for token in self._special_tokens):
            return text, "special_tokens"
        return text, None

    def candidates(self, start: int, stop: int) -> list[Candidate]:
        """Samples the requests of one batch (``start`` is a multiple of ``batch_size``)."""
        plans = [self.plan(index) for index in range(start, stop)]
        encoded = [self._prompt_ids(system, opener) for _, system, opener in plans]
        continuations = self._sample([ids for ids, _ in encoded], range(start, stop))
        found = []
        for index, (domain, system, opener), (ids, opener_start), continuation in zip(
            range(start, stop), plans, encoded, continuations, strict=True
        ):
            text, rejection = self._request(opener, ids[opener_start:], continuation)
            details = {"system": system, "opener": opener or None}
            found.append(Candidate(text, domain, index, details, rejection))
        return found


def _check_magpie_settings(settings: MagpieSettings) -> None:
    problems = []
    if settings.num_prompts < 0:
        problems.append(f"num_prompts={settings.num_prompts}; expected 0 or more")
    if not settings.domains:
        problems.append("domains is empty; expected at least one domain")
    missing = [domain for domain in settings.domains if domain not in settings.steering]
    if missing:
        problems.append(f"domains {missing} have no steering; expected keys of steering: {sorted(settings.steering)}")
    shares = {domain: steering.opener_share for domain, steering in settings.steering.items()}
    if any(not 0.0 <= share <= 1.0 for share in shares.values()):
        problems.append(f"opener_share of {shares}; expected probabilities in [0, 1]")
    if settings.temperature <= 0:
        problems.append(f"temperature={settings.temperature}; expected a positive temperature")
    if not 0.0 < settings.top_p <= 1.0:
        problems.append(f"top_p={settings.top_p}; expected a mass in (0, 1]")
    if settings.top_k < 0:
        problems.append(f"top_k={settings.top_k}; expected 0 (all) or more")
    if settings.max_new_tokens < 1 or settings.batch_size < 1:
        problems.append(
            f"max_new_tokens={settings.max_new_tokens}, batch_size={settings.batch_size}; expected at least 1 each"
        )
    if problems:
        raise ValueError("invalid MagpieSettings: " + "; ".join(problems) + ".")


# ---------------------------------------------------------------------------- reasoning-gym


class ReasoningGymSource:
    """Problems of reasoning-gym's procedural task families: ``per_family`` of each, family after family.

    Candidate ``i`` is problem ``i % per_family`` of family ``families[i // per_family]``, drawn
    with ``reasoning_gym.create_dataset(family, size=per_family, seed=...)`` under a seed derived
    from ``(seed, family)``. Problems are tagged ``math`` (``code`` for the ``code`` category).

    Args:
        settings: Families, problems per family and seed.

    Raises:
        ValueError: If a family is not registered or ``per_family`` is not positive.
        ModuleNotFoundError: If reasoning-gym is not installed (names the install command).
    """

    name = "reasoning_gym"
    model_written = False

    def __init__(self, settings: ReasoningGymSettings = ReasoningGymSettings()) -> None:
        self.settings = settings
        if settings.per_family < 1:
            raise ValueError(f"per_family={settings.per_family}; expected at least 1 problem per family.")
        registered = _reasoning_gym_registry()
        unknown = [family for family in settings.families if family not in registered]
        if unknown:
            raise ValueError(
                f"unknown reasoning-gym families {unknown}; expected registered names, such as those of "
                "REASONING_GYM_FAMILIES."
            )
        self.chunk_size = settings.per_family
        self._categories = {family: registered[family] for family in settings.families}

    def __len__(self) -> int:
        return len(self.settings.families) * self.settings.per_family

    def describe(self) -> dict[str, Any]:
        """The settings and reasoning-gym's version, as JSON."""
        return {
            "name": self.name,
            "num_candidates": len(self),
            "settings": dataclasses.asdict(self.settings),
            "reasoning_gym": importlib.metadata.version("reasoning-gym"),
        }

    def family_seed(self, family: str) -> int:
        """The seed a family's problems are drawn with (31 bits)."""
        return _derived_seed("reasoning_gym", self.settings.seed, family) >> 32

    def candidates(self, start: int, stop: int) -> list[Candidate]:
        """The problems of the family (or families) that candidates ``start`` to ``stop - 1`` belong to."""
        per_family = self.settings.per_family
        found = []
        for family_number in range(start // per_family, (stop - 1) // per_family + 1):
            family = self.settings.families[family_number]
            first, last = max(start, family_number * per_family), min(stop, (family_number + 1) * per_family)
            seed = self.family_seed(family)
            category = self._categories[family]
            domain = "code" if category in _CODE_CATEGORIES else "math"
            # Some generators print progress dots: keep them off the caller's output.
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dataset = _reasoning_gym().create_dataset(family, size=per_family, seed=seed)
                questions = [dataset[index - family_number * per_family]["question"] for index in range(first, last)]
            for index, question in zip(range(first, last), questions, strict=True):
                details = {"family": family, "category": category, "item": index % per_family, "seed": seed}
                found.append(Candidate(question.strip(), domain, index, details))
        return found


def _reasoning_gym() -> ModuleType:
    if importlib.util.find_spec("reasoning_gym") is None:
        raise ModuleNotFoundError(
            "ReasoningGymSource needs the package 'reasoning_gym', which is not installed; install the prompt "
            f"packages with: {prompt_sets.INSTALL}"
        )
    return importlib.import_module("reasoning_gym")


def _reasoning_gym_registry() -> dict[str, str]:
    """Every registered reasoning-gym dataset and its category (the subpackage defining it)."""
    _reasoning_gym()
    registry = importlib.import_module("reasoning_gym.factory").DATASETS
    return {name: dataset_class.__module__.split(".")[1] for name, (dataset_class, _) in registry.items()}


# --------------------------------------------------------------------------------- stdlib


@dataclass(frozen=True)
class StdlibObject:
    """A public function, class or method of the standard library.

    Attributes:
        name: How users write it (``"textwrap.dedent"``, ``"pathlib.PurePath.with_suffix"``, ``"sorted"``).
        what: ``"function"``, ``"class"`` or ``"method"``.
        signature: Its parameters (``"(text)"``; ``""`` when they cannot be read); ``self`` and
            ``cls`` left out, and defaults whose text depends on the process shown as ``...``.
        summary: The first paragraph of its docstring that is not a signature, on one line.
    """

    name: str
    what: str
    signature: str
    summary: str


class _Default:
    """A parameter default shown as given text (signatures must read the same in every process)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


_MAX_SIGNATURE_CHARS = 160
_MAX_DEFAULT_CHARS = 40
_SIGNATURE_LINE = re.compile(r"^\s*[\w.]+\(.*\)|-->|->")


def _default_text(value: object) -> _Default:
    if isinstance(value, (set, frozenset)):
        text = type(value).__name__ + "(" + repr(sorted(value, key=repr)) + ")"
    else:
        text = repr(value)
    return _Default("..." if text.startswith("<") or " at 0x" in text or len(text) > _MAX_DEFAULT_CHARS else text)


def _signature(obj: object, drop_first: bool) -> str:
    try:
        signature = inspect.signature(obj)
    except Exception:  # no signature, or one whose defaults name what this process lacks (curses constants)
        return ""
    parameters = list(signature.parameters.values())
    if drop_first and parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    parameters = [
        p.replace(default=_default_text(p.default)) if p.default is not inspect.Parameter.empty else p
        for p in parameters
    ]
    text = str(signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty))
    return text if len(text) <= _MAX_SIGNATURE_CHARS else "(...)"


def _summary(doc: str | None, max_chars: int) -> str:
    """The first docstring paragraph that is not a signature, on one line, cut at a sentence within ``max_chars``."""
    if not doc or not isinstance(doc, str):
        return ""
    for paragraph in inspect.cleandoc(doc).split("\n\n"):
        text = " ".join(paragraph.split())
        if not text or _SIGNATURE_LINE.search(paragraph.splitlines()[0]):
            continue
        if len(text) > max_chars:
            sentences = re.split(r"(?<=[.!?])\s+", text)
            text = ""
            for sentence in sentences:
                if len(text) + len(sentence) + 1 > max_chars:
                    break
                text = f"{text} {sentence}".strip()
        return text
    return ""


def _skipped(name: str) -> bool:
    return any(part.startswith("_") or part in STDLIB_SKIPPED for part in name.split("."))


def _import_quietly(name: str) -> ModuleType | None:
    """Imports a module with its output and warnings held back; None when it fails or is deprecated."""
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        try:
            module = importlib.import_module(name)
        except Exception:  # another platform's module, a missing C library, ...
            return None
    deprecated = any(issubclass(warning.category, DeprecationWarning) for warning in caught)
    return None if deprecated else module


def _stdlib_modules(names: Sequence[str] | None) -> list[ModuleType]:
    """The modules to read: those named, or every public module and submodule of the standard library."""
    if names is not None:
        modules = []
        for name in names:
            module = _import_quietly(name)
            if module is None:
                raise ValueError(
                    f"the module {name!r} cannot be imported here; expected a module of the standard library "
                    "or of an installed package (install it, or leave it out of StdlibSettings.modules)."
                )
            modules.append(module)
        return modules
    found: dict[str, ModuleType] = {}

    def visit(name: str) -> None:
        module = _import_quietly(name)
        if module is None:
            return
        found[name] = module
        for info in sorted(pkgutil.iter_modules(getattr(module, "__path__", [])), key=lambda info: info.name):
            if not _skipped(info.name):
                visit(f"{name}.{info.name}")

    for name in sorted(sys.stdlib_module_names):
        if not _skipped(name):
            visit(name)
    return sorted(found.values(), key=lambda module: (module.__name__.count("."), module.__name__))


def _display_name(module_name: str, qualname: str) -> str:
    module_name = _MODULE_DISPLAY.get(module_name, module_name)
    return f"{module_name}.{qualname}" if module_name else qualname


def _belongs(obj: object, module: ModuleType) -> bool:
    """Whether ``obj`` is defined by ``module``'s package (``_heapq`` counts for ``heapq``)."""
    defined_in = getattr(obj, "__module__", None)
    if not isinstance(defined_in, str):
        return False
    return defined_in.lstrip("_").split(".")[0] == module.__name__.lstrip("_").split(".")[0]


def stdlib_objects(modules: Sequence[str] | None = None, max_summary_chars: int = 400) -> list[StdlibObject]:
    """The documented public functions, classes and methods of the standard library installed here (or of ``modules``).

    A module is read for the public names it exports (``__all__``, else its public names) that its
    own package defines; each object is listed once, under the name of the shallowest module that
    exports it, with the public methods its classes define and document themselves. Exceptions and
    objects without a docstring summary of four words or more are left out. Modules with side
    effects on import are never imported (:data:`STDLIB_SKIPPED`); their output and warnings are held back.

    Args:
        modules: Module names to read; None: every public module and submodule (see :class:`StdlibSettings`).
        max_summary_chars: Longest summary.

    Returns:
        The objects, sorted by name.

    Raises:
        ValueError: If a named module cannot be imported.
    """
    objects: dict[tuple[str, str], StdlibObject] = {}

    def add(obj: object, name: str, what: str, drop_first: bool) -> None:
        key = (getattr(obj, "__module__", ""), getattr(obj, "__qualname__", name))
        summary = _summary(getattr(obj, "__doc__", None), max_summary_chars)
        if key in objects or len(summary.split()) < 4:
            return
        objects[key] = StdlibObject(name, what, _signature(obj, drop_first), summary)

    for module in _stdlib_modules(modules):
        exported = getattr(module, "__all__", None)
        names = exported if isinstance(exported, (list, tuple)) else list(vars(module))
        for name in sorted({n for n in names if isinstance(n, str) and not n.startswith("_")}):
            obj = getattr(module, name, None)
            if not _belongs(obj, module) or (module is sys and hasattr(sys, f"__{name}__")):
                continue  # not its own, or a hook a process may replace (sys.excepthook keeps sys.__excepthook__)
            full_name = _display_name(module.__name__, name)
            if inspect.isclass(obj):
                if issubclass(obj, BaseException):
                    continue
                add(obj, full_name, "class", drop_first=False)
                for member_name, raw in sorted(vars(obj).items()):
                    if member_name.startswith("_") or not (inspect.isroutine(raw) or isinstance(raw, classmethod)):
                        continue
                    member = getattr(obj, member_name, None)
                    if member is not None and raw.__doc__:
                        add(member, f"{full_name}.{member_name}", "method", drop_first=True)
            elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
                add(obj, full_name, "function", drop_first=False)
    return sorted(objects.values(), key=lambda obj: obj.name)


def _package_versions(modules: Sequence[str]) -> dict[str, str]:
    """``{distribution: version}`` of the installed packages the modules belong to (none for the standard library)."""
    distributions = importlib.metadata.packages_distributions()
    tops = sorted({name.split(".")[0] for name in modules} - set(sys.stdlib_module_names))
    return {dist: importlib.metadata.version(dist) for top in tops for dist in sorted(set(distributions.get(top, [])))}


def _can_ask(kind: str, obj: StdlibObject) -> bool:
    """Whether a request of ``kind`` can be made about ``obj`` (``complete`` needs a function's signature)."""
    return kind != "complete" or (obj.what != "class" and obj.signature not in ("", "(...)"))


def _docstring_safe(text: str) -> str:
    """``text`` as it can stand inside a triple-quoted docstring (backslashes doubled, no closing quotes)."""
    return text.replace("\\", "\\\\").replace('"""', "'''")


def _function_stub(name: str, signature: str, docstring: str) -> str:
    """``def name(signature):`` with ``docstring`` (wrapped and made safe already) indented under it, no body."""
    return f'def {name}{signature}:\n    """{textwrap.indent(docstring, "    ").lstrip()}\n    """\n'


def _stub(name: str, signature: str, summary: str) -> str:
    """A function to complete, HumanEval's way: its signature, the summary as its docstring (wrapped, indented)."""
    return _function_stub(name, signature, textwrap.fill(_docstring_safe(summary), width=76))


class StdlibSource:
    """Code requests about the objects of the standard library (or of named modules): ``kinds_per_object`` kinds each.

    Candidate order: objects by name (:func:`stdlib_objects`), each object's kinds in the order of
    ``kinds``; the kinds of an object are drawn by a generator seeded with ``(seed, name)`` among
    those that can be asked about it (all of them, unless ``complete``: see :data:`REQUEST_KINDS`).

    Args:
        settings: Modules, kinds and seed.
        name: Recorded as each prompt's ``source`` (another for a source of other kinds).

    Raises:
        ValueError: If a kind is unknown, ``kinds_per_object`` is out of range or a named module cannot be imported.
    """

    model_written = False
    chunk_size = 500

    def __init__(self, settings: StdlibSettings = StdlibSettings(), name: str = "stdlib") -> None:
        unknown = [kind for kind in settings.kinds if kind not in REQUEST_KINDS]
        if unknown or not settings.kinds:
            raise ValueError(
                f"unknown request kinds {unknown} in {settings.kinds}; expected some of {list(REQUEST_KINDS)}."
            )
        if not 1 <= settings.kinds_per_object <= len(settings.kinds):
            raise ValueError(
                f"kinds_per_object={settings.kinds_per_object}; expected 1 to {len(settings.kinds)} (the kinds given)."
            )
        self.name = name
        self.settings = settings
        self.objects = stdlib_objects(settings.modules, settings.max_summary_chars)
        self._requests = []
        for obj in self.objects:
            kinds = [kind for kind in settings.kinds if _can_ask(kind, obj)]
            drawn = random.Random(f"stdlib/{settings.seed}/{obj.name}").sample(
                kinds, min(settings.kinds_per_object, len(kinds))
            )
            self._requests += [(obj, kind) for kind in sorted(drawn, key=settings.kinds.index)]

    def __len__(self) -> int:
        return len(self._requests)

    def describe(self) -> dict[str, Any]:
        """The settings, the Python version (and those of the packages read) and a digest of the objects, as JSON."""
        digest = hashlib.sha256(json.dumps([dataclasses.astuple(obj) for obj in self.objects]).encode()).hexdigest()
        packages = _package_versions(self.settings.modules or ())
        return {
            "name": self.name,
            "num_candidates": len(self),
            "settings": dataclasses.asdict(self.settings),
            "python": sys.version.split()[0],
            **({"packages": packages} if packages else {}),
            "num_objects": len(self.objects),
            "objects_sha256": digest,
        }

    @staticmethod
    def request(obj: StdlibObject, kind: str) -> str:
        """The request of one kind about an object.

        Raises:
            ValueError: If that kind cannot be asked about it (``complete`` about a class, or without a signature).
        """
        if not _can_ask(kind, obj):
            raise ValueError(
                f"a {kind!r} request about the {obj.what} {obj.name}{obj.signature}: expected a function or "
                "method whose signature can be read."
            )
        short = obj.name.rsplit(".", 1)[-1]
        return REQUEST_KINDS[kind].format(
            what=obj.what, name=obj.name, short=short, signature=obj.signature, summary=obj.summary,
            stub=_stub(short, obj.signature, obj.summary) if kind == "complete" else "",
        )  # fmt: skip

    def candidates(self, start: int, stop: int) -> list[Candidate]:
        """Requests ``start`` to ``stop - 1``."""
        return [
            Candidate(self.request(obj, kind), "code", index, {"object": obj.name, "kind": kind})
            for index, (obj, kind) in zip(range(start, stop), self._requests[start:stop], strict=True)
        ]


def _codeio_stub(signature: str, description: str, spec: str) -> str:
    """CodeIO's ``main_solution`` to complete: its signature, the task and its input/output spec as the docstring."""
    lines = [*textwrap.wrap(description, width=76), ""]
    for line in spec.strip().splitlines():
        indent = line[: len(line) - len(line.lstrip())]
        lines += textwrap.wrap(line, width=76, subsequent_indent=indent + "    ") or [""]
    return _function_stub("main_solution", signature, _docstring_safe("\n".join(lines)))


def codeio_completions(skip: int = prompt_sets.NUM_CODEIO_TASKS) -> list[str]:
    """CodeIO's tasks (reasoning-gym's ``codeio.jsonl.gz``) past the first ``skip``, as functions to complete.

    Each item is a real program whose entry point ``main_solution`` a task description and an
    input/output spec explain; the request asks, in HumanEval's form (:data:`REQUEST_KINDS`
    ``complete``), to complete ``main_solution`` from its signature as the item's code writes it, with
    the description and the spec as its docstring. The first ``skip`` items are left out
    (:mod:`spark_generate.prompt_sets` already asks for them as "write it" tasks), and so are items
    whose code does not parse or defines no top-level ``main_solution``.

    Returns:
        The requests, in the items' order.

    Raises:
        ModuleNotFoundError: If reasoning-gym is not installed (names the install command).
    """
    requests = []
    for item in prompt_sets.codeio_items()[skip:]:
        try:
            with warnings.catch_warnings():  # the programs' own invalid escapes
                warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
                tree = ast.parse(item["code_sample"])
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "main_solution":
                returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
                stub = _codeio_stub(f"({ast.unparse(node.args)}){returns}", item["task_description"],
                                    item["input_output_spec"])  # fmt: skip
                requests.append(REQUEST_KINDS["complete"].format(stub=stub))
                break
    return requests


class PromptListSource:
    """Prompts given as a list (a corpus from elsewhere), judged like those of the other sources.

    Args:
        name: Recorded as each prompt's ``source``.
        prompts: The prompts.
        domain: Their domain.
        model_written: Whether they get the request heuristics and the near-repeat test.
    """

    chunk_size = 1000

    def __init__(self, name: str, prompts: Sequence[str], domain: str = "chat", model_written: bool = False) -> None:
        self.name, self.prompts, self.domain, self.model_written = name, list(prompts), domain, model_written

    def __len__(self) -> int:
        return len(self.prompts)

    def describe(self) -> dict[str, Any]:
        """The name, domain and a digest of the prompts, as JSON."""
        return {
            "name": self.name, "num_candidates": len(self), "domain": self.domain,
            "model_written": self.model_written, "sha256": _digest(self.prompts),
        }  # fmt: skip

    def candidates(self, start: int, stop: int) -> list[Candidate]:
        """Prompts ``start`` to ``stop - 1``."""
        return [Candidate(self.prompts[index].strip(), self.domain, index) for index in range(start, stop)]


# ---------------------------------------------------------------------------------- filters


def rejection_reason(text: str, filters: FilterSettings = FilterSettings(), model_written: bool = True) -> str | None:
    """Why a prompt is not a usable request, judged on its text alone (None when it is).

    Every prompt must be non-empty and at most ``max_chars`` long; model-written text must also
    have ``min_words`` words with letters, must not open or read like an answer, and must not
    repeat itself (a run of ``max_char_run`` equal characters, a line more than ``max_line_repeats``
    times, or under ``min_distinct_trigrams`` distinct word 3-grams).

    Returns:
        ``"empty"``, ``"too_long"``, ``"too_short"``, ``"answer_like"``, ``"repetitive"`` or None.
    """
    text = text.strip()
    if not text:
        return "empty"
    if len(text) > filters.max_chars:
        return "too_long"
    if not model_written:
        return None
    words = [word for word in text.split() if any(character.isalnum() for character in word)]
    if len(words) < filters.min_words or not any(character.isalpha() for character in text):
        return "too_short"
    lower = text.lower()
    if lower.startswith(tuple(filters.answer_openings)) or any(phrase in lower for phrase in filters.answer_phrases):
        return "answer_like"
    if re.search(rf"(.)\1{{{filters.max_char_run - 1},}}", text, flags=re.DOTALL):
        return "repetitive"
    lines = Counter(line.strip() for line in text.splitlines() if line.strip())
    if lines and max(lines.values()) > filters.max_line_repeats:
        return "repetitive"
    words = lower.split()
    trigrams = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    if len(words) >= 12 and len(set(trigrams)) < filters.min_distinct_trigrams * len(trigrams):
        return "repetitive"
    return None


@functools.lru_cache(maxsize=4096)
def _shingles(text: str) -> frozenset[tuple[str, ...]]:
    """:func:`~spark_generate.prompt_sets.word_shingles`, remembered between a look-up and the add that follows."""
    return frozenset(prompt_sets.word_shingles(text))


class Deduplicator:
    """The kept prompts, indexed for exact and near-repeat look-ups.

    An exact repeat has the same words and symbols (case, spacing and sentence punctuation
    ignored, numbers kept: a Brainf*ck program or a grid of symbols is its symbols). A
    near-repeat has a Jaccard similarity of at least ``near_duplicate_jaccard`` with one kept
    prompt, over their word 5-grams with numbers masked
    (:func:`~spark_generate.prompt_sets.word_shingles`): the same request with other numbers or a
    few words changed. A 5-gram held by ``boilerplate_min`` kept prompts or more is *common* (an
    opening such as "write a python function that takes a list of") and is left out of both sides,
    so requests that share a frequent opening are compared by what they ask; a candidate made of
    common 5-grams only says nothing the kept prompts do not, and is a near-repeat.

    A look-up reads only the kept prompts that share a rare 5-gram with the candidate (each 5-gram
    lists ``boilerplate_min`` of them at most), so it costs the same with 300 or 30,000 kept prompts.

    Args:
        filters: The threshold and the boilerplate count.
    """

    def __init__(self, filters: FilterSettings = FilterSettings()) -> None:
        self.filters = filters
        self._exact: set[str] = set()
        self._postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
        self._kept: list[frozenset[tuple[str, ...]]] = []

    @staticmethod
    def key(text: str) -> str:
        """The text exact repeats share: its words and symbols in lower case, without ``.,!?;:'"``."""
        return " ".join(re.findall(r"\w+|[^\w\s.,!?;:'\"]", text.lower()))

    def __len__(self) -> int:
        return len(self._kept)

    def repeats(self, text: str, near: bool = True) -> str | None:
        """``"duplicate"``, ``"near_duplicate"`` (looked for when ``near``) or None."""
        if self.key(text) in self._exact:
            return "duplicate"
        if not near:
            return None
        shingles = _shingles(text)
        cap = self.filters.boilerplate_min
        rare = [shingle for shingle in shingles if len(self._postings.get(shingle, ())) < cap]
        if shingles and not rare:
            return "near_duplicate"
        threshold = self.filters.near_duplicate_jaccard
        # A rare 5-gram's postings are complete, so these counts are the exact intersections.
        shared = Counter(kept for shingle in rare for kept in self._postings.get(shingle, ()))
        for kept, count in sorted(shared.items()):
            if count < threshold * len(rare):
                continue  # the union holds all of ``rare``: this pair cannot reach the threshold
            kept_rare = sum(len(self._postings[shingle]) < cap for shingle in self._kept[kept])
            if count >= threshold * (len(rare) + kept_rare - count):
                return "near_duplicate"
        return None

    def add(self, text: str) -> None:
        """Adds a kept prompt."""
        self._exact.add(self.key(text))
        number = len(self._kept)
        shingles = _shingles(text)
        self._kept.append(shingles)
        for shingle in shingles:
            postings = self._postings[shingle]
            if len(postings) < self.filters.boilerplate_min:  # beyond that, the 5-gram is common: not read
                postings.append(number)


# ---------------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class SynthesisResult:
    """Where a prompt file stands after a run (all runs on the file counted).

    Attributes:
        path: The JSONL file.
        num_candidates: Candidates of all sources.
        num_done: Candidates judged so far.
        num_kept: Prompts written so far.
        counts: Per source: ``candidates`` judged, ``kept``, and ``removed`` by each reason.
        evaluation_overlap: Per source: candidates ``checked`` and ``dropped``, ``max_containment``.
        seconds: Time spent on the file by all runs.
        session_seconds: Time this run spent.
        report_path: The ``.report.json`` file.
    """

    path: Path
    num_candidates: int
    num_done: int
    num_kept: int
    counts: dict[str, dict[str, Any]]
    evaluation_overlap: dict[str, dict[str, Any]]
    seconds: float
    session_seconds: float
    report_path: Path

    @property
    def finished(self) -> bool:
        """Whether every candidate is judged."""
        return self.num_done == self.num_candidates


_EXAMPLES_PER_REASON = 3
_EXAMPLE_CHARS = 300


def _digest(texts: Sequence[str]) -> str:
    return hashlib.sha256(json.dumps(list(texts)).encode()).hexdigest()


def _empty_report(sources: Sequence[PromptSource]) -> dict[str, Any]:
    return {
        "progress": {"committed_bytes": 0, "num_done": 0, "num_kept": 0, "seconds": 0.0},
        "counts": {
            source.name: {"candidates": 0, "kept": 0, "removed": dict.fromkeys(REASONS, 0), "examples": {}}
            for source in sources
        },
        "evaluation_overlap": {
            source.name: {"checked": 0, "dropped": 0, "max_containment": 0.0, "examples": []} for source in sources
        },
        "versions": [],
    }


class _PromptFile:
    """The JSONL file and its report; :meth:`commit` appends whole records, then replaces the report."""

    def __init__(self, path: Path, settings: dict, sources: Sequence[PromptSource]) -> None:
        self.path = path
        self.report_path = path.with_name(path.name + ".report.json")
        self.report = _empty_report(sources)
        if self.report_path.exists():
            previous = json.loads(self.report_path.read_text())
            previous_settings = dict(previous.get("settings", {}))
            if "versions" in previous_settings:  # reports before the history kept one set, in the settings
                previous.setdefault("versions", [{"from_candidate": 0, "packages": previous_settings.pop("versions")}])
            if previous_settings != settings:
                raise ValueError(
                    f"{path} was made with other sources, settings or filters (see {self.report_path}); choose "
                    "another output file, or delete it and its .report.json to start over."
                )
            self.report = {key: previous[key] for key in self.report}
        elif path.exists() and path.stat().st_size:
            raise ValueError(
                f"{path} exists but has no {self.report_path.name}, so synthesize_prompts did not write it; choose "
                "another output file, or delete it to start over."
            )
        versions = json.loads(json.dumps(package_versions()))
        history = self.report["versions"]
        if not history or history[-1]["packages"] != versions:
            history.append({"from_candidate": self.report["progress"]["num_done"], "packages": versions})
        self.settings = settings
        committed = self.report["progress"]["committed_bytes"]
        if committed and (not path.exists() or path.stat().st_size < committed):
            raise ValueError(
                f"{path} is missing or shorter than the {committed} bytes its {self.report_path.name} records; delete "
                "both to start over."
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open_lines(path, committed)
        self.clock = time.monotonic()
        self.write_report()

    def kept_prompts(self) -> list[str]:
        """The prompts written so far, in order."""
        return [json.loads(line)["prompt"] for line in self.path.read_bytes().splitlines()]

    def write_report(self) -> None:
        write_json_atomically(self.report_path, {"settings": self.settings, **self.report})

    def commit(self, records: list[dict], num_done: int) -> None:
        """Appends ``records`` as whole lines, then records the new length and counts atomically."""
        num_bytes = append_lines(self.file, records)
        now = time.monotonic()
        progress = self.report["progress"]
        progress["committed_bytes"] += num_bytes
        progress["num_done"] = num_done
        progress["num_kept"] += len(records)
        progress["seconds"] += now - self.clock
        self.clock = now
        self.write_report()

    def close(self) -> None:
        """Records the time spent since the last commit and closes the file."""
        self.commit([], self.report["progress"]["num_done"])
        os.close(self.file)


class _Judge:
    """Runs the checks of :data:`REASONS` on candidates, in order, and counts what they remove."""

    def __init__(self, filters: FilterSettings, evaluation: Sequence[str], deduplicator: Deduplicator) -> None:
        self.filters, self.deduplicator = filters, deduplicator
        self.evaluation = list(evaluation)
        self.evaluation_index = prompt_sets.NearDuplicateIndex(self.evaluation, filters.evaluation_containment)

    @staticmethod
    def _remove(report: dict, source: PromptSource, candidate: Candidate, reason: str) -> None:
        counts = report["counts"][source.name]
        counts["removed"][reason] += 1
        examples = counts["examples"].setdefault(reason, [])
        if len(examples) < _EXAMPLES_PER_REASON:
            examples.append(candidate.prompt[:_EXAMPLE_CHARS])

    def judge(self, source: PromptSource, candidate: Candidate, report: dict) -> dict | None:
        """The record of a kept candidate, or None (the reason counted in ``report``)."""
        report["counts"][source.name]["candidates"] += 1
        reason = None if not candidate.prompt.strip() else candidate.rejection
        reason = reason or rejection_reason(candidate.prompt, self.filters, source.model_written)
        if reason is None:
            overlap, reference = self.evaluation_index.overlap(candidate.prompt)
            stats = report["evaluation_overlap"][source.name]
            stats["checked"] += 1
            stats["max_containment"] = max(stats["max_containment"], round(overlap, 4))
            if overlap >= self.filters.evaluation_containment:
                reason = "evaluation_overlap"
                stats["dropped"] += 1
                if len(stats["examples"]) < _EXAMPLES_PER_REASON:
                    stats["examples"].append({
                        "prompt": candidate.prompt[:_EXAMPLE_CHARS],
                        "evaluation_prompt": self.evaluation[reference][:_EXAMPLE_CHARS],
                        "containment": round(overlap, 4),
                    })  # fmt: skip
        if reason is None:
            reason = self.deduplicator.repeats(candidate.prompt, near=source.model_written)
        if reason is not None:
            self._remove(report, source, candidate, reason)
            return None
        self.deduplicator.add(candidate.prompt)
        report["counts"][source.name]["kept"] += 1
        return {
            "prompt": candidate.prompt, "domain": candidate.domain, "source": source.name, "index": candidate.index,
            **candidate.details,
        }  # fmt: skip


def _chunks(sources: Sequence[PromptSource]) -> Iterator[tuple[PromptSource, int, int, int]]:
    """``(source, start, stop, candidates before it)`` of every chunk, in order."""
    offset = 0
    for source in sources:
        for start in range(0, len(source), source.chunk_size):
            yield source, start, min(start + source.chunk_size, len(source)), offset
        offset += len(source)


def synthesize_prompts(
    sources: Sequence[PromptSource],
    output_path: str | Path,
    *,
    filters: FilterSettings = FilterSettings(),
    exclude: Sequence[str] = (),
    evaluation: Sequence[str] | None = None,
    max_minutes: float | None = None,
    progress: str | None = None,
) -> SynthesisResult:
    """Judges the candidates of every source in order and writes the kept prompts as JSONL (resumable).

    Args:
        sources: Where prompts come from, in order (earlier sources win exact and near repeats).
        output_path: The JSONL file; one this function began with the same arguments is continued.
        filters: What a kept prompt must satisfy.
        exclude: Prompts already in the corpus (such as
            :func:`~spark_generate.prompt_sets.mixed_training_prompts`): their repeats are dropped.
        evaluation: Prompts no kept prompt may nearly repeat; default
            :func:`~spark_generate.prompt_sets.evaluation_prompts`.
        max_minutes: Stop between chunks after this many minutes (run again to continue); None for no limit.
        progress: Label of a tqdm progress bar over the candidates (on stderr); None shows no bar.

    Returns:
        Where the file stands: candidates judged, prompts kept, counts per source and reason.

    Raises:
        ValueError: If no source is given, two share a name, ``max_minutes`` is not positive, or the
            existing file was made with other sources, settings or filters.
    """
    if not sources:
        raise ValueError("sources is empty; expected at least one prompt source (MagpieSource, ...).")
    names = [source.name for source in sources]
    if len(set(names)) != len(names):
        raise ValueError(f"sources {names} share a name; expected each source once.")
    if max_minutes is not None and max_minutes <= 0:
        raise ValueError(f"max_minutes={max_minutes}; expected a positive number of minutes, or None for no limit.")
    evaluation = prompt_sets.evaluation_prompts() if evaluation is None else list(evaluation)
    settings = json.loads(json.dumps({
        "sources": [source.describe() for source in sources],
        "filters": dataclasses.asdict(filters),
        "evaluation": {"num_prompts": len(evaluation), "sha256": _digest(evaluation)},
        "exclude": {"num_prompts": len(exclude), "sha256": _digest(exclude)},
    }))  # fmt: skip
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    output = _PromptFile(Path(output_path), settings, sources)
    session_start = output.report["progress"]["seconds"]
    deduplicator = Deduplicator(filters)
    for text in [*exclude, *output.kept_prompts()]:
        deduplicator.add(text)
    judge = _Judge(filters, evaluation, deduplicator)
    total = sum(len(source) for source in sources)
    done = output.report["progress"]["num_done"]
    bar = tqdm(total=total, initial=done, desc=progress, unit="prompt", disable=progress is None)
    try:
        for source, start, stop, offset in _chunks(sources):
            if offset + stop <= done:
                continue
            if deadline is not None and time.monotonic() >= deadline:
                break
            candidates = source.candidates(start, stop)
            report = copy.deepcopy(output.report)  # counted apart: a chunk cut off leaves no count behind
            records = [judge.judge(source, candidate, report) for candidate in candidates]
            output.report.update(counts=report["counts"], evaluation_overlap=report["evaluation_overlap"])
            done = offset + stop
            output.commit([record for record in records if record is not None], done)
            bar.update(stop - start)
            bar.set_postfix(kept=output.report["progress"]["num_kept"])
    finally:
        bar.close()
        output.close()
    report = output.report
    return SynthesisResult(
        path=output.path, num_candidates=total, num_done=report["progress"]["num_done"],
        num_kept=report["progress"]["num_kept"], counts=report["counts"],
        evaluation_overlap=report["evaluation_overlap"], seconds=report["progress"]["seconds"],
        session_seconds=report["progress"]["seconds"] - session_start, report_path=output.report_path,
    )  # fmt: skip
