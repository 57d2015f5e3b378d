"""The trainer under two data-parallel CPU processes (``torchrun``, as ``accelerate launch`` starts them).

Each process trains on its own shard; DDP averages the gradients, so both end with the same
weights, and only the main process writes the checkpoint. Gloo on CPU, no GPU needed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
from test_training import dataset, tiny_head, tiny_target
from spark_generate.training import Trainer, TrainingConfig

target = tiny_target()
head = tiny_head(target)
config = TrainingConfig({output!r}, num_steps=3, batch_size=2, num_anchors=6, progress=False)
result = Trainer(head, target, dataset(), config).train()
checksum = sum(float(p.double().sum()) for p in head.parameters())
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
(Path({results!r}) / f"rank-{{rank}}.txt").write_text(f"{{rank}} {{world}} {{checksum!r}}")
"""


@pytest.mark.slow
def test_two_processes_end_with_identical_weights(tmp_path):
    script = tmp_path / "train.py"
    results_dir = tmp_path / "results"
    results_dir.mkdir()
    script.write_text(
        SCRIPT.format(tests=str(Path(__file__).parent), output=str(tmp_path / "run"), results=str(results_dir))
    )
    environment = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, env=environment, timeout=300,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    # Each rank writes its result to a file: the launcher does not always pass its children's stdout on.
    results = sorted(path.read_text().split() for path in results_dir.iterdir())
    assert [rank for rank, _, _ in results] == ["0", "1"]
    assert {world for _, world, _ in results} == {"2"}
    assert results[0][2] == results[1][2]  # the same weights on both ranks
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-0000003"]
