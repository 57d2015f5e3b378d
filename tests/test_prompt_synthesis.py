"""Training prompts without a dataset, on a tiny random chat model and a word-level tokenizer built in memory.

Checks the pre-query template of ChatML- and Llama-3-like templates (and the refusal of a tokenizer
without one), Magpie sampling (steering, reproducibility, truncation), each text filter, exact and
near-repeat deduplication (also at 30,000 prompts), the evaluation check refusing an evaluation
prompt, a light paraphrase and a quotation of one, the files written, a run stopped by its budget
or interrupted resuming to the uninterrupted file, and the reasoning-gym and standard-library
sources (many distinct prompts, none near an evaluation prompt, the same in every process).
"""

import ast
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from conftest import tiny_target
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spark_generate import prompt_sets
from spark_generate.training import prompt_synthesis
from spark_generate.training.prompt_synthesis import (
    REASONS,
    Deduplicator,
    FilterSettings,
    MagpieSettings,
    MagpieSource,
    PromptListSource,
    ReasoningGymSettings,
    ReasoningGymSource,
    StdlibSettings,
    StdlibSource,
    Steering,
    codeio_completions,
    pre_query_template,
    rejection_reason,
    synthesize_prompts,
)

SPECIAL = ["<pad>", "<|im_end|>", "<unk>", "<|im_start|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
WORDS = [
    *SPECIAL, "system", "user", "assistant", "You", "are", "helpful", "write", "solve", "explain", "python",
    "function", "that", "sorts", "list", "numbers", "cat", "dog", "sat", "on", "mat", "how", "many", "apples",
    "does", "Sam", "have", "what", "is", "the", "best", "way", "to", "learn", "plan", "trip", "Write", "Solve", "a",
]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_WITH_DEFAULT_SYSTEM = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nYou are helpful"
    "<|im_end|>\n{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
STEERING = {
    "code": Steering((None, "You are helpful"), ("Write a python function",), opener_share=0.75),
    "math": Steering((None,), ("Solve", "how many"), opener_share=0.75),
    "chat": Steering((None,), ()),
}
SMALL = MagpieSettings(num_prompts=12, temperature=1.0, top_p=1.0, max_new_tokens=16, batch_size=4, steering=STEERING)
LENIENT = FilterSettings(min_words=1)
NO_EVALUATION = ["an evaluation prompt that no generated prompt is anything like at all"]


def word_tokenizer(chat_template: str | None = CHATML, eos: str = "<|im_end|>") -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token=eos, unk_token="<unk>", bos_token="<|begin_of_text|>"
    )
    tokenizer.chat_template = chat_template
    tokenizer.name_or_path = "word-level"
    return tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_target(
        num_layers=2, vocab_size=len(WORDS), hidden_size=32, intermediate_size=48, max_position_embeddings=64,
        eos_token_id=1,
    )  # fmt: skip


@pytest.fixture(scope="module")
def evaluation() -> list[str]:
    return prompt_sets.evaluation_prompts()


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ------------------------------------------------------------------------------- templates


def test_the_pre_query_template_of_chatml_and_llama3_templates():
    chatml = pre_query_template(word_tokenizer(CHATML))
    assert chatml.prefix == "<|im_start|>user\n" and chatml.end_of_turn == "<|im_end|>"
    with_system = pre_query_template(word_tokenizer(CHATML), system="Be brief.")
    assert with_system.prefix == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    default_system = pre_query_template(word_tokenizer(CHATML_WITH_DEFAULT_SYSTEM))
    assert default_system.prefix == "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\n"
    llama3 = pre_query_template(word_tokenizer(LLAMA3, eos="<|eot_id|>"), system="Be brief.")
    assert llama3.prefix == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n"
    )
    assert llama3.end_of_turn == "<|eot_id|>"


def test_a_tokenizer_without_a_usable_chat_template_is_refused_clearly():
    with pytest.raises(ValueError, match=r"'word-level' has no chat template.*set tokenizer\.chat_template"):
        pre_query_template(word_tokenizer(None))
    with pytest.raises(ValueError, match=r"rendered the user's text 0 times .*expected it once"):
        pre_query_template(word_tokenizer("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% endfor %}"))
    bare = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match=r"writes nothing after a user's text .* pass end_of_turn="):
        pre_query_template(word_tokenizer(bare))
    assert pre_query_template(word_tokenizer(bare), end_of_turn="<|im_end|>").end_of_turn == "<|im_end|>"
    refusing = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
    refusing += "<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match=r"refused the conversation \['system', 'user'\].*system messages of None"):
        pre_query_template(word_tokenizer(refusing), system="Be brief.")


