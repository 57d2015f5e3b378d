"""The held-out copy-heavy requests: stable, every kind, well-formed, bounded and kept apart from the prompt sets."""

import ast
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tokenize
from collections import Counter
from pydoc_data.topics import topics

import pytest

from spark_generate import copy_heavy, prompt_sets


@pytest.fixture(scope="module")
def requests() -> list[copy_heavy.CopyRequest]:
    return copy_heavy.copy_heavy_requests()


def text(request: copy_heavy.CopyRequest) -> str:
    return "\n".join(message["content"] for message in request.messages)


def digest(conversations: list) -> str:
    return hashlib.sha256(json.dumps(conversations).encode()).hexdigest()


def test_every_kind_dealt_round_robin(requests):
    assert Counter(request.kind for request in requests) == dict.fromkeys(
        copy_heavy.KINDS, copy_heavy.REQUESTS_PER_KIND
    )
    assert [request.kind for request in requests[: len(copy_heavy.KINDS)]] == list(copy_heavy.KINDS)
    assert len({text(request) for request in requests}) == len(requests)
    assert copy_heavy.copy_heavy_prompts() == [request.messages for request in requests]


def test_kinds_filter_keeps_the_order(requests):
    chosen = copy_heavy.copy_heavy_requests(["convert", "fix-bug"])
    assert chosen == [request for request in requests if request.kind in ("fix-bug", "convert")]
    assert [request.kind for request in chosen[:2]] == ["fix-bug", "convert"]
    with pytest.raises(ValueError, match="unknown copy-heavy kinds"):
        copy_heavy.copy_heavy_prompts(["poetry"])


def test_deterministic_across_processes_and_hash_seeds(requests):
    code = (
        "import hashlib, json; from spark_generate import copy_heavy; "
        "print(hashlib.sha256(json.dumps(copy_heavy.copy_heavy_prompts()).encode()).hexdigest())"
    )
    environment = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, check=True)
    assert result.stdout.strip() == digest([request.messages for request in requests])


def test_conversations_are_well_formed_and_bounded(requests):
    for request in requests:
        roles = [message["role"] for message in request.messages]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], request.source
        assert all(message["content"].strip() for message in request.messages), request.source
        assert len(text(request)) <= copy_heavy.MAX_REQUEST_CHARS, request.source
    multi_turn = [request for request in requests if len(request.messages) > 1]
    assert {request.kind for request in multi_turn} == {"repeat-edit"}


def tokens(source: str) -> list[str]:
    return [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)]


def test_code_is_real_source_and_the_bug_one_operator(requests):
    for request in requests:
        blocks = re.findall(r"```python\n(.*?)\n```", text(request), flags=re.DOTALL)
        assert len(blocks) == (request.kind in ("type-hints", "fix-bug", "rename", "repeat-edit")), request.source
        for block in blocks:
            ast.parse(block)
        if request.kind == "fix-bug":
            module_name, _, name = request.source.rpartition(".")
            original = inspect.getsource(getattr(importlib.import_module(module_name), name)).rstrip()
            changed = [(a, b) for a, b in zip(tokens(original), tokens(blocks[0]), strict=True) if a != b]
            assert len(changed) == 1 and copy_heavy.SWAPPED_OPERATORS[changed[0][0]] == changed[0][1], request.source


def test_typos_change_the_paragraph(requests):
    typos = [request for request in requests if request.messages[0]["content"].startswith("Fix the typos")]
    reference = " ".join(" ".join(topic.split()) for topic in topics.values())
    assert typos
    for request in typos:
        paragraph = request.messages[0]["content"].split("\n\n", 1)[1]
        assert " ".join(paragraph.split()) not in reference, request.source


def test_no_near_duplicate_of_the_prompt_sets(requests):
    texts = [text(request) for request in requests]
    for references in (prompt_sets.evaluation_prompts(), prompt_sets.mixed_training_prompts()):
        index = prompt_sets.NearDuplicateIndex(references)
        repeats = [(request.source, index.overlap(body)) for request, body in zip(requests, texts, strict=True)
                   if index.is_near_duplicate(body)]  # fmt: skip
        assert not repeats
