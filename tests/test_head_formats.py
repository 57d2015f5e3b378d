"""Hub formats: speculators round trips, DeepSpec folders, the slot rule, offline Hub ids, bad files, local paths.

A head folder also carries the head's STS calibration (``calibration.json``), and a name that reads
as a local path is never tried as a Hub id.
"""

import json
import shutil
import types
import warnings
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file
from test_heads import ARCHITECTURES, VOCAB, target_features, tiny_head, tiny_target
from transformers import AutoConfig, AutoModel
from transformers.utils import hub

from spark_generate.config import DSparkConfig
from spark_generate.heads import DSparkCheckpointError, DSparkHead, formats

EXAMPLE_BLOCK = torch.tensor([[[5, 3, 3, 3]], [[17, 3, 3, 3]]])


def draft_logits(head: DSparkHead, target) -> torch.Tensor:
    """Base and Markov-corrected logits, and confidences, of one block after 6 context rows."""
    features = target_features(head, target, 6)
    num_draft = head.config.num_draft_tokens
    with torch.no_grad():
        out = head(EXAMPLE_BLOCK, torch.full((2, 1), 6), target_hidden_states=features)
        forced = head.teacher_forced(out.base_logits, out.draft_hidden, EXAMPLE_BLOCK[..., :num_draft])
    confidence = forced.confidence_logits if forced.confidence_logits is not None else torch.zeros(0)
    return torch.cat([out.base_logits.flatten(), forced.draft_logits.flatten(), confidence.flatten()])


def assert_same_weights(first: DSparkHead, second: DSparkHead) -> None:
    first_state, second_state = first.state_dict(), second.state_dict()
    assert first_state.keys() == second_state.keys()
    for name, tensor in first_state.items():
        assert torch.equal(tensor, second_state[name]), name


@pytest.fixture(scope="module")
def qwen3():
    return tiny_target("qwen3")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("markov_head_type", ["vanilla", "rnn"])
def test_save_load_round_trip(tmp_path, architecture, markov_head_type):
    target = tiny_target(architecture)
    head = tiny_head(target, markov_head_type=markov_head_type)
    head.save_pretrained(tmp_path)
    loaded = DSparkHead.from_pretrained(tmp_path).attach(target)
    assert_same_weights(head, loaded)
    assert torch.equal(draft_logits(head, target), draft_logits(loaded, target))
    assert loaded.config.to_dict() == head.config.to_dict()


