"""On-policy regeneration with a tiny random target and a word-level tokenizer built in memory.

Checks the JSONL documents (prompt then answer, loss mask on the answer only), the chat template,
prompt files, the recorded settings, and that an interrupted run resumes to the same file.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from spark_generate.training import read_jsonl
from spark_generate.training.regenerate import SamplingSettings, read_prompts, regenerate

WORDS = ["<pad>", "<eos>", "<unk>", "user", ":", "assistant", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}assistant :"


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
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


PROMPTS = ["the cat sat", "a dog ran on the mat", "the mat", "cat", "dog sat on a cat"]
SETTINGS = SamplingSettings(max_new_tokens=6, temperature=1.0, top_p=1.0, top_k=0, seed=3)


def test_documents_are_prompt_then_answer_with_the_answer_masked(tmp_path, target):
    tokenizer = word_tokenizer()
    path = regenerate(target, tokenizer, PROMPTS, tmp_path / "data.jsonl", SETTINGS, batch_size=2)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [record["index"] for record in records] == list(range(len(PROMPTS)))
    for prompt, record in zip(PROMPTS, records, strict=True):
        prompt_ids = tokenizer(prompt).input_ids
        assert record["input_ids"][: len(prompt_ids)] == prompt_ids
        answer_length = len(record["input_ids"]) - len(prompt_ids)
        assert 1 <= answer_length <= SETTINGS.max_new_tokens
        assert record["loss_mask"] == [0] * len(prompt_ids) + [1] * answer_length
        assert 1 not in record["input_ids"][len(prompt_ids) : -1]  # cut after the first end-of-sequence
    meta = json.loads((tmp_path / "data.jsonl.meta.json").read_text())
    assert meta["sampling"]["temperature"] == 1.0 and meta["num_prompts"] == len(PROMPTS)
    assert len(read_jsonl(path)) == len(PROMPTS)


def test_chat_template_wraps_each_prompt(tmp_path, target):
    tokenizer = word_tokenizer(CHAT_TEMPLATE)
    path = regenerate(target, tokenizer, ["the cat"], tmp_path / "chat.jsonl", SETTINGS)
    record = json.loads(path.read_text())
    expected = tokenizer("user : the cat assistant :").input_ids
    assert record["input_ids"][: len(expected)] == expected
    assert record["loss_mask"][: len(expected)] == [0] * len(expected)


def test_an_interrupted_run_resumes_to_the_same_file(tmp_path, target):
    tokenizer = word_tokenizer()
    straight = regenerate(target, tokenizer, PROMPTS, tmp_path / "straight.jsonl", SETTINGS, batch_size=2)
    resumed = tmp_path / "resumed.jsonl"
    regenerate(target, tokenizer, PROMPTS, resumed, SETTINGS, batch_size=2)
    lines = resumed.read_text().splitlines(keepends=True)
    resumed.write_text("".join(lines[:3]) + lines[3][:5])  # three documents and a torn fourth line
    regenerate(target, tokenizer, PROMPTS, resumed, SETTINGS, batch_size=2)
    assert resumed.read_text() == straight.read_text()
    with pytest.raises(ValueError, match="other settings"):
        regenerate(target, tokenizer, PROMPTS, resumed, SamplingSettings(max_new_tokens=2), batch_size=2)


def test_prompt_files(tmp_path):
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
