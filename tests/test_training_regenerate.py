"""On-policy regeneration with a tiny random target and a word-level tokenizer built in memory.

Checks the JSONL documents (prompt then answer, loss mask on the answer only), the chat template
and prompt files; that greedy answers equal plain ``generate()`` on each prompt alone although
prompts are bucketed by length and rows leave the batch as they end (the target is chosen so that
answers end at different steps); that sampled answers do not depend on the batch size; and that a
run stopped by its time budget, interrupted mid-batch or cut off mid-write resumes to exactly the
file of one uninterrupted run. The ``regenerate`` command is run on a saved copy of the target.
"""

import dataclasses
import json
import lzma
from pathlib import Path

import pytest
import torch
from conftest import tiny_target
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spark_generate.cli import main
from spark_generate.training import read_jsonl
from spark_generate.training import regenerate as regenerate_module
from spark_generate.training.regenerate import (
    SamplingSettings,
    archive_file,
    data_directory,
    read_prompts,
    regenerate,
    restore_archived,
)

WORDS = ["<pad>", "<eos>", "<unk>", "user", ":", "assistant", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"
PROMPTS = [
    "the cat sat", "a dog ran on the mat", "the mat", "cat", "dog sat on a cat", "the dog", "a cat ran",
    "mat on the cat sat a dog ran",
]  # fmt: skip
GREEDY = SamplingSettings(max_new_tokens=12, do_sample=False)
SAMPLED = SamplingSettings(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, seed=3)


def word_tokenizer(chat_template: str | None = None) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="module")
def target():
    # Sharp random weights: greedy answers to PROMPTS end after 12, 3, 12, 12, 9, 12, 2 and 2 tokens.
    return tiny_target(
        num_layers=2, vocab_size=len(WORDS), hidden_size=32, intermediate_size=48, max_position_embeddings=64,
        initializer_range=0.3,
    )  # fmt: skip


def answers(path: Path) -> dict[int, list[int]]:
    """The answer ids of every document, by prompt index."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        record["index"]: [t for t, m in zip(record["input_ids"], record["loss_mask"], strict=True) if m]
        for record in records
    }


def test_documents_are_prompt_then_answer_with_the_answer_masked(tmp_path, target):
    tokenizer = word_tokenizer()
    result = regenerate(target, tokenizer, PROMPTS, tmp_path / "data.jsonl", SAMPLED, batch_size=3)
    records = [json.loads(line) for line in result.path.read_text().splitlines()]
    assert sorted(record["index"] for record in records) == list(range(len(PROMPTS)))
    for record in records:
        prompt_ids = tokenizer(PROMPTS[record["index"]]).input_ids
        assert record["input_ids"][: len(prompt_ids)] == prompt_ids
        answer_length = len(record["input_ids"]) - len(prompt_ids)
        assert 1 <= answer_length <= SAMPLED.max_new_tokens
        assert record["loss_mask"] == [0] * len(prompt_ids) + [1] * answer_length
        assert 1 not in record["input_ids"][len(prompt_ids) : -1]  # cut after the first end-of-sequence
    meta = json.loads((tmp_path / "data.jsonl.meta.json").read_text())
    assert meta["sampling"]["temperature"] == 1.0 and meta["num_prompts"] == len(PROMPTS)
    assert len(read_jsonl(result.path)) == len(PROMPTS)
    assert result.finished and result.num_done == len(PROMPTS)
    assert result.answer_tokens == sum(map(len, answers(result.path).values())) == result.session_answer_tokens


def test_chat_template_wraps_each_prompt(tmp_path, target):
    tokenizer = word_tokenizer(CHAT_TEMPLATE)
    path = regenerate(target, tokenizer, ["the cat"], tmp_path / "chat.jsonl", SAMPLED).path
    record = json.loads(path.read_text())
    expected = tokenizer("user : the cat assistant :").input_ids
    assert record["input_ids"][: len(expected)] == expected
    assert record["loss_mask"][: len(expected)] == [0] * len(expected)


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_greedy_answers_equal_plain_generate_on_each_prompt(tmp_path, target, batch_size):
    tokenizer = word_tokenizer()
    found = answers(regenerate(target, tokenizer, PROMPTS, tmp_path / "data.jsonl", GREEDY, batch_size).path)
    expected = {}
    for index, prompt in enumerate(PROMPTS):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        output = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=GREEDY.max_new_tokens, pad_token_id=0, eos_token_id=1,
        )[0, ids.shape[1] :].tolist()  # fmt: skip
        expected[index] = output[: output.index(1) + 1] if 1 in output else output
    assert found == expected
    # Rows ended at different steps, so rows really left the batch mid-way.
    assert len({len(answer) for answer in expected.values()}) >= 3


def test_sampled_answers_do_not_depend_on_the_batch(tmp_path, target):
    tokenizer = word_tokenizer()
    runs = [
        answers(regenerate(target, tokenizer, PROMPTS, tmp_path / f"{size}.jsonl", SAMPLED, size).path)
        for size in (1, 3, 8)
    ]
    assert runs[0] == runs[1] == runs[2]
    reseeded = SamplingSettings(**{**SAMPLED.__dict__, "seed": 4})
    assert answers(regenerate(target, tokenizer, PROMPTS, tmp_path / "4.jsonl", reseeded, 3).path) != runs[0]


class FakeClock:
    """Stands in for the module's ``time``: each reading is one second after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now


