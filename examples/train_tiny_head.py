"""Train a DSpark head on one CPU in about a minute and watch its acceptance rise.

A tiny 4-layer Llama is first fitted for a few seconds to text from Python's standard library (so
it has something predictable to say), then a head is trained against it with
:class:`~spark_generate.training.Trainer` and measured before and after: teacher-forced acceptance
and tau on held-out chunks, and tau of real speculative sampling. With a real target, replace the
fitted model by ``AutoModelForCausalLM.from_pretrained(...)`` and the chunks by
``read_jsonl("data.jsonl")`` from ``spark-generate regenerate``.

    python examples/train_tiny_head.py
"""

import pathlib
import sysconfig
import tempfile

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM

from spark_generate.heads import DSparkHead
from spark_generate.training import TokenDataset, Trainer, TrainingConfig
from spark_generate.training.evaluation import evaluate_online, evaluate_teacher_forced

library = pathlib.Path(sysconfig.get_paths()["stdlib"])
text = "\n".join((library / name).read_text() for name in ("textwrap.py", "string.py", "bisect.py", "shlex.py"))
tokenizer = Tokenizer(models.BPE())
tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tokenizer.train_from_iterator(
    [text], trainers.BpeTrainer(vocab_size=384, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
)
ids = tokenizer.encode(text).ids
chunks = [ids[i : i + 64] for i in range(0, len(ids) - 64, 64)]
train_chunks, held_out = chunks[:-16], chunks[-16:]

config = LlamaConfig(
    vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
)  # fmt: skip
torch.manual_seed(0)
target = LlamaForCausalLM(config)
optimizer = torch.optim.AdamW(target.parameters(), lr=3e-3)
for _ in range(120):  # fit the target briefly
    batch = torch.tensor(train_chunks)[torch.randint(len(train_chunks), (8,))]
    target(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
target.eval().requires_grad_(False)


def documents(chunks: list[list[int]], description: str) -> TokenDataset:
    return TokenDataset(tuple(map(tuple, chunks)), tuple((1,) * len(chunk) for chunk in chunks), description)


head = DSparkHead.from_target(target, num_draft_layers=1, markov_rank=16, block_size=4)
prompts = [chunk[:16] for chunk in held_out[:8]]
for label, train in (("untrained", False), ("trained", True)):
    if train:
        settings = TrainingConfig(tempfile.mkdtemp(), num_steps=300, batch_size=4, num_anchors=32, learning_rate=3e-3)
        result = Trainer(head, target, documents(train_chunks, "stdlib chunks"), settings).train()
        print("checkpoint:", result.checkpoint)
    offline = evaluate_teacher_forced(head, target, documents(held_out, "held-out stdlib chunks"))
    online = evaluate_online(head, target, prompts, max_new_tokens=48, do_sample=True)
    acceptance = " ".join(f"{rate:.2f}" for rate in offline.acceptance.tolist())
    # Per block on held-out text vs per round along the target's own samples: related, not equal
    # (evaluate_teacher_forced_decoding predicts online tau from the target's own answers).
    print(f"{label:>9}: teacher-forced tau per block {offline.tau:.2f} (acceptance {acceptance}), "
          f"online tau (T = 1) {online.tau:.2f}")  # fmt: skip
