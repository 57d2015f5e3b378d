"""The Triton kernel against the PyTorch reference, and its compilation for Hopper GPUs.

On a CPU machine the kernel runs through Triton's interpreter (``TRITON_INTERPRET=1``, set in
`conftest.py` before anything imports Triton); on a CUDA machine run with ``TRITON_INTERPRET=0``
the same tests compile the kernel for the device and compare it with the reference on CUDA
tensors. The interpreter executes the kernel's own code, so equality with the reference on
identical explicit draws shows the kernel implements the specification; the interpreter is more
permissive than the compiler, so the same kernel is also compiled ahead of time for ``sm_90`` in
a subprocess without the interpreter, and its PTX is checked for the approximate division and
fused multiply-adds that would break bit-exactness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_generate.kernels import rejection_sample
from spark_generate.kernels.reference import philox_uniform, philox_uniform4x

triton = pytest.importorskip("triton", reason="the triton package is not installed")
tl = pytest.importorskip("triton.language")
pytestmark = pytest.mark.triton

from spark_generate.kernels._triton_rejection import rejection_sample_triton  # noqa: E402

# Where the kernel runs: the interpreter takes CPU tensors, the compiled kernel CUDA tensors.
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def make_case(seed, batch_size, block_size, vocab_size, draft_mode, uniform_mode, zero_rate):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch_size, 2 * block_size + 1, vocab_size, generator=gen) * 3
    logits[torch.rand(logits.shape, generator=gen) < zero_rate] = float("-inf")
    logits[..., -1] = logits[..., -1].clamp_min(-1e4)
    probs = logits.softmax(-1)
    target_probs = probs[:, : block_size + 1].contiguous()
    draft_probs = {
        "independent": probs[:, block_size + 1 :].contiguous(),
        "equal": target_probs[:, :-1].clone(),
    }.get(draft_mode)
    sampling_probs = target_probs[:, :-1] if draft_probs is None else draft_probs
    draft_token_ids = torch.multinomial(sampling_probs.reshape(-1, vocab_size), 1, generator=gen)
    draft_token_ids = draft_token_ids.view(batch_size, block_size)
    num_draft_tokens = torch.randint(0, block_size + 1, (batch_size,), generator=gen)
    uniforms = {
        "random": torch.rand(batch_size, block_size, generator=gen),
        "zero": torch.zeros(batch_size, block_size),
        "almost one": torch.full((batch_size, block_size), 1 - 2**-24),
    }[uniform_mode]
    noise = 1 / torch.empty(batch_size, vocab_size).exponential_(generator=gen)
    greedy = torch.rand(batch_size, generator=gen) < 0.3
    case = target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, uniforms, noise
    return tuple(None if tensor is None else tensor.to(DEVICE) for tensor in case)


cases = st.builds(
    make_case,
    seed=st.integers(0, 2**20),
    batch_size=st.integers(1, 5),
    block_size=st.integers(0, 7),
    vocab_size=st.sampled_from([2, 3, 5, 17, 33, 100, 257]),
    draft_mode=st.sampled_from(["independent", "equal", "one-hot"]),
    uniform_mode=st.sampled_from(["random", "zero", "almost one"]),
    zero_rate=st.sampled_from([0.0, 0.4]),
)


def assert_same(reference, kernel):
    assert torch.equal(reference[0], kernel[0]), f"tokens differ:\n{reference[0]}\n{kernel[0]}"
    assert torch.equal(reference[1], kernel[1]), f"lengths differ: {reference[1]} vs {kernel[1]}"


@settings(max_examples=40)
@given(cases)
def test_kernel_equals_reference_on_identical_explicit_draws(case):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, uniforms, noise = case
    args = (target_probs, draft_probs, draft_token_ids, num_draft_tokens)
    draws = dict(greedy=greedy, uniforms=uniforms, noise=noise)
    assert_same(rejection_sample(*args, **draws, backend="torch"), rejection_sample(*args, **draws, backend="triton"))


@pytest.mark.parametrize("vocab_size", [50_257, 152_064])
def test_kernel_equals_reference_at_real_vocabulary_sizes(vocab_size):
    case = make_case(7, 3, 4, vocab_size, "independent", "random", 0.0)
    target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, uniforms, noise = case
    # Make acceptance likely at some slots and rejection at others: drafts from a mixture.
    draft_probs = (0.5 * draft_probs + 0.5 * target_probs[:, :-1]).contiguous()
    args = (target_probs, draft_probs, draft_token_ids, num_draft_tokens)
    draws = dict(greedy=greedy, uniforms=uniforms, noise=noise)
    assert_same(rejection_sample(*args, **draws, backend="torch"), rejection_sample(*args, **draws, backend="triton"))


@settings(max_examples=15)
@given(cases, st.sampled_from([16, 64, 1024]))
def test_kernel_result_does_not_depend_on_the_vocabulary_block(case, block_v):
    target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, uniforms, noise = case
    args = (target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, uniforms, noise, None, None)
    assert_same(rejection_sample_triton(*args, block_v=16), rejection_sample_triton(*args, block_v=block_v))


def test_kernel_counter_mode_matches_the_reference():
    """Philox mode: acceptance is bit-identical; the race's device `log` may flip near-ties only."""
    case = make_case(3, 64, 5, 37, "independent", "random", 0.2)
    target_probs, draft_probs, draft_token_ids, num_draft_tokens, greedy, _, _ = case
    args = (target_probs, draft_probs, draft_token_ids, num_draft_tokens)
    seeds, positions = (torch.arange(64, device=DEVICE) * 1000003 + 17, torch.arange(64, device=DEVICE) * 5)
    reference = rejection_sample(*args, greedy=greedy, seed=seeds, positions=positions, backend="torch")
    kernel = rejection_sample(*args, greedy=greedy, seed=seeds, positions=positions, backend="triton")
    assert torch.equal(reference[1], kernel[1]), "acceptance decisions use bit-identical Philox uniforms"
    same_tokens = (reference[0] == kernel[0]).all(dim=1).float().mean()
    assert same_tokens >= 0.95