# ---------------------------------------------------------------------------------- Magpie


def test_magpie_steers_each_prompt_and_samples_the_same_requests_again(target):
    source = MagpieSource(target, word_tokenizer(), SMALL)
    plans = [source.plan(index) for index in range(len(source))]
    assert [domain for domain, _, _ in plans] == ["code", "math", "chat"] * 4
    assert {opener for domain, _, opener in plans if domain == "chat"} == {""}
    assert {opener for domain, _, opener in plans if domain == "math"} <= {"", "Solve", "how many"}
    assert len({(system, opener) for _, system, opener in plans}) >= 4  # the draws differ
    first = source.candidates(0, 4)
    assert [candidate.index for candidate in first] == [0, 1, 2, 3]
    for candidate, (domain, system, opener) in zip(first, plans, strict=False):
        assert candidate.domain == domain and candidate.details == {"system": system, "opener": opener or None}
        if candidate.rejection != "empty":
            assert candidate.prompt.startswith(opener)
    assert source.candidates(0, 4) == first  # each request's seed, not the global generator
    in_pairs = MagpieSource(target, word_tokenizer(), MagpieSettings(**{**SMALL.__dict__, "batch_size": 2}))
    assert in_pairs.candidates(0, 2) + in_pairs.candidates(2, 4) == first  # whatever the batch
    reseeded = MagpieSource(target, word_tokenizer(), MagpieSettings(**{**SMALL.__dict__, "seed": 1}))
    assert [c.prompt for c in reseeded.candidates(0, 4)] != [c.prompt for c in first]
    described = source.describe()
    assert described["end_of_turn"] == "<|im_end|>" and described["stop_ids"] == [1]
    assert described["settings"]["temperature"] == 1.0 and described["model"]["weights_sha256"]
    assert {t["system"] for t in described["pre_query_templates"]} == {None, "You are helpful"}


def test_a_request_leaves_its_batch_at_its_end_of_turn_and_ends_there(target):
    """Rows stop decoding at any stop token (end of turn or end of sequence), not when the batch's last one does."""
    widths = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        candidates = MagpieSource(target, word_tokenizer(), SMALL).candidates(0, 4)
    finally:
        hook.remove()
    ended = [candidate for candidate in candidates if candidate.rejection != "truncated"]
    assert ended and widths[0] == 4 and widths[-1] < 4  # finished rows left the batch
    assert all("<|im_end|>" not in candidate.prompt for candidate in candidates)


def test_magpie_marks_requests_that_do_not_end_within_the_budget(target):
    settings = MagpieSettings(**{**SMALL.__dict__, "max_new_tokens": 1})
    candidates = MagpieSource(target, word_tokenizer(), settings).candidates(0, 4)
    assert {candidate.rejection for candidate in candidates} <= {"truncated", "empty"}
    assert any(candidate.rejection == "truncated" for candidate in candidates)


def test_bad_magpie_settings_are_a_clear_error(target):
    steering = {**STEERING, "chat": Steering((None,), ("How do I",), opener_share=2)}
    with pytest.raises(ValueError, match=r"opener_share of .*'chat': 2\}; expected probabilities in .*top_p=0"):
        MagpieSource(target, word_tokenizer(), MagpieSettings(steering=steering, top_p=0))
    with pytest.raises(ValueError, match=r"domains \['poetry'\] have no steering"):
        MagpieSource(target, word_tokenizer(), MagpieSettings(domains=("poetry",)))