def test_saved_folder_is_the_speculators_format(tmp_path, qwen3):
    head = tiny_head(qwen3, markov_head_type="gated", draft_vocab_size=40)
    head.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "README.md",
        "config.json",
        "custom_generate",
        "model.safetensors",
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    print(json.dumps(config, indent=2))
    assert config["speculators_model_type"] == "dspark"
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["draft_vocab_size"] == 40 and config["transformer_layer_config"]["vocab_size"] == VOCAB
    assert config["sample_from_anchor"] is True and config["block_size"] == 4
    assert config["markov_rank"] == 8 and config["markov_head_type"] == "gated"
    weights = load_file(tmp_path / "model.safetensors")
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "t2d", "d2t"}
    expected |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    expected |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
    expected |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    for i in range(2):
        expected |= {f"layers.{i}.{name}.weight" for name in ("input_layernorm", "post_attention_layernorm")}
        expected |= {f"layers.{i}.self_attn.{name}.weight" for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        expected |= {f"layers.{i}.self_attn.{name}.weight" for name in ("q_norm", "k_norm")}
        expected |= {f"layers.{i}.mlp.{name}.weight" for name in ("gate_proj", "up_proj", "down_proj")}
    assert set(weights) == expected
    assert weights["markov_head.markov_w1.weight"].shape == (VOCAB, 8)
    assert weights["markov_head.markov_w2.weight"].shape == (40, 8)
    assert weights["t2d"].dtype == torch.bool and weights["d2t"].dtype == torch.int64
    loaded = DSparkHead.from_pretrained(tmp_path).attach(qwen3)
    assert_same_weights(head, loaded)
    assert torch.equal(draft_logits(head, qwen3), draft_logits(loaded, qwen3))


def test_model_card_is_written(tmp_path, qwen3):
    head = tiny_head(qwen3)
    head.config.verifier_name_or_path = "org/tiny-qwen3"
    card = head.model_card(
        model_id="org/tiny-dspark", license="apache-2.0", training="Trained for a test.",
        provenance={"commit": "abc123"}, results={"mean accepted length (T=0)": 3.5},
    )  # fmt: skip
    head.save_pretrained(tmp_path, model_card=card)
    text = (tmp_path / "README.md").read_text()
    header = text.split("---")[1]
    assert "library_name: spark_generate" in header and "base_model: org/tiny-qwen3" in header
    assert "- dspark" in header and "- speculative-decoding" in header
    for section in (
        "## Target model",
        "## Head architecture",
        "## Training data and provenance",
        "## Results",
    ):
        assert section in text
    assert "| commit | abc123 |" in text and "| mean accepted length (T=0) | 3.5 |" in text
    assert (
        'assistant="org/tiny-dspark"' in text
        and 'custom_generate="org/tiny-dspark"' in text
        and "$" not in text.replace("$$", "")
    )


def test_model_card_sums_up_earlier_stages(qwen3):
    from spark_generate.training.provenance import card_rows, earlier_stages

    def stage(step: int, commit: str, tau: float | None, previous: dict | None) -> dict:
        return {
            "step": step, "git_commit": commit, "argv": ["examples/train.py", "--max-minutes", "5"],
            "training": {"batch_size": 8}, "data": {"num_sequences": 12754},
            "teacher_forced_metrics": None if tau is None else {"tau": tau}, "previous": previous,
        }  # fmt: skip

    provenance = stage(4000, "c" * 40, 2.9, stage(3000, "b" * 40, 2.5, stage(100, "a" * 40, None, None)))
    del provenance["previous"]["previous"]["data"]  # an early stage that recorded no data
    rows = card_rows(provenance)
    assert rows["step"] == "4000" and rows["training.batch_size"] == "8"
    assert not any(key.startswith("previous") for key in rows)  # summed up below instead
    stages = earlier_stages(provenance)
    assert [row["stages back"] for row in stages] == ["1", "2"]
    assert stages[0]["commit"] == "b" * 12 and stages[0]["steps x documents"] == "3000 x 8"
    assert stages[0]["command"] == "train.py --max-minutes 5" and stages[0]["training documents"] == "12,754"
    assert stages[0]["teacher-forced tau, last batch"] == "2.50" and stages[1]["teacher-forced tau, last batch"] == "-"
    assert stages[1]["training documents"] == "-"
    text = str(tiny_head(qwen3).model_card(provenance=rows, earlier_stages=stages))
    assert "| stages back | command | commit |" in text and "| 2 | train.py --max-minutes 5 | aaaaaaaaaaaa |" in text
    assert "previous." not in text


def write_deepspec_folder(head: DSparkHead, target, folder: Path) -> None:
    """Writes a head the way DeepSpec's save_pretrained does: a Qwen3 config, 0-based ids, full copies."""
    config = head.config
    raw = target.config.to_dict()
    raw["_attn_implementation"] = "flex_attention"  # DeepSpec trains with flex attention
    raw.update(
        architectures=["Qwen3DSparkModel"], num_hidden_layers=config.num_draft_layers,
        num_target_layers=target.config.num_hidden_layers, block_size=config.block_size,
        target_layer_ids=config.target_layer_ids, mask_token_id=config.mask_token_id, num_anchors=512,
        markov_rank=config.markov_rank, markov_head_type=config.markov_head_type,
        enable_confidence_head=config.enable_confidence_head,
        confidence_head_with_markov=config.confidence_head_with_markov, tie_word_embeddings=False,
        layer_types=["full_attention"] * config.num_draft_layers,
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw))
    weights = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    weights["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    save_file(weights, folder / "model.safetensors")


@pytest.mark.parametrize("markov_head_type", ["vanilla", "gated", "rnn"])
def test_deepspec_folder_loads_and_matches_the_native_head(tmp_path, qwen3, markov_head_type):
    native = tiny_head(qwen3, markov_head_type=markov_head_type)
    write_deepspec_folder(native, qwen3, tmp_path)
    loaded = DSparkHead.from_pretrained(tmp_path).attach(qwen3)
    assert loaded.config.sample_from_anchor is True, "DeepSpec is always anchor-first"
    assert loaded.config.target_layer_ids == native.config.target_layer_ids == [0, 1, 2]
    assert loaded.config.aux_hidden_state_layer_ids == [1, 2, 3]
    assert loaded.config.num_draft_layers == 2 and loaded.config.draft_vocab_size == VOCAB
    assert_same_weights(native, loaded)
    assert torch.equal(draft_logits(native, qwen3), draft_logits(loaded, qwen3))
    loaded.save_pretrained(tmp_path / "converted")  # DeepSpec -> speculators conversion
    converted = DSparkHead.from_pretrained(tmp_path / "converted").attach(qwen3)
    assert torch.equal(draft_logits(native, qwen3), draft_logits(converted, qwen3))


def test_deepspec_drafters_other_than_qwen3_are_refused(tmp_path, qwen3):
    write_deepspec_folder(tiny_head(qwen3), qwen3, tmp_path)
    rewrite_config(tmp_path, architectures=["Gemma4DSparkModel"], final_logit_softcapping=30.0)
    with pytest.raises(DSparkCheckpointError, match=r"config.json: architectures=\['Gemma4DSparkModel'\]: expected"):
        DSparkHead.from_pretrained(tmp_path)


def test_deepspec_slot_override(tmp_path, qwen3):
    write_deepspec_folder(tiny_head(qwen3), qwen3, tmp_path)
    assert DSparkHead.from_pretrained(tmp_path, sample_from_anchor=False).config.sample_from_anchor is False


def rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(("speculative_tokens", "expected"), [(4, True), (3, False)])
def test_missing_slot_field_is_inferred_from_speculative_tokens(tmp_path, qwen3, speculative_tokens, expected):
    tiny_head(qwen3).save_pretrained(tmp_path)
    speculators = json.loads((tmp_path / "config.json").read_text())["speculators_config"]
    speculators["proposal_methods"][0]["speculative_tokens"] = speculative_tokens
    rewrite_config(tmp_path, sample_from_anchor=None, speculators_config=speculators)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DSparkHead.from_pretrained(tmp_path).config.sample_from_anchor is expected
        assert AutoConfig.from_pretrained(tmp_path).sample_from_anchor is expected
    assert (
        DSparkHead.from_pretrained(tmp_path, sample_from_anchor=not expected).config.sample_from_anchor is not expected
    )


def test_undetermined_slot_convention_warns_and_assumes_dflash(tmp_path, qwen3):
    tiny_head(qwen3).save_pretrained(tmp_path)
    rewrite_config(tmp_path, sample_from_anchor=None, speculators_config={"algorithm": "dspark"})
    with pytest.warns(UserWarning, match="assuming the DFlash convention"):
        head = DSparkHead.from_pretrained(tmp_path)
    assert head.config.sample_from_anchor is False and head.config.num_draft_tokens == 3


def test_explicit_slot_field_is_obeyed(tmp_path, qwen3):
    tiny_head(qwen3, sample_from_anchor=False).save_pretrained(tmp_path)
    assert DSparkHead.from_pretrained(tmp_path).config.sample_from_anchor is False
    assert DSparkHead.from_pretrained(tmp_path, sample_from_anchor=True).config.sample_from_anchor is True


def test_hub_id_loads_offline_from_the_cache(tmp_path, qwen3):
    head = tiny_head(qwen3)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--org--tiny-dspark"
    head.save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    loaded = DSparkHead.from_pretrained("org/tiny-dspark", cache_dir=tmp_path / "cache").attach(qwen3)
    assert torch.equal(draft_logits(head, qwen3), draft_logits(loaded, qwen3))
    with pytest.raises(DSparkCheckpointError, match="not a local folder and the Hub snapshot could not be fetched"):
        DSparkHead.from_pretrained("org/absent-head", cache_dir=tmp_path / "cache")


def test_auto_classes_load_a_saved_head(tmp_path, qwen3):
    head = tiny_head(qwen3)
    head.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), DSparkConfig)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, DSparkHead)
    assert_same_weights(head, loaded.attach(qwen3))