def test_a_run_stopped_by_its_budget_resumes_to_the_uninterrupted_file(tmp_path, target, monkeypatch):
    tokenizer = word_tokenizer()
    straight = regenerate(target, tokenizer, PROMPTS, tmp_path / "straight.jsonl", SAMPLED, batch_size=3).path
    monkeypatch.setattr(regenerate_module, "time", FakeClock())
    resumed = tmp_path / "resumed.jsonl"
    runs = []
    while not runs or not runs[-1].finished:
        runs.append(regenerate(target, tokenizer, PROMPTS, resumed, SAMPLED, batch_size=3, max_minutes=0.5))
        assert len(read_jsonl(resumed)) == runs[-1].num_done  # only whole records, all counted
        assert len(runs) < 20, "the budget never let the run progress"
    assert len(runs) >= 2 and all(run.session_answer_tokens for run in runs)
    assert resumed.read_bytes() == straight.read_bytes()
    assert runs[-1].answer_tokens == sum(run.session_answer_tokens for run in runs)
    progress = resumed.with_name("resumed.jsonl.progress.json").read_bytes()
    again = regenerate(target, tokenizer, PROMPTS, resumed, SAMPLED, batch_size=3, max_minutes=0.5)
    assert again == dataclasses.replace(runs[-1], session_answer_tokens=0, session_seconds=0.0)
    assert resumed.with_name("resumed.jsonl.progress.json").read_bytes() == progress  # a finished file: no time added


def test_an_interrupted_run_resumes_to_the_uninterrupted_file(tmp_path, target, monkeypatch):
    tokenizer = word_tokenizer()
    straight = regenerate(target, tokenizer, PROMPTS, tmp_path / "straight.jsonl", GREEDY, batch_size=3).path
    calls = []

    def interrupted_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 16:  # the second batch, after one of its rows ended (batches: 12, 12 and 3 forwards)
            raise KeyboardInterrupt
        return target_forward(*args, **kwargs)

    target_forward = regenerate_module.target_forward
    monkeypatch.setattr(regenerate_module, "target_forward", interrupted_forward)
    resumed = tmp_path / "resumed.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate(target, tokenizer, PROMPTS, resumed, GREEDY, batch_size=3)
    monkeypatch.undo()
    done = len(read_jsonl(resumed))
    assert 0 < done < len(PROMPTS)
    with resumed.open("ab") as file:  # a record whose write was cut off
        file.write(b'{"index": 5, "input_ids": [6, 12')
    result = regenerate(target, tokenizer, PROMPTS, resumed, GREEDY, batch_size=3)
    assert resumed.read_bytes() == straight.read_bytes()
    assert result.finished and 0 < result.session_answer_tokens < result.answer_tokens


def test_a_file_of_other_settings_or_origin_is_refused(tmp_path, target):
    tokenizer = word_tokenizer()
    path = regenerate(target, tokenizer, PROMPTS, tmp_path / "data.jsonl", SAMPLED, batch_size=3).path
    with pytest.raises(ValueError, match="other settings, prompts or target"):
        regenerate(target, tokenizer, PROMPTS, path, GREEDY, batch_size=3)
    with pytest.raises(ValueError, match="other settings, prompts or target"):
        regenerate(target, tokenizer, PROMPTS[::-1], path, SAMPLED, batch_size=3)
    foreign = tmp_path / "foreign.jsonl"
    foreign.write_text('{"input_ids": [1], "loss_mask": [1]}\n')
    with pytest.raises(ValueError, match=r"has no foreign\.jsonl\.progress\.json"):
        regenerate(target, tokenizer, PROMPTS, foreign, SAMPLED)