# ---------------------------------------------------------------------------------- filters


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("Write a Python function that sorts a list of numbers.", None),
        ("   ", "empty"),
        ("word " * 500, "too_long"),
        ("Hi!", "too_short"),
        ("12 + 7 = ?", "too_short"),
        ("Calculate 150*100.", "too_short"),
        ("Factorize 4x^3 + 2x^2 + 2x + 1.", None),
        ("Sure! Here is a function that sorts a list.", "answer_like"),
        ("Here's how you can plan a trip to Rome.", "answer_like"),
        ("I'm sorry, but I cannot help with that request.", "answer_like"),
        ("As an AI, I do not have personal opinions.", "answer_like"),
        ("Plan my trip. How can I assist you today with anything else?", "answer_like"),
        ("Explain this to me now!!!!!!!!!!!!!!!!!!!!!!!!!!!!", "repetitive"),
        ("List the steps.\nAdd one.\nAdd one.\nAdd one.", "repetitive"),
        ("what is the best way what is the best way what is the best way what is the best way", "repetitive"),
    ],
)
def test_each_filter(text, reason):
    assert rejection_reason(text) == reason


def test_generated_problems_are_only_checked_for_emptiness_and_length():
    grid = "Rotate this matrix:\n0 0 0 0\n0 0 0 0\n0 0 0 0\n0 0 0 0\n" + "#" * 20
    assert rejection_reason(grid) == "repetitive"
    assert rejection_reason(grid, model_written=False) is None
    assert rejection_reason("x" * 3000, model_written=False) == "too_long"


def test_exact_and_near_duplicates():
    deduplicator = Deduplicator()
    kept = "Write a Python function that reverses the words of a sentence and keeps the punctuation in place."
    deduplicator.add(kept)
    assert deduplicator.repeats("write a python function that REVERSES the words of a sentence, and keeps the "
                                "punctuation in place!") == "duplicate"  # fmt: skip
    assert deduplicator.repeats("Please write a Python function that reverses the words of a sentence and keeps "
                                "the punctuation where it was.") == "near_duplicate"  # fmt: skip
    assert deduplicator.repeats("Write a Python function that merges two sorted lists into one sorted list.") is None
    deduplicator.add("What does this Brainf*ck program print? ++++++++[>++++<-]>+.")
    assert deduplicator.repeats("What does this Brainf*ck program print? +++++++[>+++++<-]>.", near=False) is None
    assert deduplicator.repeats(kept.replace("Python", "Rust"), near=False) is None  # generators: exact repeats only
    # Numbers are masked for near-repeats (the same problem with other numbers), not for exact ones.
    deduplicator.add("Sam has 3 apples and buys 4 more at the market. How many apples does Sam have now?")
    other_numbers = "Sam has 12 apples and buys 9 more at the market. How many apples does Sam have now?"
    assert deduplicator.repeats(other_numbers, near=False) is None
    assert deduplicator.repeats(other_numbers) == "near_duplicate"


def test_a_frequent_opening_is_boilerplate_not_a_repeat():
    deduplicator = Deduplicator(FilterSettings(boilerplate_min=5))
    opening = "Write a Python function that takes a list of integers and returns"
    tails = ["the sum of the even ones", "the largest prime among them, or None",
             "them sorted by the sum of their digits, largest first", "the longest run that keeps increasing",
             "every pair of them that adds up to exactly ten"]  # fmt: skip
    short = f"{opening} the median of them."
    for tail in tails:
        assert deduplicator.repeats(f"{opening} {tail}.") is None
        deduplicator.add(f"{opening} {tail}.")
        if tail == tails[0]:
            assert deduplicator.repeats(short) == "near_duplicate"  # mostly the opening, seen once
    assert deduplicator.repeats(short) is None  # the opening is common now: compared by what it asks
    assert deduplicator.repeats(f"{opening}.") == "near_duplicate"  # nothing but the opening


def test_thirty_thousand_prompts_are_deduplicated_in_seconds():
    words = ["the", "a", "list", "string", "number", "sum", "value", "file", "table", "user", "name", "time", "date"]
    texts = [
        f"Write a Python function that {' '.join(words[(i * k) % len(words)] for k in range(1, 15))} {i}"
        for i in range(30_000)
    ]
    deduplicator = Deduplicator()
    start = time.perf_counter()
    for text in texts:
        if deduplicator.repeats(text) is None:
            deduplicator.add(text)
    assert time.perf_counter() - start < 30  # about 5 s on one core; all-pairs would take hours
    assert 0 < len(deduplicator) < len(texts)  # many of these texts repeat each other's words


# ------------------------------------------------------------------------------ evaluation


