"""Hub-hosted heads for plain Transformers: ``generate(custom_generate=<head folder>, trust_remote_code=True)``.

A saved head carries ``custom_generate/generate.py``; Transformers imports a copy of it from its
modules cache and calls it with every argument of ``generate()``. These tests run that path end to
end on a tiny random float64 target, from a local folder and from a Hub id in an offline cache, and
check that the shipped head's folder carries the current files.
"""

import filecmp
from pathlib import Path

import pytest
import torch
from test_generation import prompts, tiny_head, tiny_target

from spark_generate.heads import DSparkHead
from spark_generate.heads.custom_generate import CUSTOM_GENERATE_DIR, write_custom_generate
from spark_generate.telemetry import DSparkGenerateOutput

SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "model_cards" / "smollm2-135m-instruct-dspark"


@pytest.fixture(scope="module")
def llama():
    return tiny_target("llama")


@pytest.fixture(scope="module")
def head_folder(llama, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("heads") / "tiny-dspark"
    tiny_head(llama).save_pretrained(folder)
    return folder


def test_save_pretrained_writes_the_custom_generate_folder(head_folder, llama, tmp_path):
    files = sorted(path.name for path in (head_folder / CUSTOM_GENERATE_DIR).iterdir())
    assert files == ["generate.py", "requirements.txt"]
    requirements = (head_folder / CUSTOM_GENERATE_DIR / "requirements.txt").read_text().splitlines()
    assert [line for line in requirements if not line.startswith("#")] == ["spark-generate"]
    tiny_head(llama).save_pretrained(tmp_path, custom_generate=False)
    assert not (tmp_path / CUSTOM_GENERATE_DIR).exists()


def test_greedy_output_from_a_local_folder_is_plain_generate(head_folder, llama):
    input_ids, attention_mask = prompts(3)
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 12}
    plain = llama.generate(input_ids, **kwargs)
    spec = llama.generate(input_ids, custom_generate=str(head_folder), trust_remote_code=True, **kwargs)
    assert torch.equal(spec, plain)
    out = llama.generate(
        input_ids, custom_generate=str(head_folder), trust_remote_code=True, return_dict_in_generate=True, **kwargs
    )
    assert isinstance(out, DSparkGenerateOutput), "the DSpark loop ran, not plain generate()"
    assert torch.equal(out.sequences, plain) and out.dspark_stats is not None
    cached = llama.__dict__["_dspark_custom_generate"]
    assert len(cached) == 1, "the head is loaded once per folder and placement"


def test_sampled_output_takes_a_seed_and_is_reproducible(head_folder, llama):
    input_ids, attention_mask = prompts(2)
    kwargs = {"attention_mask": attention_mask, "do_sample": True, "max_new_tokens": 10, "seed": 3}
    first = llama.generate(input_ids, custom_generate=str(head_folder), trust_remote_code=True, **kwargs)
    again = llama.generate(input_ids, custom_generate=str(head_folder), trust_remote_code=True, **kwargs)
    assert torch.equal(first, again)


def test_a_hub_id_is_read_from_the_offline_cache(head_folder, llama, tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--tiny-dspark"
    DSparkHead.from_pretrained(head_folder).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    input_ids, attention_mask = prompts(2)
    kwargs = {"attention_mask": attention_mask, "do_sample": False, "max_new_tokens": 8}
    spec = llama.generate(
        input_ids, custom_generate="org/tiny-dspark", trust_remote_code=True, cache_dir=tmp_path / "cache", **kwargs
    )
    assert torch.equal(spec, llama.generate(input_ids, **kwargs))


def test_trust_remote_code_is_required(head_folder, llama):
    input_ids, _ = prompts(1)
    with pytest.raises(ValueError, match="trust_remote_code"):
        llama.generate(input_ids, custom_generate=str(head_folder), max_new_tokens=2)


def test_the_shipped_head_carries_the_current_custom_generate_folder(tmp_path):
    write_custom_generate(tmp_path)
    for name in ("generate.py", "requirements.txt"):
        shipped = SHIPPED_HEAD / CUSTOM_GENERATE_DIR / name
        assert filecmp.cmp(shipped, tmp_path / CUSTOM_GENERATE_DIR / name, shallow=False), (
            f"{shipped} is out of date: rewrite it with spark_generate.heads.custom_generate.write_custom_generate"
        )
