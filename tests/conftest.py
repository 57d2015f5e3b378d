"""Test configuration shared by the whole suite.

`TRITON_INTERPRET` is read by Triton when a kernel is decorated, so it is set here, before any
test module imports `spark_generate`: on a machine without a GPU the Triton kernels then run
through Triton's CPU interpreter. Hypothesis profiles are sized for a 2-core CI machine.
"""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Cost tables profiled by the default schedule go to a fresh folder, not the user's cache.
os.environ.setdefault("SPARK_GENERATE_CACHE", tempfile.mkdtemp(prefix="spark-generate-tests-"))

import importlib.util

import pytest
from hypothesis import HealthCheck, settings

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


@pytest.fixture(
    params=[
        "torch",
        pytest.param(
            "triton",
            marks=[pytest.mark.triton, pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")],
        ),
    ]
)
def backend(request) -> str:
    """Runs a test once per verification backend (Triton through its interpreter on CPU)."""
    return request.param