def test_the_evaluation_check_refuses_an_evaluation_prompt_a_paraphrase_and_a_quotation(tmp_path, evaluation):
    mt_bench = prompt_sets.load_prompts("chat", "eval")[0]
    humaneval = prompt_sets.load_prompts("code", "eval")[3]
    words = mt_bench.split()
    paraphrase = " ".join(["Kindly", *words[:8], "fascinating", *words[9:]])  # one word changed, one added
    quotation = f"My teacher gave me this task and I am stuck: {humaneval} Please help."
    clean = ["Write a limerick about a cat who learns to play the trumpet.", "How do I bake sourdough bread?"]
    index = prompt_sets.NearDuplicateIndex(evaluation)
    assert index.overlap(mt_bench) == (1.0, evaluation.index(mt_bench))
    assert index.is_near_duplicate(paraphrase) and index.is_near_duplicate(quotation)
    source = PromptListSource("list", [mt_bench, clean[0], paraphrase, quotation, clean[1]], model_written=True)
    result = synthesize_prompts([source], tmp_path / "prompts.jsonl")
    assert [record["prompt"] for record in read(result.path)] == clean
    overlap = result.evaluation_overlap["list"]
    assert overlap["checked"] == 5 and overlap["dropped"] == 3 and overlap["max_containment"] == 1.0
    assert overlap["examples"][0]["evaluation_prompt"] == mt_bench[:300]
    assert result.counts["list"]["removed"]["evaluation_overlap"] == 3


# ------------------------------------------------------------------------------ files, resume


def sources(target, tokenizer) -> list:
    generated = ["Solve 3 + 4 for the cat.", "Solve 3 + 4 for the cat.", "Explain how many apples Sam has."]
    return [PromptListSource("list", generated, domain="math"), MagpieSource(target, tokenizer, SMALL)]


def test_the_files_record_every_prompt_and_the_settings(tmp_path, target):
    tokenizer = word_tokenizer()
    result = synthesize_prompts(
        sources(target, tokenizer), tmp_path / "prompts.jsonl", filters=LENIENT, evaluation=NO_EVALUATION
    )
    records = read(result.path)
    assert result.finished and result.num_done == result.num_candidates == 15
    assert result.num_kept == len(records) >= 4
    assert records[:2] == [
        {"prompt": "Solve 3 + 4 for the cat.", "domain": "math", "source": "list", "index": 0},
        {"prompt": "Explain how many apples Sam has.", "domain": "math", "source": "list", "index": 2},
    ]
    for record in records[2:]:
        assert record["source"] == "magpie" and set(record) == {
            "prompt",
            "domain",
            "source",
            "index",
            "system",
            "opener",
        }
    counts = result.counts
    assert counts["list"]["removed"]["duplicate"] == 1 and counts["list"]["examples"]["duplicate"]
    assert counts["magpie"]["candidates"] == 12
    assert counts["magpie"]["kept"] + sum(counts["magpie"]["removed"].values()) == 12
    assert set(counts["magpie"]["removed"]) == set(REASONS)
    report = json.loads(result.report_path.read_text())
    assert report["settings"]["sources"][1]["settings"]["max_new_tokens"] == 16
    assert report["settings"]["filters"]["min_words"] == 1 and report["settings"]["evaluation"]["num_prompts"] == 1
    assert report["progress"]["num_kept"] == len(records)