def test_dtype_is_kept_and_confidence_stays_float32(tmp_path, qwen3):
    tiny_head(qwen3).to(torch.bfloat16).save_pretrained(tmp_path)
    head = DSparkHead.from_pretrained(tmp_path)
    assert head.fc.weight.dtype == torch.bfloat16
    assert head.confidence_head.proj.weight.dtype == torch.float32
    assert DSparkHead.from_pretrained(tmp_path, dtype=torch.float32).fc.weight.dtype == torch.float32


# ------------------------------------------------------------------------------- bad files


@pytest.fixture
def saved(tmp_path, qwen3) -> Path:
    tiny_head(qwen3, draft_vocab_size=40).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def test_missing_weight_file(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(
        DSparkCheckpointError,
        match=r"has no model.safetensors.*found \['README.md', 'config.json', 'custom_generate'\]",
    ):
        DSparkHead.from_pretrained(saved)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weight_file(saved, damage):
    path = saved / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x00garbage" * 64)
    with pytest.raises(DSparkCheckpointError, match=r"cannot read the weight file .*corrupt"):
        DSparkHead.from_pretrained(saved)


def test_missing_and_mismatched_tensors_are_listed(saved):
    weights = load_file(saved / "model.safetensors")
    del weights["layers.1.mlp.up_proj.weight"]
    weights["fc.weight"] = weights["fc.weight"][:, :64].contiguous()
    weights["extra.weight"] = torch.zeros(2)
    save_file(weights, saved / "model.safetensors")
    with pytest.raises(DSparkCheckpointError) as error:
        DSparkHead.from_pretrained(saved)
    message = str(error.value)
    assert "missing layers.1.mlp.up_proj.weight [96, 64]" in message
    assert "unexpected extra.weight" in message
    assert "fc.weight has shape [64, 64], expected [64, 192]" in message


def test_inconsistent_vocabulary_maps(saved):
    weights = load_file(saved / "model.safetensors")
    weights["d2t"] = weights["d2t"] + 1
    save_file(weights, saved / "model.safetensors")
    with pytest.raises(DSparkCheckpointError, match="t2d and d2t disagree"):
        DSparkHead.from_pretrained(saved)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("delete", "config.json is missing"),
        ("garbage", "is not valid JSON"),
        ("dflash", "speculators_model_type='dflash': expected 'dspark'"),
        ("unknown", "neither a speculators DSpark config"),
        ("confidence", "confidence_head_with_markov=True is invalid.*markov_rank=0"),
        ("taps", r"target_layer_ids=\[1, 2, 3\] is invalid.*below 3"),
    ],
)
def test_bad_config_files(saved, change, message):
    path = saved / "config.json"
    if change == "delete":
        path.unlink()
    elif change == "garbage":
        path.write_text("{not json")
    elif change == "dflash":
        rewrite_config(saved, speculators_model_type="dflash")
    elif change == "unknown":
        rewrite_config(saved, speculators_model_type=None)
    elif change == "confidence":
        rewrite_config(saved, markov_rank=0)
    else:
        rewrite_config(saved, aux_hidden_state_layer_ids=[2, 3, 4])
    with pytest.raises(DSparkCheckpointError, match=message):
        DSparkHead.from_pretrained(saved)


