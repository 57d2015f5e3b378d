"""Held-out copy-heavy requests: answers that mostly repeat text the conversation already holds.

A suffix drafter proposes continuations of text already written in the prompt or the output, so it
is measured on requests whose answers copy: code returned whole with a small change, a paragraph
reformatted or corrected, records converted from one format to another, an earlier answer repeated
with an addition. :func:`copy_heavy_requests` builds 48 such chat conversations, eight of each
kind in :data:`KINDS`, from material installed with Python itself:

* ``type-hints``, ``fix-bug``, ``rename`` and ``repeat-edit`` use the source of standard-library
  functions that have no docstring nor annotations (``heapq._siftup``, ``colorsys.rgb_to_hls``,
  ``locale._group``, ...; :data:`SOURCE_MODULES`), read with :func:`inspect.getsource`. ``fix-bug``
  changes one comparison or arithmetic operator (the middle one of the function, ``<`` to ``<=``,
  ``+`` to ``-``, ...) and asks for the fixed function; ``rename`` asks to rename the function's
  most used local name; ``repeat-edit`` is multi-turn: the user asks for the function, the
  assistant's turn is its real source, and the user asks for it again with a docstring (or type
  hints) added.
* ``text-edit``: prose paragraphs of the Python language reference as ``pydoc`` ships it
  (``pydoc_data.topics``), to reformat as bullet points or, with two letters swapped in one long
  word of six (chosen by a seeded generator), to correct.
* ``convert``: real tables of the standard library: ``http.HTTPStatus`` as a list to turn into a
  markdown table, ``unicodedata`` records of Greek letters and arrows as JSON to turn into YAML, the
  codec aliases of ``encodings.aliases`` as YAML to turn into JSON, and ``locale.locale_alias`` as
  CSV to turn into JSON.

None of it is in a training set of this project: the prompt sets of :mod:`spark_generate.prompt_sets`
come from HumanEval, CodeIO, GSM-Symbolic, reasoning-gym, MT-Bench, Vicuna-bench, WritingBench,
PersistBench and FreshQA, and the test suite checks that no request nearly repeats one of their
training or evaluation prompts (:func:`~spark_generate.prompt_sets.near_duplicates`); the
standard-library requests of ``spark_generate.training.prompt_synthesis`` quote docstring summaries,
which the functions chosen here do not have. The requests are a pure function of the Python
installation (another Python version has other sources), each under :data:`MAX_REQUEST_CHARS`
characters so that SmolLM2's 2,048-token window holds it and the answer. The order is stable and
deals the kinds round-robin, so any prefix of six requests holds one of each kind.
"""

from __future__ import annotations

import ast
import http
import importlib
import inspect
import io
import itertools
import json
import locale
import random
import tokenize
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from encodings.aliases import aliases as codec_aliases

__all__ = ["KINDS", "Conversation", "CopyRequest", "copy_heavy_prompts", "copy_heavy_requests"]

Conversation = list[dict[str, str]]

KINDS = ("type-hints", "fix-bug", "rename", "repeat-edit", "text-edit", "convert")
REQUESTS_PER_KIND = 8
MAX_REQUEST_CHARS = 1500
SOURCE_MODULES = (
    "colorsys", "heapq", "difflib", "glob", "urllib.parse", "email.utils", "gettext", "tokenize", "base64",
    "locale", "html", "shutil", "zipfile", "dataclasses", "inspect", "traceback", "argparse", "optparse",
    "pickletools", "plistlib", "copy", "enum", "typing",
)  # fmt: skip
SOURCE_CHARS = (300, 1000)
"""Shortest and longest function source taken, in characters."""
PARAGRAPH_CHARS = (400, 900)
TYPO_RATE = 1 / 6
MIN_TYPO_WORD = 6
RENAME_MIN_USES = 3
SWAPPED_OPERATORS = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "+": "-", "-": "+"}
SHORT_NAME_RENAMES = {
    "a": "first", "b": "second", "c": "char", "d": "mapping", "e": "error", "f": "func", "i": "index",
    "j": "position", "k": "key", "l": "items", "m": "match", "n": "count", "p": "part", "r": "result",
    "s": "text", "t": "item", "v": "value", "x": "element",
}  # fmt: skip