class FakeClock:
    """Stands in for the module's ``time``: each reading is one second after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_a_run_stopped_by_its_budget_resumes_to_the_uninterrupted_file(tmp_path, target, monkeypatch):
    tokenizer = word_tokenizer()
    kwargs = {"filters": LENIENT, "evaluation": NO_EVALUATION}
    straight = synthesize_prompts(sources(target, tokenizer), tmp_path / "straight.jsonl", **kwargs)
    monkeypatch.setattr(prompt_synthesis, "time", FakeClock())
    resumed = tmp_path / "resumed.jsonl"
    runs = []
    while not runs or not runs[-1].finished:
        runs.append(synthesize_prompts(sources(target, tokenizer), resumed, max_minutes=0.05, **kwargs))
        assert len(read(resumed)) == runs[-1].num_kept
        assert len(runs) < 20, "the budget never let the run progress"
    assert len(runs) >= 3
    assert resumed.read_bytes() == straight.path.read_bytes()
    assert runs[-1].counts == straight.counts and runs[-1].evaluation_overlap == straight.evaluation_overlap


def test_a_run_continued_under_other_package_versions_records_them(tmp_path, target, monkeypatch):
    tokenizer = word_tokenizer()
    kwargs = {"filters": LENIENT, "evaluation": NO_EVALUATION}
    straight = synthesize_prompts(sources(target, tokenizer), tmp_path / "straight.jsonl", **kwargs)
    monkeypatch.setattr(prompt_synthesis, "time", FakeClock())
    path = tmp_path / "resumed.jsonl"
    first = synthesize_prompts(sources(target, tokenizer), path, max_minutes=0.05, **kwargs)
    assert 0 < first.num_done < first.num_candidates
    old = json.loads(first.report_path.read_text())
    [entry] = old["versions"]
    assert entry["from_candidate"] == 0 and entry["packages"]["torch"] == torch.__version__
    # A report of the earlier format kept the versions in its settings: read as the history's first entry.
    old["settings"]["versions"] = old.pop("versions")[0]["packages"]
    first.report_path.write_text(json.dumps(old))
    upgraded = {**entry["packages"], "transformers": "99.0.0"}
    monkeypatch.setattr(prompt_synthesis, "package_versions", lambda: upgraded)
    while not synthesize_prompts(sources(target, tokenizer), path, max_minutes=0.05, **kwargs).finished:
        pass
    assert path.read_bytes() == straight.path.read_bytes()
    report = json.loads(first.report_path.read_text())
    assert "versions" not in report["settings"]
    assert report["versions"] == [entry, {"from_candidate": first.num_done, "packages": upgraded}]


def test_an_interrupted_run_resumes_to_the_uninterrupted_file(tmp_path, target, monkeypatch):
    tokenizer = word_tokenizer()
    kwargs = {"filters": LENIENT, "evaluation": NO_EVALUATION}
    straight = synthesize_prompts(sources(target, tokenizer), tmp_path / "straight.jsonl", **kwargs)
    calls = []
    sample = MagpieSource._sample

    def interrupted_sample(self, prompts, batch):
        calls.append(batch)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return sample(self, prompts, batch)

    monkeypatch.setattr(MagpieSource, "_sample", interrupted_sample)
    resumed = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        synthesize_prompts(sources(target, tokenizer), resumed, **kwargs)
    monkeypatch.undo()
    assert 0 < len(read(resumed)) < straight.num_kept
    with resumed.open("ab") as file:  # a record whose write was cut off
        file.write(b'{"prompt": "Solve the cat')
    result = synthesize_prompts(sources(target, tokenizer), resumed, **kwargs)
    assert resumed.read_bytes() == straight.path.read_bytes() and result.counts == straight.counts


def test_a_file_of_other_settings_is_refused(tmp_path, target):
    tokenizer = word_tokenizer()
    path = tmp_path / "prompts.jsonl"
    synthesize_prompts(sources(target, tokenizer), path, filters=LENIENT, evaluation=NO_EVALUATION)
    with pytest.raises(ValueError, match="other sources, settings or filters"):
        synthesize_prompts(sources(target, tokenizer), path, evaluation=NO_EVALUATION)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"prompt": "the cat"}\n')
    with pytest.raises(ValueError, match=r"has no foreign\.jsonl\.report\.json"):
        synthesize_prompts(sources(target, tokenizer), foreign)
    with pytest.raises(ValueError, match=r"max_minutes=0; expected a positive number"):
        synthesize_prompts(sources(target, tokenizer), path, max_minutes=0)
    with pytest.raises(ValueError, match=r"share a name"):
        synthesize_prompts([PromptListSource("a", ["x"]), PromptListSource("a", ["y"])], path)


# ------------------------------------------------------------------- reasoning-gym, stdlib


def test_reasoning_gym_families_pose_many_distinct_problems_far_from_the_evaluation(tmp_path, evaluation):
    families = prompt_synthesis.REASONING_GYM_FAMILIES
    source = ReasoningGymSource(ReasoningGymSettings(per_family=4))
    assert len(source) == 4 * len(families) >= 280
    result = synthesize_prompts([source], tmp_path / "gym.jsonl", evaluation=evaluation)
    records = read(result.path)
    assert len(records) >= 0.95 * len(source) and len({r["prompt"] for r in records}) == len(records)
    assert {r["family"] for r in records} == set(families) and {r["domain"] for r in records} == {"math", "code"}
    assert result.evaluation_overlap["reasoning_gym"]["dropped"] == 0
    assert result.evaluation_overlap["reasoning_gym"]["max_containment"] < prompt_sets.NEAR_DUPLICATE_CONTAINMENT
    again = ReasoningGymSource(ReasoningGymSettings(families=families[:2], per_family=4)).candidates(0, 8)
    assert [c.prompt for c in again] == [r["prompt"] for r in records if r["family"] in families[:2]][: len(again)]
    with pytest.raises(ValueError, match=r"unknown reasoning-gym families \['chess'\]"):
        ReasoningGymSource(ReasoningGymSettings(families=("chess",)))
    left_out = set(prompt_synthesis.REASONING_GYM_LEFT_OUT)
    registered = set(importlib.import_module("reasoning_gym.factory").DATASETS)
    assert not set(families) & left_out and set(families) | left_out == registered  # each family placed on purpose


def test_stdlib_requests_name_real_functions_and_stay_far_from_the_evaluation(tmp_path, evaluation):
    modules = ("textwrap", "itertools", "statistics", "json", "heapq", "bisect", "fractions", "difflib")
    source = StdlibSource(StdlibSettings(modules=modules, kinds_per_object=3))
    names = {obj.name for obj in source.objects}
    assert {"textwrap.dedent", "itertools.chain", "statistics.median", "json.dumps", "heapq.heappush"} <= names
    dedent = next(obj for obj in source.objects if obj.name == "textwrap.dedent")
    assert dedent.signature == "(text)" and dedent.summary.startswith("Remove any common leading whitespace")
    assert StdlibSource.request(dedent, "tests").startswith(
        "Write pytest unit tests for the function `textwrap.dedent(text)`"
    )
    assert len(source) == 3 * len(source.objects) >= 300
    result = synthesize_prompts([source], tmp_path / "stdlib.jsonl", evaluation=evaluation)
    records = read(result.path)
    assert len(records) == len(source)  # all distinct, none near an evaluation prompt
    assert result.evaluation_overlap["stdlib"]["max_containment"] < prompt_sets.NEAR_DUPLICATE_CONTAINMENT
    assert len({(r["object"], r["kind"]) for r in records}) == len(records)
    assert all(" at 0x" not in r["prompt"] for r in records)
    with pytest.raises(ValueError, match=r"unknown request kinds \['sing'\]"):
        StdlibSource(StdlibSettings(modules=modules, kinds=("sing",)))


def test_completion_requests_are_humaneval_stubs_of_functions_that_parse(tmp_path, evaluation):
    modules = ("textwrap", "itertools", "statistics", "json", "heapq", "bisect", "fractions", "difflib")
    settings = StdlibSettings(modules=modules, kinds=("complete",), kinds_per_object=1)
    source = StdlibSource(settings, name="stdlib_complete")
    askable = [obj for obj in source.objects if obj.what != "class" and obj.signature not in ("", "(...)")]
    assert len(source) == len(askable) < len(source.objects)  # classes are not asked about
    result = synthesize_prompts([source], tmp_path / "complete.jsonl", evaluation=evaluation)
    records = read(result.path)
    assert {r["source"] for r in records} == {"stdlib_complete"} and {r["kind"] for r in records} == {"complete"}
    by_name = {obj.name: obj for obj in askable}
    for record in records:
        head, code = record["prompt"].split("```python\n")
        assert head == "Complete the following Python function.\n\n" and code.endswith('    """\n```')
        (function,) = ast.parse(code.removesuffix("```") + "    pass\n").body  # a whole def, its body to write
        obj = by_name[record["object"]]
        assert function.name == obj.name.rsplit(".", 1)[-1]
        assert " ".join(ast.get_docstring(function).split()) == obj.summary.replace('"""', "'''")
    dedent = next(obj for obj in askable if obj.name == "textwrap.dedent")
    assert StdlibSource.request(dedent, "complete") == (
        "Complete the following Python function.\n\n```python\ndef dedent(text):\n"
        '    """Remove any common leading whitespace from every line in `text`.\n    """\n```'
    )
    fraction = next(obj for obj in source.objects if obj.name == "fractions.Fraction")
    with pytest.raises(ValueError, match=r"a 'complete' request about the class fractions.Fraction"):
        StdlibSource.request(fraction, "complete")
    assert len(StdlibSource(StdlibSettings(modules=modules))) == 2 * len(source.objects)  # the default kinds


