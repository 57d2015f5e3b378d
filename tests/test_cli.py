"""The ``spark-generate`` command line end to end on a tiny random target saved to a folder.

regenerate -> train (a few steps, reduced draft vocabulary) -> calibrate -> eval, each through
:func:`spark_generate.cli.main`, plus ``--help`` for every subcommand and a clear error on an
empty prompt file. Nothing touches the Hub.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from spark_generate.cli import build_parser, main
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
    assert set(commands) == {"regenerate", "train", "calibrate", "eval"}
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


def test_an_empty_prompt_file_is_a_clear_error(tmp_path, target_folder, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code = main(["regenerate", "--target", str(target_folder), "--prompts", str(empty), "--output", "x.jsonl"])
    assert code == 2
    assert "holds no prompts" in capsys.readouterr().err
