"""Test configuration shared by the whole suite, and the tiny random models every test builds on.

`TRITON_INTERPRET` is read by Triton when a kernel is decorated, so it is set here, before any
test module imports `spark_generate`: on a machine without a GPU the Triton kernels then run
through Triton's CPU interpreter. Hypothesis profiles are sized for a 2-core CI machine.

:func:`tiny_target` and :func:`tiny_head` are the one definition of the suite's random models;
test modules choose their sizes and dtype by keyword (``from conftest import tiny_target``).
"""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Cost tables profiled by the default schedule go to a fresh folder, not the user's cache, removed at exit
# (it holds a copy of the SmolLM2 zoo model: half a gigabyte a run).
if "SPARK_GENERATE_CACHE" not in os.environ:
    os.environ["SPARK_GENERATE_CACHE"] = tempfile.mkdtemp(prefix="spark-generate-tests-")
    atexit.register(shutil.rmtree, os.environ["SPARK_GENERATE_CACHE"], ignore_errors=True)
# ... and are saved whatever else runs on the machine (tests of that guard set their own limit).
os.environ.setdefault("SPARK_GENERATE_MAX_OTHER_CORES", "inf")

import importlib.util

import pytest
import torch
from accelerate.state import AcceleratorState
from hypothesis import HealthCheck, settings
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from spark_generate.heads import DSparkHead

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("thorough", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Where the Triton kernel runs: the interpreter takes CPU tensors, the compiled kernel CUDA ones.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and os.environ["TRITON_INTERPRET"] != "1" else "cpu"


def _through_the_device(rejection_sample):
    """`rejection_sample` with its tensors moved to the kernel's device and its results back."""

    def move(value):
        return value.to(KERNEL_DEVICE) if isinstance(value, torch.Tensor) else value

    def on_device(*args, **kwargs):
        results = rejection_sample(*map(move, args), **{name: move(value) for name, value in kwargs.items()})
        return tuple(result.cpu() for result in results)

    return on_device


@pytest.fixture(
    params=[
        "torch",
        pytest.param(
            "triton",
            marks=[pytest.mark.triton, pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")],
        ),
    ]
)
def backend(request, monkeypatch) -> str:
    """Runs a test once per verification backend (Triton through its interpreter on CPU).

    On a CUDA machine without the interpreter, the test module's `rejection_sample` runs the
    "triton" case on the GPU: the test's CPU tensors go there and the results come back.
    """
    if request.param == "triton" and KERNEL_DEVICE == "cuda" and hasattr(request.module, "rejection_sample"):
        monkeypatch.setattr(request.module, "rejection_sample", _through_the_device(request.module.rejection_sample))
    return request.param


# Architectures of the tiny targets: (config class, model class, extra config fields).
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"head_dim": 16}),
}


def tiny_target(
    architecture: str = "llama",
    *,
    num_layers: int = 4,
    vocab_size: int = 96,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    max_position_embeddings: int = 128,
    sliding_window: int = 8,
    eos_token_id: int | None = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    lm_head_scale: float = 1.0,
    **config_fields: object,
):
    """A random causal LM with 4 heads (2 KV heads), pad 0 and EOS 1 (``sliding_window``: Gemma3 only).

    ``lm_head_scale`` multiplies the LM head, making the target's distributions far from uniform;
    ``config_fields`` override the architecture's own extra fields (``head_dim``, ...).
    """
    config_class, model_class, extra = ARCHITECTURES[architecture]
    if architecture == "gemma3":
        extra = {**extra, "sliding_window": sliding_window}
    extra = {**extra, **config_fields}
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings, pad_token_id=0, eos_token_id=eos_token_id, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).eval().to(dtype)
    if lm_head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(lm_head_scale)
    return model


def tiny_head(target, seed: int = 1, **overrides) -> DSparkHead:
    """An untrained head for ``target``: 1 draft layer, Markov rank 8, block 4 unless overridden."""
    torch.manual_seed(seed)
    fields = {"num_draft_layers": 1, "markov_rank": 8, "block_size": 4, **overrides}
    return DSparkHead.from_target(target, **fields).eval()


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps one process-wide state; a test that changes its precision resets it around itself."""
    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