def test_codeio_requests_complete_main_solution_with_its_task_and_spec_as_docstring():
    items = prompt_sets.codeio_items()
    requests = codeio_completions()
    assert len(requests) > 1900 and codeio_completions(skip=0)[-len(requests) :] == requests
    unseen = [item["task_description"] for item in items[prompt_sets.NUM_CODEIO_TASKS :]]
    for request, item in zip(requests[:300], items[prompt_sets.NUM_CODEIO_TASKS :], strict=False):
        head, code = request.split("```python\n")
        assert head == "Complete the following Python function.\n\n" and code.endswith('    """\n```')
        (function,) = ast.parse(code.removesuffix("```") + "    pass\n").body  # a whole def, its body to write
        with warnings.catch_warnings():  # the programs' own invalid escapes
            warnings.simplefilter("ignore", (SyntaxWarning, DeprecationWarning))
            program = ast.parse(item["code_sample"]).body
        (original,) = [node for node in program if getattr(node, "name", "") == "main_solution"]
        assert function.name == "main_solution" and ast.dump(function.args) == ast.dump(original.args)
        expected = (item["task_description"] + item["input_output_spec"]).replace('"""', "'''")
        assert "".join(ast.get_docstring(function).split()) == "".join(expected.split())  # wrapped, escaped, whole
    asked = " ".join(prompt_sets.load_prompts("code", "train"))
    first = items[prompt_sets.NUM_CODEIO_TASKS - 1]["task_description"]
    assert first in asked and not any(description in asked for description in unseen)  # the recipe asks for those


