"""Shared by the benchmarks: the 135M-class target shape, provenance (hardware, versions, commit, date), CSV."""

from __future__ import annotations

import csv
import platform
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig

from spark_generate.config import processor_name


def smollm2_shaped_config(**overrides: object) -> LlamaConfig:
    """A Llama config of SmolLM2-135M-Instruct's shape (random weights stand in for the real model)."""
    fields: dict[str, object] = dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )  # fmt: skip
    fields.update(overrides)
    return LlamaConfig(**fields)


def git_commit() -> str:
    """Short commit of the working tree, with ``-dirty`` when it has uncommitted changes.

    Changes under ``benchmarks/results/`` do not count: a benchmark writing several result files
    would otherwise mark its own later files dirty.
    """
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results"],
            cwd=root, capture_output=True, text=True,
        ).stdout  # fmt: skip
        return commit + ("-dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def hardware(device: torch.device) -> str:
    """A one-line description of the device the benchmark ran on."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{processor_name()}, {torch.get_num_threads()} threads"


def provenance(device: torch.device) -> dict[str, str]:
    """Key facts recorded at the top of every results file: hardware, versions, commit and date."""
    versions = (
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    try:
        import triton

        versions += f", triton {triton.__version__}"
    except ImportError:
        pass
    return {
        "hardware": hardware(device),
        "versions": versions,
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def write_results(
    path: Path, rows: Sequence[Mapping[str, object]], device: torch.device, notes: Sequence[str] = ()
) -> None:
    """Writes ``rows`` as CSV, headed by ``# key: value`` provenance lines and ``# note`` lines."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        for key, value in provenance(device).items():
            file.write(f"# {key}: {value}\n")
        for note in notes:
            file.write(f"# {note}\n")
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
