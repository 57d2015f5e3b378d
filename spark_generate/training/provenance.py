"""Provenance: what a checkpoint was trained from, written as JSON beside every checkpoint.

It records the target (its Hub id and revision, or a SHA-256 of its weights when it was built or
loaded from local files), the data, the git commit of this package, the versions of the libraries
that shape the numbers, the command line, the training settings and the loss divergences chosen.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

__all__ = ["card_rows", "earlier_stages", "git_commit", "package_versions", "target_identity"]

_PACKAGES = ("spark_generate", "torch", "transformers", "accelerate", "safetensors")


def target_identity(target: PreTrainedModel) -> dict[str, Any]:
    """The target's Hub id and revision, plus a SHA-256 over its parameters (in state-dict order)."""
    digest = hashlib.sha256()
    for name, tensor in target.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {
        "name_or_path": target.config.name_or_path or None,
        "revision": getattr(target.config, "_commit_hash", None),
        "architecture": type(target).__name__,
        "weights_sha256": digest.hexdigest(),
    }


def git_commit(path: str | Path | None = None) -> str | None:
    """The commit of the source tree this package runs from, or None outside a git checkout.

    ``-dirty`` is appended when tracked files differ from that commit (a run of uncommitted code),
    leaving out what training and benchmarks write themselves (``model_cards/``, ``benchmarks/results/``).

    Args:
        path: A folder inside the checkout (default: this package's).
    """
    folder = Path(__file__).resolve().parent if path is None else Path(path)
    excluded = [":(top,exclude)model_cards", ":(top,exclude)benchmarks/results"]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", *excluded],
            cwd=folder, capture_output=True, text=True, check=True, timeout=10,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("-dirty" if changes.strip() else "")) or None


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages that shape training, and of Python."""
    versions: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def card_rows(record: dict, prefix: str = "") -> dict[str, str]:
    """One stage's provenance JSON as ``{"a.b": "value"}`` rows for a model-card table.

    None values are dropped, and so is the ``previous`` stage (:func:`earlier_stages` sums those up).
    """
    rows = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if key == "previous" and not prefix:
            continue
        if isinstance(value, dict):
            rows.update(card_rows(value, f"{name}."))
        elif value is not None:
            rows[name] = json.dumps(value) if isinstance(value, list) else str(value)
    return rows


def earlier_stages(record: dict) -> list[dict[str, str]]:
    """One summary row per stage in the ``previous`` chain of ``record``, newest first.

    Each row names the command, commit, steps x documents per step, training documents and the
    teacher-forced tau of the stage's last training batch; ``provenance.json`` keeps every field.
    """
    rows = []
    stage = record.get("previous")
    while isinstance(stage, dict):
        training = stage.get("training") or {}
        argv = stage.get("argv") or []
        documents = (stage.get("data") or {}).get("num_sequences")
        tau = (stage.get("teacher_forced_metrics") or {}).get("tau")
        rows.append({
            "stages back": str(len(rows) + 1),
            "command": " ".join([Path(argv[0]).name, *argv[1:]]) if argv else "unrecorded",
            "commit": (stage.get("git_commit") or "unrecorded")[:12],
            "steps x documents": f"{stage.get('step', '?')} x {training.get('batch_size', '?')}",
            "training documents": "-" if documents is None else f"{documents:,}",
            "teacher-forced tau, last batch": "-" if tau is None else f"{tau:.2f}",
        })  # fmt: skip
        stage = stage.get("previous")
    return rows