def test_an_installed_package_is_read_like_the_stdlib_and_its_version_recorded():
    settings = StdlibSettings(modules=("tqdm",), kinds=("complete",), kinds_per_object=1)
    source = StdlibSource(settings, name="package_complete")
    assert {"tqdm.tqdm", "tqdm.tqdm.close"} <= {obj.name for obj in source.objects}
    assert all(obj.name.startswith("tqdm.") for obj in source.objects) and len(source) >= 10
    described = source.describe()
    assert described["packages"] == {"tqdm": importlib.metadata.version("tqdm")}
    assert "packages" not in StdlibSource(StdlibSettings(modules=("textwrap",))).describe()  # the stdlib's: Python's
    with pytest.raises(ValueError, match=r"the module 'no_such_package' cannot be imported here; expected a module"):
        StdlibSource(StdlibSettings(modules=("no_such_package",)))


def test_the_whole_stdlib_walk_is_quiet_safe_and_the_same_in_every_process():
    code = (
        "import sys, json\n"
        "from spark_generate.training.prompt_synthesis import STDLIB_SKIPPED, StdlibSource\n"
        "source = StdlibSource()\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in STDLIB_SKIPPED - {'encodings', 'site', "
        "'__main__', 'ntpath'})\n"
        "sys.stdout.write(json.dumps([source.describe()['objects_sha256'], len(source.objects), loaded]))\n"
    )
    environment = {**os.environ, "PYTHONHASHSEED": "0"}  # this process has another hash seed, most likely
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment)
    assert result.returncode == 0, result.stderr
    digest, count, loaded = json.loads(result.stdout)  # nothing else was printed
    assert count >= 3000 and loaded == []
    source = StdlibSource()
    assert source.describe()["objects_sha256"] == digest and len(source) == 2 * count


def test_magpie_stops_at_an_end_of_turn_of_several_tokens(target):
    template = "{% for m in messages %}user : {{ m['content'] }} sat on mat{% endfor %}"
    tokenizer = word_tokenizer(template, eos="<|im_end|>")
    source = MagpieSource(target, tokenizer, SMALL)
    assert source.end_of_turn == "sat on mat" and source.stop_strings == ("sat on mat",)
    assert source.stop_ids == (1,)  # the end-of-sequence token still ends a request
    ids = tokenizer("the cat sat on mat the dog", add_special_tokens=False).input_ids
    assert source._request("", [], ids) == ("the cat", None)
    assert source._request("", [], ids[:3]) == ("the cat sat", "truncated")
    assert {candidate.rejection for candidate in source.candidates(0, 4)} <= {"truncated", "special_tokens", None}