def test_prompt_files_and_arguments(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("the cat\n\na dog\n")
    assert read_prompts(text) == ["the cat", "a dog"]
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('{"prompt": "the cat"}\n{"messages": [{"role": "user", "content": "a dog"}]}\n')
    assert read_prompts(lines) == ["the cat", [{"role": "user", "content": "a dog"}]]
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no prompts"):
        read_prompts(empty)
    with pytest.raises(ValueError, match="does not exist"):
        read_prompts(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match="prompts is empty"):
        regenerate(None, None, [], tmp_path / "out.jsonl")
    with pytest.raises(ValueError, match=r"max_minutes=0; expected a positive number of minutes, or None"):
        regenerate(None, None, ["the cat"], tmp_path / "out.jsonl", max_minutes=0)
    with pytest.raises(ValueError, match=r"batch_size=0; expected at least 1"):
        regenerate(None, None, ["the cat"], tmp_path / "out.jsonl", batch_size=0)


def test_the_command_writes_to_the_data_folder_and_continues_within_its_budget(tmp_path, target, monkeypatch, capsys):
    folder = tmp_path / "target"
    target.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    monkeypatch.setenv("SPARK_GENERATE_CACHE", str(tmp_path / "cache"))
    command = ["regenerate", "--target", str(folder), "--prompts", str(prompts), "--greedy", "--max-new-tokens",
               "12", "--batch-size", "3", "--max-minutes", "0.5"]  # fmt: skip
    monkeypatch.setattr(regenerate_module, "time", FakeClock())
    assert main(command) == 0
    output = capsys.readouterr().out
    data = tmp_path / "cache" / "data" / "target-prompts.jsonl"
    assert data_directory() == tmp_path / "cache" / "data"
    assert f"in {data} (" in output and "stopped at the 0.5-minute budget: rerun to continue" in output
    for _ in range(20):
        assert main(command) == 0
        output = capsys.readouterr().out
        if "; done;" in output:
            break
    assert f"regenerate: {len(PROMPTS)} answers in {data} ({len(PROMPTS)}/{len(PROMPTS)} prompts" in output
    code = main(["regenerate", "--target", str(folder), "--prompts", "builtin:poetry"])
    assert code == 2 and "unknown training prompt set 'poetry'; expected one of" in capsys.readouterr().err


def test_an_archived_file_is_restored_once_with_its_sidecars_progress_last(tmp_path):
    """``restore_archived`` unpacks a committed xz file and copies the sidecars asked for, never over a live file."""
    archive = tmp_path / "archive"
    archive.mkdir()
    (archive / "answers.jsonl.xz").write_bytes(lzma.compress(b'{"index": 0}\n'))
    for suffix in (".meta.json", ".progress.json", ".report.json"):
        (archive / f"answers.jsonl{suffix}").write_text(json.dumps({"suffix": suffix}))
    path = tmp_path / "work" / "answers.jsonl"
    assert restore_archived(path, archive / "answers.jsonl.xz")
    assert path.read_bytes() == b'{"index": 0}\n'
    restored = sorted(item.name for item in path.parent.iterdir())
    assert restored == ["answers.jsonl", "answers.jsonl.meta.json", "answers.jsonl.progress.json"]
    path.write_bytes(b"grown further\n")
    assert not restore_archived(path, archive / "answers.jsonl.xz")  # the working copy wins
    assert path.read_bytes() == b"grown further\n"
    report = tmp_path / "other" / "answers.jsonl"
    assert restore_archived(report, archive / "answers.jsonl.xz", sidecars=(".report.json",))
    assert sorted(item.name for item in report.parent.iterdir()) == ["answers.jsonl", "answers.jsonl.report.json"]
    assert not restore_archived(tmp_path / "none.jsonl", archive / "none.jsonl.xz")


def test_a_file_is_archived_as_far_as_its_progress_vouches_and_restores_to_that(tmp_path):
    """``archive_file`` cuts the data at the progress it read (regeneration's or a report's), then restores."""
    work, archive = tmp_path / "work", tmp_path / "archive"
    work.mkdir()
    path = work / "answers.jsonl"
    path.write_bytes(b'{"index": 0}\n{"index": 1}\n{"ind')  # a record being written
    progress = {"committed_bytes": 13, "num_done": 1}
    path.with_name("answers.jsonl.meta.json").write_text(json.dumps({"seed": 0}))
    path.with_name("answers.jsonl.progress.json").write_text(json.dumps(progress))
    assert archive_file(path, archive / "answers.jsonl.xz") == 13
    assert lzma.decompress((archive / "answers.jsonl.xz").read_bytes()) == b'{"index": 0}\n'
    assert json.loads((archive / "answers.jsonl.progress.json").read_text()) == progress
    restored = tmp_path / "restored" / "answers.jsonl"
    assert restore_archived(restored, archive / "answers.jsonl.xz")
    assert restored.read_bytes() == b'{"index": 0}\n'
    assert restored.with_name("answers.jsonl.meta.json").read_text() == json.dumps({"seed": 0})
    prompts = work / "prompts.jsonl"
    prompts.write_bytes(b"a\nb\nc")
    report = {"settings": {}, "progress": {"committed_bytes": 4, "num_done": 9}}
    prompts.with_name("prompts.jsonl.report.json").write_text(json.dumps(report))
    assert archive_file(prompts, archive / "prompts.jsonl.xz", (".report.json",)) == 4
    assert json.loads((archive / "prompts.jsonl.report.json").read_text()) == report
    assert archive_file(prompts, archive / "whole.jsonl.xz", ()) == 5  # no progress: all of it
    assert sorted(item.name for item in archive.iterdir() if item.name.endswith(".tmp")) == []
