"""The round-cost profile: one speculative round broken into its phases, in units of a plain decode step.

For the shipped head on SmolLM2-135M-Instruct (``--target smollm2``), a random tiny target
(``--target tiny``, as CI runs it) or a random target of Qwen3-0.6B's shape with an untrained head
(``--target qwen3-0.6b``, for GPUs), at each batch size and temperature, a generation with the head
verifying its whole block (``FixedLength``, so every round drafts and the phases are comparable)
is timed phase by phase. With ``--oracle`` greedy drafts are replaced by the target's own greedy
continuation (an always-right drafter, after the head's real draft pass), so every draft is
accepted and the round is profiled at full width:

* ``backbone``: the head's parallel pass over the new context rows and the block;
* ``draft_slots``: the serial Markov/confidence steps, the draft-side warpers, softmax and draws;
* ``schedule``: choosing how many drafts to verify;
* ``target_forward``: the target over ``[anchor, drafts]``;
* ``verification``: processing the target's logits and rejection sampling;
* ``commit``: appending tokens through the stopping criteria;
* ``bookkeeping``: cache crop, masks, draft context and row selection (the rest of the round).

Each phase is the mean seconds per round divided by the seconds of one plain decoding step at the
same batch size (plain ``generate()`` of the same prompts, same run), so ``1.0`` is one step. The
phases are measured by wrapping the loop's functions (this benchmark only); with CUDA every wrapper
synchronises, so phases do not overlap. It also counts host-device synchronisations per round on
CUDA (``torch.cuda.set_sync_debug_mode``) and kernel launches per draft slot (profiler events).

    python benchmarks/bench_round.py                  # SmolLM2, batch 1/4/16, T = 0 and 1 (the recorded run)
    python benchmarks/bench_round.py --target tiny --output /tmp/round.csv
    python benchmarks/bench_round.py --target qwen3-0.6b --oracle --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from _env import write_results

import spark_generate.drafting as drafting
import spark_generate.generation as generation
from spark_generate.heads import DSparkHead
from spark_generate.schedule import FixedLength

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
PHASES = ("backbone", "draft_slots", "schedule", "target_forward", "verification", "commit", "bookkeeping")


class PhaseTimer:
    """Accumulates wall seconds per phase by wrapping functions of the loop's modules."""

    def __init__(self, device: torch.device):
        self.seconds: dict[str, float] = defaultdict(float)
        self.device = device
        self.in_round = False  # phases count only inside speculative rounds (not the prefill)

    def synchronize(self) -> None:
        """Waits for queued CUDA kernels, so a phase's time is its own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, name: str, function: Callable) -> Callable:
        """``function``, adding its wall time to phase ``name`` (``"round"`` marks a whole round)."""

        def timed(*args: object, **kwargs: object) -> object:
            if name == "round":
                self.in_round = True
            elif not self.in_round:
                return function(*args, **kwargs)
            self.synchronize()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.synchronize()
                self.seconds[name] += time.perf_counter() - start
                if name == "round":
                    self.in_round = False

        return timed

    @contextlib.contextmanager
    def installed(self, head: DSparkHead) -> Iterator[None]:
        """Wraps the loop's phases for the duration of the block."""
        patches = [
            (generation, "speculative_step"),
            (generation, "target_forward"),
            (generation, "verify_block"),
            (generation, "commit"),
            (drafting.HeadDrafter, "draft"),
        ]
        originals = [(owner, name, getattr(owner, name)) for owner, name in patches]
        names = {"speculative_step": "round", "target_forward": "target_forward", "verify_block": "verification",
                 "commit": "commit", "draft": "draft"}  # fmt: skip
        for owner, name, original in originals:
            setattr(owner, name, self.wrap(names[name], original))
        original_forward = head.forward
        head.forward = self.wrap("backbone", original_forward)
        original_start = generation.start_schedule

        def start_schedule(*args: object) -> object:
            run = original_start(*args)
            run.lengths = self.wrap("schedule", run.lengths)
            return run

        generation.start_schedule = start_schedule
        try:
            yield
        finally:
            for owner, name, original in originals:
                setattr(owner, name, original)
            head.forward = original_forward
            generation.start_schedule = original_start


