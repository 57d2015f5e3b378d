"""DSparkConfig: defaults, layer-id conventions, the slot rule, validation errors, serialization; the load watch."""

import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

from spark_generate import config
from spark_generate.config import (
    MAX_OTHER_CORES,
    DSparkConfig,
    DSparkConfigError,
    LoadWatch,
    default_target_layer_ids,
    from_aux_layer_ids,
    max_other_cores,
    resolve_sample_from_anchor,
    to_aux_layer_ids,
)


def layer_config(**overrides) -> Qwen3Config:
    fields = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return Qwen3Config(**{**fields, **overrides})


def make_config(**overrides) -> DSparkConfig:
    fields = dict(
        target_layer_ids=[0, 1], mask_token_id=3, num_target_layers=4, transformer_layer_config=layer_config()
    )
    return DSparkConfig(**{**fields, **overrides})


def test_defaults_follow_the_paper():
    config = DSparkConfig()
    assert config.block_size == 7
    assert config.sample_from_anchor is True
    assert config.num_draft_layers == 5
    assert config.markov_rank == 256
    assert config.markov_head_type == "vanilla"
    assert config.enable_confidence_head and config.confidence_head_with_markov
    assert config.draft_vocab_size == config.target_vocab_size
    assert config.num_draft_tokens == 7


def test_layer_id_conversions():
    assert to_aux_layer_ids([1, 9, 17, 25, 33]) == [2, 10, 18, 26, 34]
    assert from_aux_layer_ids([2, 11, 20, 29, 38]) == [1, 10, 19, 28, 37]
    config = make_config(target_layer_ids=None, aux_hidden_state_layer_ids=[1, 3])
    assert config.target_layer_ids == [0, 2]
    assert config.aux_hidden_state_layer_ids == [1, 3]
    assert make_config(target_layer_ids=[0, 2], aux_hidden_state_layer_ids=[1, 3]).target_layer_ids == [0, 2]
    embedding_tap = make_config(target_layer_ids=[-1, 1])  # DeepSpec: -1 taps the embedding output
    assert embedding_tap.aux_hidden_state_layer_ids == [0, 2]
    with pytest.raises(DSparkConfigError, match=r"aux_hidden_state_layer_ids - 1 = \[0, 2\]"):
        make_config(target_layer_ids=[1, 3], aux_hidden_state_layer_ids=[1, 3])


def test_default_tap_layers_reproduce_deepspec():
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]  # Qwen3-4B / 8B
    assert default_target_layer_ids(40) == [1, 10, 19, 28, 37]  # Qwen3-14B
    assert default_target_layer_ids(36, 1) == [18]


@pytest.mark.parametrize("num_layers", range(2, 41))
@pytest.mark.parametrize("num_taps", [1, 2, 3, 5, 8])
def test_default_tap_layers_never_tap_the_final_layer(num_layers, num_taps):
    ids = default_target_layer_ids(num_layers, num_taps)
    assert 1 <= len(ids) <= num_taps
    assert ids == sorted(set(ids)) and ids[0] >= 0
    assert ids[-1] < num_layers - 1


def test_tap_layers_of_a_too_small_target():
    with pytest.raises(DSparkConfigError, match="at least 2 decoder layers"):
        default_target_layer_ids(1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(markov_rank=0), "confidence_head_with_markov=True is invalid.*markov_rank=0"),
        (dict(markov_head_type="lstm"), "markov_head_type='lstm'.*vanilla"),
        (dict(markov_rank=-1), "markov_rank=-1"),
        (dict(block_size=0), "block_size=0"),
        (dict(block_size=1, sample_from_anchor=False), r"block_size=1.*>= 2"),
        (dict(draft_vocab_size=97), r"draft_vocab_size=97.*vocabulary size 96"),
        (dict(mask_token_id=96), r"mask_token_id=96.*\[0, 96\)"),
        (dict(target_layer_ids=[0, 3]), r"target_layer_ids=\[0, 3\].*below 3.*final layer"),
        (dict(target_layer_ids=[1, 0]), "strictly increasing"),
        (dict(target_layer_ids=[]), "non-empty"),
        (dict(target_layer_ids=[-2, 0]), ">= -1"),
    ],
)
def test_invalid_fields_say_what_and_how_to_fix(overrides, message):
    with pytest.raises(DSparkConfigError, match=message):
        make_config(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(target_hidden_size=128), r"target_hidden_size=128.*draft hidden size 64"),
        (dict(sliding_window_non_causal=True), "sliding-window draft layers are not supported"),
        (
            dict(transformer_layer_config=layer_config(layer_types=["sliding_attention", "full_attention"])),
            r"layer_types=\['full_attention', 'sliding_attention'\]",
        ),
    ],
)
def test_unsupported_speculators_options_are_refused(overrides, message):
    with pytest.raises(DSparkConfigError, match=message):
        make_config(**overrides)