def test_loaded_head_refuses_another_target(saved):
    head = DSparkHead.from_pretrained(saved)
    with pytest.raises(ValueError, match=r"hidden_size=64.*hidden_size=32"):
        other = tiny_target("llama")
        other.config.hidden_size = 32
        head.attach(other)


def test_nothing_is_left_behind_by_a_failed_load(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "copy")
    (tmp_path / "copy" / "model.safetensors").write_bytes(b"broken")
    with pytest.raises(DSparkCheckpointError):
        DSparkHead.from_pretrained(tmp_path / "copy")
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == [
        "README.md",
        "config.json",
        "custom_generate",
        "model.safetensors",
    ]


def test_push_to_hub_uploads_through_the_mixin_and_keeps_the_card(monkeypatch, qwen3):
    """The Hub is replaced by recorders: the mixin's upload, then our card over its generic one."""
    uploaded, cards = {}, []
    fake_api = types.SimpleNamespace(create_repo=lambda repo_id, **_: types.SimpleNamespace(repo_id=repo_id))
    monkeypatch.setattr(hub, "hf_api", lambda: fake_api)
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *_, **__: ModelCard("generic card"))

    def record_upload(self, working_dir, repo_id, **_):
        uploaded.update(
            {path.relative_to(working_dir).as_posix(): path.read_bytes() for path in files_under(working_dir)}
        )
        return "commit-info"

    monkeypatch.setattr(DSparkHead, "_upload_modified_files", record_upload)
    monkeypatch.setattr(ModelCard, "push_to_hub", lambda card, repo_id, **_: cards.append((repo_id, card.content)))
    assert tiny_head(qwen3).push_to_hub("org/tiny-dspark") == "commit-info"
    assert {
        "config.json",
        "model.safetensors",
        "custom_generate/generate.py",
        "custom_generate/requirements.txt",
    } <= set(uploaded)
    assert json.loads(uploaded["config.json"])["speculators_model_type"] == "dspark"
    assert cards and cards[0][0] == "org/tiny-dspark"
    assert "library_name: spark_generate" in cards[0][1]
    assert 'assistant="org/tiny-dspark"' in cards[0][1]


def files_under(folder: str | Path) -> list[Path]:
    return [path for path in Path(folder).rglob("*") if path.is_file()]


def test_unsupported_loading_options_fail_loudly(saved):
    with pytest.raises(TypeError, match=r"does not support \['device_map'\]"):
        DSparkHead.from_pretrained(saved, device_map="auto")