@triton.jit
def _philox_uniform_kernel(seeds_ptr, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index = tl.arange(0, BLOCK)
    mask = index < n
    seed = tl.load(seeds_ptr + row)
    offsets = tl.load(offsets_ptr + row * n + index, mask=mask, other=0)
    tl.store(out_ptr + row * n + index, tl.rand(seed, offsets), mask=mask)


@triton.jit
def _philox_uniform4x_kernel(seeds_ptr, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    index = tl.arange(0, BLOCK)
    mask = index < n
    seed = tl.load(seeds_ptr + row)
    offsets = tl.load(offsets_ptr + row * n + index, mask=mask, other=0)
    u0, u1, u2, u3 = tl.rand4x(seed, offsets)
    out = out_ptr + (row * n + index) * 4
    tl.store(out, u0, mask=mask)
    tl.store(out + 1, u1, mask=mask)
    tl.store(out + 2, u2, mask=mask)
    tl.store(out + 3, u3, mask=mask)


def philox_test_inputs():
    gen = torch.Generator().manual_seed(0)
    extremes = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63)])
    seeds = torch.cat([extremes, torch.randint(-(2**63), 2**63 - 1, (11,), generator=gen)])
    offsets = torch.randint(0, 2**62, (16, 256), generator=gen)
    offsets[:, :4] = torch.tensor([0, 1, 2**32 - 1, 2**32])  # both counter words, and the carry
    return seeds, offsets


def test_philox_port_equals_triton_rand_bit_for_bit():
    seeds, offsets = philox_test_inputs()
    expected = philox_uniform(seeds[:, None], offsets)
    out = torch.empty(16, 256, device=DEVICE)
    _philox_uniform_kernel[(16,)](seeds.to(DEVICE), offsets.to(DEVICE), out, 256, BLOCK=256)
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))
    assert (expected >= 0).all() and (expected < 1).all()


def test_philox_four_lane_port_equals_triton_rand4x_bit_for_bit():
    seeds, offsets = philox_test_inputs()
    expected = philox_uniform4x(seeds[:, None], offsets)
    out = torch.empty(16, 256, 4, device=DEVICE)
    _philox_uniform4x_kernel[(16,)](seeds.to(DEVICE), offsets.to(DEVICE), out, 256, BLOCK=256)
    assert torch.equal(out.cpu().view(torch.int32), expected.view(torch.int32))
    assert torch.equal(expected[..., 0], philox_uniform(seeds[:, None], offsets))


AOT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from spark_generate.kernels import _triton_rejection as module
    from spark_generate.kernels.reference import MIN_RACE_UNIFORM

    kernel = module._rejection_sample_kernel
    pointer_types = {
        "target_probs_ptr": "*fp32", "draft_probs_ptr": "*fp32", "draft_token_ids_ptr": "*i64",
        "num_draft_tokens_ptr": "*i64", "greedy_ptr": "*i8", "uniforms_ptr": "*fp32", "noise_ptr": "*fp32",
        "seeds_ptr": "*i64", "positions_ptr": "*i64", "output_token_ids_ptr": "*i64", "num_emitted_ptr": "*i64",
        "vocab_size": "i32",
    }
    report = {}
    for philox in (False, True):
        for has_draft_probs in (False, True):
            constants = {
                "BLOCK_V": 1024, "HAS_DRAFT_PROBS": has_draft_probs, "PHILOX": philox, "NUM_STREAMS_": 4,
                "ACCEPT_STREAM": 0, "RESIDUAL_STREAM": 1, "MIN_UNIFORM": MIN_RACE_UNIFORM,
            }
            signature = {
                name: "constexpr" if name in constants else pointer_types.get(name, "i64")
                for name in kernel.arg_names
            }
            compiled = triton.compile(
                ASTSource(fn=kernel, signature=signature, constexprs=constants),
                target=GPUTarget("cuda", 90, 32),
                options={"enable_fp_fusion": False},
            )
            ptx = compiled.asm["ptx"]
            report[f"philox={philox},draft_probs={has_draft_probs}"] = {
                "cubin_bytes": len(compiled.asm["cubin"]),
                "approximate_division": "div.full.f32" in ptx or "div.approx.f32" in ptx,
                "fused_multiply_add": "fma.rn.f32" in ptx,
            }
    json.dump(report, sys.stdout)
    """
)


def test_kernel_compiles_for_hopper_without_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", AOT_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert len(report) == 4
    for variant, facts in report.items():
        assert facts["cubin_bytes"] > 0, variant
        if variant.startswith("philox=False"):
            # The exact path (explicit draws) must be IEEE multiply/subtract/compare only.
            assert not facts["approximate_division"], variant
            assert not facts["fused_multiply_add"], variant