def test_markov_rank_zero_is_valid_without_the_markov_confidence_input():
    config = make_config(markov_rank=0, confidence_head_with_markov=False)
    assert config.markov_rank == 0
    assert make_config(markov_rank=0, enable_confidence_head=False).markov_rank == 0


def test_slot_rule_obeys_the_field_both_ways():
    tokens_8 = {"proposal_methods": [{"speculative_tokens": 8}]}
    raw = {"sample_from_anchor": False, "block_size": 8, "speculators_config": tokens_8}
    assert resolve_sample_from_anchor(raw) is False, "the field wins over the speculative-token count"
    raw = {"sample_from_anchor": True, "block_size": 8, "speculators_config": {}}
    assert resolve_sample_from_anchor(raw) is True


@pytest.mark.parametrize(("speculative_tokens", "expected"), [(8, True), (7, False)])
def test_slot_rule_infers_from_speculative_tokens(speculative_tokens, expected):
    raw = {
        "block_size": 8,
        "speculators_config": {"proposal_methods": [{"speculative_tokens": speculative_tokens}]},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_sample_from_anchor(raw) is expected


def test_slot_rule_warns_and_assumes_dflash_when_undetermined():
    with pytest.warns(UserWarning, match="sample_from_anchor=False"):
        assert resolve_sample_from_anchor({"block_size": 8, "speculators_config": {}}) is False
    with pytest.warns(UserWarning):
        assert DSparkConfig(sample_from_anchor=None, block_size=8, speculators_config={}).sample_from_anchor is False
    assert DSparkConfig(sample_from_anchor=None).sample_from_anchor is True, "a new config is anchor-first"


def test_serializes_to_the_speculators_format_and_back():
    config = make_config(block_size=5, draft_vocab_size=32, verifier_name_or_path="org/target")
    data = config.to_dict()
    assert data["speculators_model_type"] == "dspark"
    assert data["architectures"] == ["DSparkDraftModel"]
    assert data["aux_hidden_state_layer_ids"] == [1, 2]
    assert "target_layer_ids" not in data
    assert data["speculators_config"]["algorithm"] == "dspark"
    assert data["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert data["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    assert data["transformer_layer_config"]["model_type"] == "qwen3"
    assert data["transformer_layer_config"]["num_hidden_layers"] == 2
    for field in ("block_size", "sample_from_anchor", "markov_rank", "markov_head_type", "draft_vocab_size"):
        assert field in data, f"{field} must be written even when it equals the default"
    json.dumps(data)
    again = DSparkConfig.from_dict(data)
    assert again.to_dict() == data
    assert again.target_layer_ids == [0, 1]
    dflash = make_config(sample_from_anchor=False, block_size=5).to_dict()
    assert dflash["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4


def test_layer_config_diffs_are_read_with_their_own_model_type_defaults():
    qwen3 = DSparkConfig(transformer_layer_config={"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4})
    assert qwen3.transformer_layer_config.vocab_size == 151936
    llama = DSparkConfig(transformer_layer_config={"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    layer = llama.transformer_layer_config
    assert isinstance(layer, Qwen3Config)
    assert (layer.vocab_size, layer.intermediate_size, layer.max_position_embeddings) == (32000, 11008, 2048)
    assert layer.head_dim == 16


def test_save_and_load_with_the_config_api(tmp_path):
    config = make_config(markov_head_type="rnn", markov_rank=8)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["markov_head_type"] == "rnn" and written["model_type"] == "dspark_head"
    assert DSparkConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


def test_for_target_sizes_the_draft_like_the_target():
    target = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=30, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None, eos_token_id=[5, 6],
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip
    config = DSparkConfig.for_target(target, num_draft_layers=1, markov_rank=8)
    layer = config.transformer_layer_config
    assert (layer.hidden_size, layer.intermediate_size, layer.num_key_value_heads) == (64, 80, 2)
    assert layer.head_dim == 16 and layer.num_hidden_layers == 1
    assert layer.rope_parameters["rope_theta"] == 5e5
    assert config.mask_token_id == 5, "without a pad token, the first eos token is the mask token"
    assert config.target_layer_ids == [1, 8, 14, 20, 27]
    assert config.num_target_layers == 30


def test_for_target_uses_the_full_attention_rope_of_gemma():
    target = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, pad_token_id=0,
    )  # fmt: skip
    config = DSparkConfig.for_target(target, num_draft_layers=1)
    assert config.transformer_layer_config.rope_parameters["rope_theta"] == 1e6
    assert config.mask_token_id == 0


def test_for_target_needs_a_mask_token():
    target = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    target.pad_token_id = target.eos_token_id = None
    with pytest.raises(DSparkConfigError, match="Pass mask_token_id"):
        DSparkConfig.for_target(target)
    assert DSparkConfig.for_target(target, mask_token_id=7).mask_token_id == 7


@pytest.mark.parametrize(("field", "value"), [("vocab_size", 100), ("hidden_size", 128), ("num_hidden_layers", 6)])
def test_check_target_rejects_another_target(field, value):
    config = make_config()
    target = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    config.check_target(target)
    setattr(target, field, value)
    with pytest.raises(DSparkConfigError, match=f"{field}={value}.*from_target"):
        config.check_target(target)


def test_check_target_warns_on_another_verifier_name():
    config = make_config(verifier_name_or_path="org/target")
    target = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    with pytest.warns(UserWarning, match="trained for 'org/target'"):
        config.check_target(target, target_name="org/other")


def test_check_target_rejects_tap_layers_out_of_range():
    config = DSparkConfig(transformer_layer_config=layer_config(), target_layer_ids=[0, 3], mask_token_id=3)
    target = LlamaConfig(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4)
    with pytest.raises(DSparkConfigError, match=r"target_layer_ids=\[0, 3\].*below 3"):
        config.check_target(target)


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="the load is read from Linux's /proc")
def test_the_load_watch_sees_another_process_busy_and_not_its_own_work():
    spin = "import time\nstart = time.time()\nwhile time.time() - start < 2.0:\n    pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)  # the child is spinning
        with LoadWatch() as watch:
            time.sleep(1.0)
    finally:
        child.wait()
    assert watch.other_cores >= 0.5  # one core spun all along (0.5 leaves room for rounding to clock ticks)
    with LoadWatch() as own:
        start = time.perf_counter()
        while time.perf_counter() - start < 0.5:  # this process's own work is not the others'
            pass
    assert own.other_cores < watch.other_cores


def test_the_load_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPARK_GENERATE_MAX_OTHER_CORES")
    assert max_other_cores() == MAX_OTHER_CORES
    monkeypatch.setenv("SPARK_GENERATE_MAX_OTHER_CORES", "inf")
    assert max_other_cores() == float("inf")
    for wrong in ("lots", "-1", "nan"):
        monkeypatch.setenv("SPARK_GENERATE_MAX_OTHER_CORES", wrong)
        with pytest.raises(ValueError, match=f"SPARK_GENERATE_MAX_OTHER_CORES='{wrong}'; expected a number"):
            max_other_cores()


def fake_load(monkeypatch, other_ticks: int) -> None:
    """Makes every LoadWatch see ``other_ticks`` clock ticks of other processes between its entry and exit."""
    readings = iter([(0, 0), (other_ticks, 0)] * 100)
    monkeypatch.setattr(config, "_busy_ticks", lambda: next(readings))


def test_a_watch_is_quiet_within_the_limit_or_where_the_load_is_unknown(monkeypatch):
    monkeypatch.setenv("SPARK_GENERATE_MAX_OTHER_CORES", "0.25")
    fake_load(monkeypatch, 10**9)
    with LoadWatch() as watch:
        pass
    assert watch.other_cores > 0.25 and not watch.quiet
    with pytest.warns(RuntimeWarning, match="The table was measured while other processes kept .* not saved"):
        watch.warn_unsaved("The table")
    fake_load(monkeypatch, 0)
    with LoadWatch() as watch:
        pass
    assert watch.other_cores == 0 and watch.quiet
    monkeypatch.setattr(config, "_busy_ticks", lambda: None)  # no /proc: unknown, measurements saved as before
    with LoadWatch() as watch:
        pass
    assert watch.other_cores is None and watch.quiet


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="retain_freed_memory sets glibc's malloc")
def test_retained_memory_is_reused_instead_of_mapped_again():
    """Freeing and allocating a 64 MiB tensor faults its pages in every time, unless freed memory is retained."""
    count_faults = (
        "import resource, sys, torch\n"
        "from spark_generate.config import retain_freed_memory\n"
        "if sys.argv[1] == 'retain':\n"
        "    assert retain_freed_memory()\n"
        "torch.ones(16 << 20), torch.ones(16 << 20)\n"  # the first ones fault their pages in either way
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
        "for _ in range(8):\n"
        "    torch.ones(16 << 20)\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
    )
    faults = {
        mode: int(subprocess.run(
            [sys.executable, "-c", count_faults, mode], capture_output=True, text=True, check=True
        ).stdout)
        for mode in ("default", "retain")
    }  # fmt: skip
    assert faults["default"] > 8 * (64 << 20) // 4096 // 2  # about every page, every time
    assert faults["retain"] < faults["default"] // 10
