"""Which verification backends can run here, probed once and cached.

The Triton backend runs on CUDA tensors when the ``triton`` package is installed, and on CPU
tensors through Triton's interpreter when ``TRITON_INTERPRET=1`` was set before the kernels were
first imported (the test suite does this). ``SPARK_GENERATE_BACKEND=torch|triton`` overrides what
``backend="auto"`` picks, for tests and benchmarks. Nothing here imports Triton.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")
BACKEND_ENV_VAR = "SPARK_GENERATE_BACKEND"


@functools.cache
def has_triton() -> bool:
    """Whether the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreter_enabled() -> bool:
    """Whether Triton kernels run through the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_supports(device: torch.device) -> bool:
    """Whether the Triton backend can run on tensors of ``device``."""
    if not has_triton():
        return False
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreter_enabled())


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turns ``"auto"|"torch"|"triton"`` into the backend that will run, or raises.

    ``"auto"`` picks Triton on CUDA tensors when it is installed, the PyTorch reference otherwise;
    the environment variable ``SPARK_GENERATE_BACKEND`` replaces ``"auto"`` when set.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; expected one of {BACKENDS}.")
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV_VAR, "auto")
        if backend not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV_VAR}={backend!r} is not supported; expected one of {BACKENDS}.")
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton() else "torch"
    if backend == "triton" and not triton_supports(device):
        reason = (
            "the triton package is not installed (pip install 'spark-generate[triton]')"
            if not has_triton()
            else f"tensors are on {device}, and Triton runs on CUDA devices (or on CPU only with TRITON_INTERPRET=1)"
        )
        raise ValueError(f"backend='triton' cannot run here: {reason}. Use backend='auto' or 'torch'.")
    return backend