@dataclass(frozen=True)
class CopyRequest:
    """One copy-heavy request.

    Attributes:
        kind: One of :data:`KINDS`.
        source: Where its material comes from (``"heapq._siftup"``, ``"pydoc topic 'assert'"``, ...).
        messages: The chat conversation, ending with a user turn.
    """

    kind: str
    source: str
    messages: Conversation


def _user(text: str) -> Conversation:
    return [{"role": "user", "content": text}]


def _python(source: str) -> str:
    return f"```python\n{source.rstrip()}\n```"


# -------------------------------------------------------------------------------------- code


def _functions() -> list[tuple[str, str]]:
    """Undocumented, unannotated standard-library functions as ``(name, source)``, the modules dealt in turn."""
    per_module = []
    for module_name in SOURCE_MODULES:
        module = importlib.import_module(module_name)
        found = []
        for name, obj in vars(module).items():
            if not inspect.isfunction(obj) or obj.__module__ != module_name or obj.__doc__ or name.startswith("__"):
                continue
            source = inspect.getsource(obj)
            if not source.startswith("def "):  # decorated, or defined inside a block
                continue
            definition = ast.parse(source).body[0]
            annotated = any(node.annotation for node in ast.walk(definition) if isinstance(node, ast.arg))
            if (
                SOURCE_CHARS[0] <= len(source) <= SOURCE_CHARS[1] and source.isascii() and not annotated
                and isinstance(definition, ast.FunctionDef) and not definition.returns
            ):  # fmt: skip
                found.append((inspect.getsourcelines(obj)[1], f"{module_name}.{name}", source))
        per_module.append([(name, source) for _, name, source in sorted(found)])
    dealt = itertools.chain.from_iterable(itertools.zip_longest(*per_module))
    return [function for function in dealt if function is not None]


