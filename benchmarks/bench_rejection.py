"""Latency of lossless verification per (batch, block, vocabulary), per backend.

Runs `rejection_sample` on random processed distributions for every (B, K, V) in the grid and
records the median latency of each backend available on the device: the PyTorch reference
everywhere, the Triton kernel on CUDA. Draws come from Philox (the production path, noise made on
the fly) and from explicit draws (the kernel alone). Input validation is off, as in the
generation loop. On CUDA, the GPU's own share is recorded beside the wall clock: the summed
durations of the kernels one call launches (``device_microseconds``, from the profiler) and their
number (``kernels``), so that host-side cost (argument handling, allocations, launches) shows as
the difference. Results go to `benchmarks/results/rejection_<device>.csv`, headed by hardware,
versions and commit.

    python benchmarks/bench_rejection.py                 # CPU: the reference
    python benchmarks/bench_rejection.py --device cuda   # GPU: reference and Triton
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _env import write_results
from tqdm import tqdm

from spark_generate.kernels import rejection_sample
from spark_generate.kernels._availability import triton_supports

RESULTS = Path(__file__).resolve().parent / "results"


def make_inputs(batch_size: int, block_size: int, vocab_size: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    target_probs = torch.randn(batch_size, block_size + 1, vocab_size, device=device, generator=gen).softmax(-1)
    draft_probs = torch.randn(batch_size, block_size, vocab_size, device=device, generator=gen).softmax(-1)
    draft_token_ids = torch.randint(0, vocab_size, (batch_size, block_size), device=device, generator=gen)
    num_draft_tokens = torch.full((batch_size,), block_size, device=device)
    # Drafts equal to the target at the first slots so that the scan runs past slot 0.
    draft_probs[:, : block_size // 2] = target_probs[:, : block_size // 2]
    return target_probs, draft_probs, draft_token_ids, num_draft_tokens


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_time(fn, repeats: int) -> tuple[float, float]:
    """CUDA only: the summed kernel durations of one call of ``fn`` in seconds, and its kernels per call."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    kernels = [event for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    return sum(event.time_range.elapsed_us() for event in kernels) * 1e-6 / repeats, len(kernels) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[32_000, 152_064])
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per configuration (median kept)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=None, help="CSV path (default: results/rejection_<device>.csv)")
    args = parser.parse_args()

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    backends = ["torch"] + (["triton"] if triton_supports(device) and device.type == "cuda" else [])
    output = args.output or RESULTS / f"rejection_{device.type}.csv"
    grid = [(b, k, v) for v in args.vocab_sizes for k in args.block_sizes for b in args.batch_sizes]
    rows = []
    for batch_size, block_size, vocab_size in tqdm(grid, desc="rejection_sample"):
        inputs = make_inputs(batch_size, block_size, vocab_size, device)
        uniforms = torch.rand(batch_size, block_size, device=device)
        noise = 1 / torch.empty(batch_size, vocab_size, device=device).exponential_()
        for backend in backends:
            for mode, draws in (
                ("philox", dict(seed=1, positions=100)),
                ("explicit", dict(uniforms=uniforms, noise=noise)),
            ):

                def call():
                    return rejection_sample(*inputs, **draws, backend=backend, validate=False)  # noqa: B023

                seconds = median_seconds(call, device, args.repeats)
                on_device, kernels = device_time(call, args.repeats) if device.type == "cuda" else (None, None)
                rows.append(dict(batch=batch_size, block=block_size, vocab=vocab_size, backend=backend, draws=mode,
                                 microseconds=round(seconds * 1e6, 1),
                                 device_microseconds="" if on_device is None else round(on_device * 1e6, 1),
                                 kernels="" if kernels is None else round(kernels, 1)))  # fmt: skip

    threads = f"{torch.get_num_threads()} torch threads" if device.type == "cpu" else "CUDA"
    write_results(output, rows, device, [f"{threads}, median of {args.repeats} calls, validation off"])
    header = ("B", 4), ("K", 4), ("V", 8), ("backend", 8), ("draws", 9), ("latency (us)", 14), ("on device", 10)
    print(" ".join(f"{name:>{width}}" for name, width in header) + f" {'kernels':>8}")
    for row in rows:
        print(f"{row['batch']:>4} {row['block']:>4} {row['vocab']:>8} {row['backend']:>8} {row['draws']:>9} "
              f"{row['microseconds']:>14.1f} {row['device_microseconds']:>10} {row['kernels']:>8}")  # fmt: skip


if __name__ == "__main__":
    main()