# ------------------------------------------------------------------------- local paths and calibration


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("heads/my-haed", "'heads' is a folder in the current directory"),  # a typo under an existing folder
        ("./my-head", "it starts with '.'"),
        ("runs/one/my-head", "more than one path separator"),
        ("~/no-such-dspark-head-folder", "it starts with '~'"),
        ("my head", "it is not a valid Hub id"),
    ],
)
def test_a_local_path_that_does_not_exist_is_one_line_and_never_a_hub_id(tmp_path, qwen3, monkeypatch, name, reason):
    tiny_head(qwen3).save_pretrained(tmp_path / "heads" / "my-head")
    monkeypatch.chdir(tmp_path)

    def no_hub(*args, **kwargs):
        raise AssertionError("a local path was tried as a Hub id")

    monkeypatch.setattr(formats, "snapshot_download", no_hub)
    with pytest.raises(DSparkCheckpointError) as error:
        DSparkHead.from_pretrained(name)
    message = str(error.value)
    assert error.value.__cause__ is None and error.value.__suppress_context__  # one exception, no chain
    assert "\n" not in message and f"the current directory is {tmp_path}" in message and reason in message
    assert f"no folder {Path(name).expanduser().resolve()}" in message
    assert ("did you mean 'heads/my-head'" in message) == (name == "heads/my-haed")


def test_a_file_or_an_absolute_path_is_local_and_a_folder_loads(tmp_path, qwen3):
    tiny_head(qwen3).save_pretrained(tmp_path / "head")
    with pytest.raises(DSparkCheckpointError, match=r"config.json is a file, not a head folder") as error:
        DSparkHead.from_pretrained(str(tmp_path / "head" / "config.json"))
    assert error.value.__cause__ is None
    with pytest.raises(DSparkCheckpointError, match=f"no folder {tmp_path / 'gone'}"):
        DSparkHead.from_pretrained(tmp_path / "gone")  # a Path object
    assert isinstance(DSparkHead.from_pretrained(str(tmp_path / "head")), DSparkHead)


def test_calibration_travels_with_the_head(tmp_path, qwen3):
    head = tiny_head(qwen3, enable_confidence_head=True)
    head.save_pretrained(tmp_path / "raw")
    assert not (tmp_path / "raw" / "calibration.json").exists()
    assert DSparkHead.from_pretrained(tmp_path / "raw").sts_temperatures is None
    calibration = {"temperatures": [0.5, 1.0, 2.0, 4.0], "ece_before": [0.1] * 4}  # as `spark-generate calibrate`
    (tmp_path / "raw" / "calibration.json").write_text(json.dumps(calibration))
    loaded = DSparkHead.from_pretrained(tmp_path / "raw")
    assert loaded.sts_temperatures.tolist() == [0.5, 1.0, 2.0, 4.0]
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "calibration.json").read_text()) == {"temperatures": [0.5, 1.0, 2.0, 4.0]}
    assert DSparkHead.from_pretrained(tmp_path / "again").sts_temperatures.tolist() == [0.5, 1.0, 2.0, 4.0]
    with pytest.raises(ValueError, match=r"expected 4 finite positive temperatures, one per draft slot"):
        loaded.sts_temperatures = torch.tensor([1.0, 2.0])
    (tmp_path / "raw" / "calibration.json").write_text('{"temperatures": [1.0, 2.0]}')
    with pytest.raises(DSparkCheckpointError, match=r"expected 4 finite positive.*Recalibrate this head"):
        DSparkHead.from_pretrained(tmp_path / "raw")
    (tmp_path / "raw" / "calibration.json").write_text('{"temperatures": [1.0, -2.0, 1.0, 1.0]}')
    with pytest.raises(DSparkCheckpointError, match=r"calibration.json holds temperatures=.*positive numbers"):
        DSparkHead.from_pretrained(tmp_path / "raw")


def test_a_bfloat16_head_drafting_for_a_float32_target_is_the_head_loaded_in_float32(tmp_path, qwen3):
    """Also with a float32 confidence head stored next to bfloat16 weights: it is never rounded through bfloat16."""
    head = tiny_head(qwen3, enable_confidence_head=True).to(torch.bfloat16)
    head.confidence_head.float()
    with torch.no_grad():
        head.confidence_head.proj.weight.add_(1e-3)  # float32 values that bfloat16 cannot hold
    head.save_pretrained(tmp_path)
    drafting = DSparkHead.from_pretrained(tmp_path).for_drafting(qwen3)
    in_float32 = DSparkHead.from_pretrained(tmp_path, dtype=torch.float32).attach(qwen3)
    assert drafting.fc.weight.dtype == torch.float32
    assert_same_weights(drafting, in_float32)
    assert torch.equal(draft_logits(drafting, qwen3), draft_logits(in_float32, qwen3))
    assert torch.equal(drafting.confidence_head.proj.weight, head.confidence_head.proj.weight)