class AlwaysRight(drafting.HeadDrafter):
    """The head's real draft pass, then the target's own greedy continuation as the drafts."""

    def __init__(self, head: DSparkHead, reference: torch.Tensor):
        super().__init__(head)
        self.reference = reference
        self.rows = torch.arange(len(reference), device=reference.device)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Follows the running rows, so each row keeps its own reference."""
        super().select_rows(keep)
        self.rows = self.rows[keep]

    def draft(self, request: drafting.DraftRequest) -> drafting.DraftBlock:
        """Drafts with the head, then swaps in the reference tokens after each row's prefix."""
        block = super().draft(request)
        num_drafts = block.token_ids.shape[1]
        padded = torch.nn.functional.pad(self.reference, (0, num_drafts + 1))
        columns = request.prefixes.lengths[:, None] + torch.arange(num_drafts, device=padded.device)
        return dataclasses.replace(block, token_ids=padded[self.rows[:, None], columns])


def load(name: str) -> tuple[torch.nn.Module, DSparkHead, list[list[int]], int]:
    """The target, its head, prompts and the pad id."""
    if name in ("tiny", "qwen3-0.6b"):
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        if name == "tiny":
            config = LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
            )
            target, num_draft_layers = LlamaForCausalLM(config).eval(), 1
        else:  # Qwen3-0.6B's shape, random weights
            config = Qwen3Config(
                vocab_size=151_936,
                hidden_size=1024,
                intermediate_size=3072,
                num_hidden_layers=28,
                num_attention_heads=16,
                num_key_value_heads=8,
                head_dim=128,
                max_position_embeddings=4096,
                tie_word_embeddings=True,
                pad_token_id=0,
                eos_token_id=1,
            )
            target, num_draft_layers = Qwen3ForCausalLM(config).eval(), 3
        head = DSparkHead.from_target(target, num_draft_layers=num_draft_layers, markov_rank=16, block_size=8)
        generator = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, config.vocab_size, (64,), generator=generator).tolist() for _ in range(16)]
        return target, head.eval(), prompts, 0
    from spark_generate import prompt_sets, zoo
    from spark_generate.training.regenerate import prompt_ids

    target, tokenizer = zoo.load("smollm2-135m-instruct")
    head = DSparkHead.from_pretrained(ROOT / "model_cards" / "smollm2-135m-instruct-dspark").attach(target).float()
    texts = prompt_sets.load_prompts("code", "eval")[:16]
    return target, head.eval(), [prompt_ids(tokenizer, text) for text in texts], tokenizer.eos_token_id


def left_pad(prompts: list[list[int]], pad: int) -> dict[str, torch.Tensor]:
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    lengths = torch.tensor([len(ids) for ids in prompts])
    return {"input_ids": input_ids, "attention_mask": (torch.arange(width) >= width - lengths[:, None]).long()}


