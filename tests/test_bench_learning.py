"""The learning-curve harness's split over several corpora (`benchmarks/bench_learning.py`): files take turns."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from spark_generate.training import TokenDataset
from spark_generate.training.data import read_jsonl

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench_learning(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("bench_learning", BENCHMARKS / "bench_learning.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_learning", module)
    spec.loader.exec_module(module)
    return module


def _corpus(path: Path, num_prompts: int, token: int) -> Path:
    """``num_prompts`` one-answer documents whose prompt index is their line, tokens telling the file apart."""
    lines = [json.dumps({"index": i, "input_ids": [token, i], "loss_mask": [0, 1]}) for i in range(num_prompts)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_several_corpora_take_turns_and_hold_out_alike(bench_learning, tmp_path):
    paths = [_corpus(tmp_path / "a.jsonl", 128, 1), _corpus(tmp_path / "b.jsonl", 64, 2)]
    data = TokenDataset.concatenate([read_jsonl(path) for path in paths])
    train, heldout = bench_learning.split(paths, data, "stride", num_train=6, num_heldout=3)
    # held out: prompt index 63 mod 64 of every file, the files in turn (a's 63, b's 63, then a's 127)
    assert [data.sequences[p] for p in heldout] == [(1, 63), (2, 63), (1, 127)]
    assert [data.sequences[p] for p in train] == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    assert bench_learning.split(paths[:1], read_jsonl(paths[0]), "stride", 6, 2)[1] == [63, 127]  # one file: as before
    with pytest.raises(SystemExit, match="fewer than --train 200"):
        bench_learning.split(paths, data, "stride", num_train=200, num_heldout=3)
    with pytest.raises(SystemExit, match="--split last takes one --data file"):
        bench_learning.split(paths, data, "last", num_train=6, num_heldout=3)
