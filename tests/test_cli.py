"""The ``spark-generate`` command line end to end on a tiny random target saved to a folder.

regenerate -> train (a few steps, reduced draft vocabulary) -> calibrate -> eval -> card, each
through :func:`spark_generate.cli.main`; convert between the speculators and DeepSpec formats and
back with identical weights and draft logits; ``--help`` for every subcommand and clear errors.
Nothing touches the Hub.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from spark_generate.cli import build_parser, main
from spark_generate.heads import DSparkHead
from spark_generate.schedule import load_calibration

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
    assert "regenerate: 4 answers" in capsys.readouterr().out
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
    assert "calibrate:" in capsys.readouterr().out
    assert len(load_calibration(sts)) == 3
    assert (tmp_path / "reliability.png").exists()

    report = tmp_path / "eval.json"
    assert main(["eval", *target, "--head", str(checkpoint), "--prompts", str(prompts), "--output", str(report),
                 "--plot", str(tmp_path / "eval.png"), "--max-new-tokens", "16"]) == 0  # fmt: skip
    assert "eval: prompts tau" in capsys.readouterr().out
    domain = json.loads(report.read_text())["prompts"]
    assert domain["tau"] >= 1 and len(domain["acceptance_by_position"]) == 3 and domain["speedup"] > 0
    assert (tmp_path / "eval.png").exists()

    assert main(["card", "--head", str(checkpoint), "--eval", str(report), "--calibration", str(sts),
                 "--model-id", "org/tiny-dspark", "--license", "apache-2.0"]) == 0  # fmt: skip
    assert "provenance from" in capsys.readouterr().out
    card = (checkpoint / "README.md").read_text()
    assert "library_name: spark_generate" in card and "base_model:" in card and "org/tiny-dspark" in card
    assert f"| tau, prompts | {domain['tau']:.2f} |" in card
    assert "STS temperatures" in card and "Trained with spark_generate for 3 steps" in card
    assert "| git_commit |" in card or "| packages.torch |" in card


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