def profile_cell(
    target, head, prompts, pad, batch_size: int, temperature: float, new_tokens: int, oracle: bool
) -> dict:
    """One (batch size, temperature) cell: phases per round in plain decode steps."""
    device = next(target.parameters()).device
    inputs = {k: v.to(device) for k, v in left_pad(prompts[:batch_size], pad).items()}
    settings = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "pad_token_id": pad}
    settings.update(
        {"do_sample": True, "temperature": temperature, "top_k": 0} if temperature else {"do_sample": False}
    )
    target.generate(**inputs, **{**settings, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
    timer = PhaseTimer(device)
    timer.synchronize()
    start = time.perf_counter()
    reference = target.generate(**inputs, **settings)
    timer.synchronize()
    plain_step = (time.perf_counter() - start) / new_tokens  # prefill included once, amortised
    kwargs = {"custom_generate": generation.decode, "dspark_head": head, "dspark_schedule": FixedLength(),
              "dspark_seed": 0, "return_dict_in_generate": True}  # fmt: skip
    if oracle and not temperature:
        kwargs["dspark_drafter"] = lambda head: AlwaysRight(head, reference)
    target.generate(**inputs, **{**settings, "max_new_tokens": 4, "min_new_tokens": 4}, **kwargs)  # warm-up
    with timer.installed(head):
        out = target.generate(**inputs, **settings, **kwargs)
    rounds = int(out.dspark_stats.num_rounds.max())
    syncs, launches = cuda_counts(target, inputs, settings, kwargs, head) if device.type == "cuda" else (None, None)
    seconds = timer.seconds
    per_round = {
        "backbone": seconds["backbone"],
        "draft_slots": seconds["draft"] - seconds["backbone"],
        "schedule": seconds["schedule"],
        "target_forward": seconds["target_forward"],
        "verification": seconds["verification"],
        "commit": seconds["commit"],
    }
    per_round["bookkeeping"] = seconds["round"] - sum(per_round.values())
    row = {"batch_size": batch_size, "temperature": temperature, "rounds": rounds,
           "plain_step_ms": round(1000 * plain_step, 2)}  # fmt: skip
    row.update({phase: round(value / rounds / plain_step, 4) for phase, value in per_round.items()})
    row["overhead"] = round(sum(row[phase] for phase in PHASES if phase != "target_forward"), 4)
    tau = float(
        (out.dspark_stats.num_accepted.sum() + out.dspark_stats.num_rounds.sum()) / out.dspark_stats.num_rounds.sum()
    )
    row["tau"] = round(tau, 3)
    row["syncs_per_round"] = "" if syncs is None else round(syncs / rounds, 2)
    row["launches_per_draft_slot"] = "" if launches is None else round(launches, 1)
    return row


def cuda_counts(target, inputs, settings, kwargs, head) -> tuple[int, float]:
    """Host-device synchronisations of one generation, and kernel launches per draft slot (CUDA only)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            target.generate(**inputs, **settings, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(warning.message) for warning in caught)
    drafter = drafting.HeadDrafter(head)
    context = drafting.DraftContext(
        torch.zeros(inputs["input_ids"].shape[0], 1, head.fc.in_features, device=head.fc.weight.device,
                    dtype=head.fc.weight.dtype),
        torch.zeros(inputs["input_ids"].shape[0], 1, dtype=torch.long, device=head.fc.weight.device),
    )  # fmt: skip
    anchors = inputs["input_ids"][:, -1]
    request = drafting.DraftRequest(
        anchors,
        torch.ones_like(anchors),
        context,
        None,
        generation.Sampling(True, torch.zeros_like(anchors)),
        generation.LogitsProcessorList(),
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        drafter.draft(request)
        torch.cuda.synchronize()
    kernels = sum(1 for event in profiler.events() if event.device_type == torch.autograd.DeviceType.CUDA)
    return syncs, kernels / head.config.num_draft_tokens


def plot(rows: list[dict], path: Path) -> None:
    """Stacked bars: phases of a round in plain decode steps, per (batch size, temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"B={row['batch_size']}\nT={row['temperature']:g}" for row in rows]
    figure, axis = plt.subplots(figsize=(1.3 * len(rows) + 3, 4.5))
    bottom = [0.0] * len(rows)
    for phase in PHASES:
        values = [max(row[phase], 0.0) for row in rows]
        axis.bar(labels, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axis.set_ylabel("cost of one round (plain decode steps)")
    axis.set_title("DSpark round cost by phase (whole block verified)")
    axis.legend(fontsize=8, bbox_to_anchor=(1.01, 1), loc="upper left")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2", choices=["smollm2", "tiny", "qwen3-0.6b"])
    parser.add_argument("--oracle", action="store_true", help="greedy drafts are always right")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="0 means greedy")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--output", type=Path, default=None, help="CSV path (default: results/round_<target>_<device>.csv)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    target, head, prompts, pad = load(args.target)
    dtype = getattr(torch, args.dtype)
    target, head = target.to(device, dtype), head.to(device, dtype)
    head.attach(target)
    rows = []
    with torch.no_grad():
        for batch_size in args.batch_sizes:
            for temperature in args.temperatures:
                row = profile_cell(target, head, prompts, pad, batch_size, temperature, args.new_tokens, args.oracle)
                print(row)
                rows.append(row)
    name = args.target + ("-oracle" if args.oracle else "")
    output = args.output or RESULTS / f"round_{name}_{device.type}.csv"
    note = f"{name} target, {args.dtype}, {args.threads} torch threads, {args.new_tokens} new tokens, FixedLength"
    write_results(output, rows, device, [note])
    plot(rows, output.with_suffix(".png"))


if __name__ == "__main__":
    main()
