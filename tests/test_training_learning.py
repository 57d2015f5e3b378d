"""The learning test: a head trained for a few hundred steps drafts clearly better than an untrained one.

The target is a tiny 4-layer Llama (hidden 64, a 384-token byte-level BPE vocabulary trained in
memory) fitted briefly to text from Python's standard library, so its next-token distributions
are peaked and predictable. The head is then trained with :class:`Trainer` on the same corpus and
measured on held-out chunks before and after: teacher-forced acceptance and tau, and online tau
from real speculative sampling (temperature 1) through ``DSparkForCausalLM``. Only improvements are
asserted, never timings. Nothing touches the Hub; it takes well under a minute on 2 cores.
"""

import pathlib
import sysconfig

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from spark_generate.heads import DSparkHead
from spark_generate.training import TokenDataset, Trainer, TrainingConfig
from spark_generate.training.evaluation import evaluate_online, evaluate_teacher_forced

pytestmark = pytest.mark.slow

STDLIB_FILES = ("textwrap.py", "string.py", "bisect.py", "fnmatch.py", "colorsys.py", "shlex.py")
CHUNK = 64


def stdlib_chunks() -> tuple[list[list[int]], int]:
    """Token chunks of a few standard-library modules, and the vocabulary size."""
    library = pathlib.Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join((library / name).read_text() for name in STDLIB_FILES)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([text], trainer)
    ids = tokenizer.encode(text).ids
    return [ids[i : i + CHUNK] for i in range(0, len(ids) - CHUNK, CHUNK)], tokenizer.get_vocab_size()


def fitted_target(chunks: list[list[int]], vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
    data = torch.tensor(chunks)
    generator = torch.Generator().manual_seed(0)
    for _ in range(120):
        batch = data[torch.randint(len(data), (8,), generator=generator)]
        target(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return target.eval().requires_grad_(False)


def documents(chunks: list[list[int]], description: str) -> TokenDataset:
    return TokenDataset(tuple(map(tuple, chunks)), tuple((1,) * len(chunk) for chunk in chunks), description)


def test_training_raises_teacher_forced_acceptance_and_online_tau(tmp_path):
    chunks, vocab_size = stdlib_chunks()
    train_chunks, held_out = chunks[:-16], chunks[-16:]
    target = fitted_target(train_chunks, vocab_size)
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, num_draft_layers=1, markov_rank=16, block_size=4)
    held_out_data = documents(held_out, "held-out stdlib chunks")
    prompts = [chunk[:16] for chunk in held_out[:8]]

    before = evaluate_teacher_forced(head, target, held_out_data)
    online_before = evaluate_online(head, target, prompts, max_new_tokens=48, do_sample=True)
    settings = TrainingConfig(
        str(tmp_path), num_steps=300, batch_size=4, num_anchors=32, learning_rate=3e-3, progress=False
    )
    Trainer(head, target, documents(train_chunks, "stdlib chunks"), settings).train()
    after = evaluate_teacher_forced(head, target, held_out_data)
    online_after = evaluate_online(head, target, prompts, max_new_tokens=48, do_sample=True)

    print(
        f"teacher-forced tau {before.tau:.3f} -> {after.tau:.3f}, acceptance {before.acceptance} -> {after.acceptance}"
    )
    print(f"online tau {online_before.tau:.3f} -> {online_after.tau:.3f}")
    assert after.tau > before.tau + 0.3
    assert (after.acceptance > before.acceptance + 0.1).all()
    assert after.confidence_error < before.confidence_error
    assert online_after.tau > online_before.tau + 0.2