def _with_bug(source: str) -> str | None:
    """``source`` with its middle comparison or arithmetic operator swapped (None when it has none)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    candidates = [token for token in tokens if token.type == tokenize.OP and token.string in SWAPPED_OPERATORS]
    if not candidates:
        return None
    token = candidates[len(candidates) // 2]
    lines = source.splitlines(keepends=True)
    (row, start), (_, end) = token.start, token.end
    lines[row - 1] = lines[row - 1][:start] + SWAPPED_OPERATORS[token.string] + lines[row - 1][end:]
    return "".join(lines)


def _rename(source: str) -> tuple[str, str] | None:
    """The most used parameter or local name of the function and a new name for it (None when none is used enough)."""
    definition = ast.parse(source).body[0]
    local_names = {arg.arg for arg in ast.walk(definition) if isinstance(arg, ast.arg)}
    local_names |= {
        node.id for node in ast.walk(definition) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)
    }
    local_names -= {"self", "cls"}
    uses = [node.arg if isinstance(node, ast.arg) else node.id for node in ast.walk(definition)
            if isinstance(node, ast.arg | ast.Name)]  # fmt: skip
    ranked = sorted(local_names, key=lambda name: (-uses.count(name), source.index(name)))
    if not ranked or uses.count(ranked[0]) < RENAME_MIN_USES:
        return None
    old = ranked[0]
    new = SHORT_NAME_RENAMES.get(old, f"{old.strip('_')}_value")
    return None if new in source else (old, new)


def _type_hints(name: str, source: str, number: int) -> CopyRequest:
    request = "Add type hints and a Google-style docstring to this Python function, and return the whole function."
    return CopyRequest("type-hints", name, _user(f"{request}\n\n{_python(source)}"))


def _fix_bug(name: str, source: str, number: int) -> CopyRequest | None:
    buggy = _with_bug(source)
    if buggy is None:
        return None
    request = (
        "This Python function has a bug: one operator is wrong. Fix it and return the whole corrected function, "
        "with nothing else changed."
    )
    return CopyRequest("fix-bug", name, _user(f"{request}\n\n{_python(buggy)}"))


def _rename_request(name: str, source: str, number: int) -> CopyRequest | None:
    names = _rename(source)
    if names is None:
        return None
    old, new = names
    request = f"Rename the variable `{old}` to `{new}` throughout this Python function and return the whole function."
    return CopyRequest("rename", name, _user(f"{request}\n\n{_python(source)}"))


def _repeat_edit(name: str, source: str, number: int) -> CopyRequest:
    addition = "a docstring added" if number % 2 == 0 else "type hints added to its signature"
    messages = [
        {"role": "user", "content": f"Show me the source code of `{name}` from Python's standard library."},
        {"role": "assistant", "content": f"Here is `{name}`:\n\n{_python(source)}"},
        {"role": "user", "content": f"Repeat the function from your previous answer, with {addition}."},
    ]
    return CopyRequest("repeat-edit", name, messages)


CodeRequest = Callable[[str, str, int], CopyRequest | None]
CODE_KINDS: dict[str, CodeRequest] = {
    "type-hints": _type_hints, "fix-bug": _fix_bug, "rename": _rename_request, "repeat-edit": _repeat_edit,
}  # fmt: skip


def _code_requests() -> dict[str, list[CopyRequest]]:
    """The functions dealt to the code kinds: function ``i`` goes to the first kind from ``i mod 4`` that takes it."""
    taken: dict[str, list[CopyRequest]] = {kind: [] for kind in CODE_KINDS}
    kinds = list(CODE_KINDS)
    for index, (name, source) in enumerate(_functions()):
        for kind in kinds[index % len(kinds) :] + kinds[: index % len(kinds)]:
            if len(taken[kind]) < REQUESTS_PER_KIND:
                request = CODE_KINDS[kind](name, source, len(taken[kind]))
                if request is not None:
                    taken[kind].append(request)
                    break
    return taken


# -------------------------------------------------------------------------------------- text


def _paragraphs() -> list[tuple[str, str]]:
    """Prose paragraphs of the language reference as ``(topic, text)``: the first new one of each topic that qualifies.

    Topics share sections (``naming`` repeats ``execmodel``), so a paragraph is taken once.
    """
    from pydoc_data.topics import topics

    found: dict[str, str] = {}
    for topic in sorted(topics):
        for paragraph in topics[topic].split("\n\n"):
            lines = paragraph.splitlines()
            text = " ".join(line.strip() for line in lines)
            indented = any(line.startswith(" ") for line in lines)
            prose = text[:1].isupper() and text.isascii() and not any(mark in text for mark in ("::", "*", "|"))
            fits = PARAGRAPH_CHARS[0] <= len(text) <= PARAGRAPH_CHARS[1]
            if prose and fits and not indented and text not in found:
                found[text] = topic
                break
    return [(topic, text) for text, topic in found.items()]


def _with_typos(text: str, seed: str) -> str:
    """``text`` with two adjacent, different inner letters swapped in one long word of six (one at least)."""
    generator = random.Random(seed)
    words = text.split(" ")
    swappable = {
        index: [at for at in range(1, len(word) - 2) if word[at] != word[at + 1]]
        for index, word in enumerate(words)
        if len(word) >= MIN_TYPO_WORD and word.isalpha()
    }
    candidates = [index for index, positions in swappable.items() if positions]
    for index in sorted(generator.sample(candidates, max(1, round(TYPO_RATE * len(candidates))))):
        word, at = words[index], generator.choice(swappable[index])
        words[index] = word[:at] + word[at + 1] + word[at] + word[at + 2 :]
    return " ".join(words)


def _text_requests() -> list[CopyRequest]:
    """Paragraphs to reformat as bullet points (even numbers) or to correct (odd numbers)."""
    requests = []
    for number, (topic, text) in enumerate(_paragraphs()[:REQUESTS_PER_KIND]):
        if number % 2 == 0:
            request = "Reformat this paragraph as a bulleted list, one sentence per bullet, keeping the wording."
        else:
            request = "Fix the typos in this paragraph and return the corrected paragraph, with no other changes."
            text = _with_typos(text, f"copy-heavy/typos/{topic}")
        requests.append(CopyRequest("text-edit", f"pydoc topic {topic!r}", _user(f"{request}\n\n{text}")))
    return requests


# ----------------------------------------------------------------------------------- convert


def _http_statuses(number: int) -> CopyRequest:
    statuses = sorted(http.HTTPStatus)
    chosen = statuses[number * len(statuses) // 2 :][:8]
    listing = "\n".join(f"- {status.value} {status.phrase}: {status.description or 'no description'}"
                        for status in chosen)  # fmt: skip
    request = f"Turn this list into a markdown table with the columns Code, Phrase and Description.\n\n{listing}"
    return CopyRequest("convert", f"http.HTTPStatus {chosen[0].value}-{chosen[-1].value}", _user(request))


def _unicode_records(number: int) -> CopyRequest:
    first = (0x03B1, 0x2190)[number]  # Greek small letters, arrows
    records = [
        {
            "code_point": f"U+{code:04X}", "name": unicodedata.name(chr(code)),
            "category": unicodedata.category(chr(code)), "bidirectional": unicodedata.bidirectional(chr(code)),
            "mirrored": bool(unicodedata.mirrored(chr(code))),
            "east_asian_width": unicodedata.east_asian_width(chr(code)),
        }
        for code in range(first, first + 6)
    ]  # fmt: skip
    request = f"Convert this JSON to YAML.\n\n```json\n{json.dumps(records, indent=2)}\n```"
    return CopyRequest("convert", f"unicodedata U+{first:04X}-U+{first + 5:04X}", _user(request))


def _codec_aliases(number: int) -> CopyRequest:
    by_codec: dict[str, list[str]] = {}
    for alias, codec in sorted(codec_aliases.items()):
        by_codec.setdefault(codec, []).append(alias)
    codecs = sorted(by_codec)[number * len(by_codec) // 2 :][:5]
    lines = [f"- codec: {codec}\n  aliases: [{', '.join(json.dumps(alias) for alias in by_codec[codec])}]"
             for codec in codecs]  # fmt: skip
    yaml = "\n".join(lines)
    request = f"Convert this YAML to JSON (a list of objects).\n\n```yaml\n{yaml}\n```"
    return CopyRequest("convert", f"encodings.aliases {codecs[0]}-{codecs[-1]}", _user(request))


def _locale_aliases(number: int) -> CopyRequest:
    aliases = sorted(locale.locale_alias.items())
    chosen = aliases[number * len(aliases) // 2 :][:12]
    table = "\n".join(["alias,locale", *(f"{alias},{name}" for alias, name in chosen)])
    request = f"Convert this CSV to a JSON list of objects, one per row.\n\n```csv\n{table}\n```"
    return CopyRequest("convert", f"locale.locale_alias {chosen[0][0]}-{chosen[-1][0]}", _user(request))


def _convert_requests() -> list[CopyRequest]:
    """Two requests of each conversion, the conversions in turn."""
    conversions = (_http_statuses, _unicode_records, _codec_aliases, _locale_aliases)
    return [conversion(number) for number in range(2) for conversion in conversions]


# -------------------------------------------------------------------------------------- API


def copy_heavy_requests(kinds: Sequence[str] | None = None) -> list[CopyRequest]:
    """The copy-heavy requests of the given kinds, the kinds dealt round-robin (always in :data:`KINDS` order).

    Args:
        kinds: Some of :data:`KINDS`; None takes them all.

    Returns:
        ``REQUESTS_PER_KIND`` requests of each kind: request ``j`` of every kind before request ``j + 1`` of any.

    Raises:
        ValueError: If a kind is unknown.
    """
    wanted = KINDS if kinds is None else tuple(kinds)
    unknown = [kind for kind in wanted if kind not in KINDS]
    if unknown:
        raise ValueError(f"unknown copy-heavy kinds {unknown}; expected some of {KINDS}.")
    by_kind = {**_code_requests(), "text-edit": _text_requests(), "convert": _convert_requests()}
    dealt = itertools.zip_longest(*(by_kind[kind] for kind in KINDS if kind in wanted))
    return [request for request in itertools.chain.from_iterable(dealt) if request is not None]


def copy_heavy_prompts(kinds: Sequence[str] | None = None) -> list[Conversation]:
    """The conversations of :func:`copy_heavy_requests` (apply the chat template with a generation prompt).

    Args:
        kinds: Some of :data:`KINDS`; None takes them all.

    Raises:
        ValueError: If a kind is unknown.
    """
    return [request.messages for request in copy_heavy_requests(kinds)]
