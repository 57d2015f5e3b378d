"""The ``spark-generate`` command line: regenerate data, train, calibrate, evaluate, card and convert a head.

Every subcommand loads the target with ``AutoModelForCausalLM`` / ``AutoTokenizer`` from a local
folder or a Hub id (read from the cache when offline) and ends with a one-line summary::

    spark-generate regenerate --target T --prompts prompts.txt --output data.jsonl
    spark-generate train      --target T --data data.jsonl --output-dir runs/head
    spark-generate calibrate  --target T --head runs/head/checkpoint-0001000 --prompts held.txt --output sts.json
    spark-generate eval       --target T --head runs/head/checkpoint-0001000 --prompts chat.txt --output eval.json
    spark-generate card       --head runs/head/checkpoint-0001000 --eval eval.json --calibration sts.json
    spark-generate convert    --head deepseek-dspark-folder --output head-speculators --to speculators

``train`` runs unchanged under ``accelerate launch``. Each option is explained by ``--help``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from spark_generate.heads import DSparkHead

__all__ = ["main"]


def _load_target(name: str, dtype: str) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).eval()


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: a local folder or a Hub id")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype to load the target in"
    )


def _add_decoding(parser: argparse.ArgumentParser, default_tokens: int) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=default_tokens, help="tokens generated per prompt")
    parser.add_argument("--greedy", action="store_true", help="decode greedily instead of sampling at temperature 1")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")


def _prompt_token_ids(tokenizer, path: str) -> list[list[int]]:
    from spark_generate.training.regenerate import prompt_ids, read_prompts

    return [prompt_ids(tokenizer, prompt) for prompt in read_prompts(path)]


def _regenerate(args: argparse.Namespace) -> str:
    from spark_generate.training.regenerate import SamplingSettings, read_prompts, regenerate

    prompts = read_prompts(args.prompts)
    target = _load_target(args.target, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens, do_sample=not args.greedy, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed,
    )  # fmt: skip
    regenerate(target, tokenizer, prompts, args.output, settings, batch_size=args.batch_size)
    return f"regenerate: {len(prompts)} answers in {args.output} (settings in {args.output}.meta.json)"


def _train(args: argparse.Namespace) -> str:
    from spark_generate.training import Trainer, TrainingConfig, draft_vocab_from_data, read_jsonl

    dataset = read_jsonl(args.data)
    target = _load_target(args.target, args.dtype)
    if args.head:
        head = DSparkHead.from_pretrained(args.head).attach(target)
    else:
        overrides = {"block_size": args.block_size, "num_draft_layers": args.num_draft_layers}
        overrides["markov_rank"] = args.markov_rank
        draft_vocab = None
        if args.draft_vocab_size:
            draft_vocab = draft_vocab_from_data(
                dataset, args.draft_vocab_size, target.config.get_text_config().vocab_size
            )
        head = DSparkHead.from_target(target, draft_vocab_ids=draft_vocab, **overrides)
    config = TrainingConfig(
        output_dir=args.output_dir, num_steps=args.num_steps, batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps, learning_rate=args.learning_rate,
        warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        num_anchors=args.num_anchors, mixed_precision=args.mixed_precision, seed=args.seed,
        save_every=args.save_every,
    )  # fmt: skip
    result = Trainer(head, target, dataset, config).train(resume_from=args.resume_from)
    return (
        f"train: {args.num_steps} steps, loss {result.loss:.4f}, teacher-forced tau {result.metrics.tau:.3f}, "
        f"checkpoint {result.checkpoint}"
    )


def _calibrate(args: argparse.Namespace) -> str:
    from spark_generate.training.calibration import collect_calibration_data, fit_sts, plot_reliability

    target = _load_target(args.target, args.dtype)
    prompts = _prompt_token_ids(AutoTokenizer.from_pretrained(args.target), args.prompts)
    head = DSparkHead.from_pretrained(args.head).attach(target)
    data = collect_calibration_data(
        head, target, prompts, max_new_tokens=args.max_new_tokens, do_sample=not args.greedy, seed=args.seed
    )
    result = fit_sts(data)
    result.save(args.output, num_steps=len(data.num_accepted))
    if args.plot:
        plot_reliability(data, result, args.plot)
    return (
        f"calibrate: {len(data.num_accepted)} steps, mean ECE {result.ece_before.mean():.4f} -> "
        f"{result.ece_after.mean():.4f}, mean Brier {result.brier_before.mean():.4f} -> "
        f"{result.brier_after.mean():.4f}, temperatures in {args.output}"
    )


def _evaluate(args: argparse.Namespace) -> str:
    from spark_generate.training.evaluation import evaluate_domain, plot_domains

    target = _load_target(args.target, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    head = DSparkHead.from_pretrained(args.head).attach(target)
    reports = {}
    for path in args.prompts:
        prompts = _prompt_token_ids(tokenizer, path)
        reports[Path(path).stem] = evaluate_domain(
            head, target, prompts, max_new_tokens=args.max_new_tokens, do_sample=not args.greedy, seed=args.seed
        )
    record = {name: report.to_dict() for name, report in reports.items()}
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        plot_domains(reports, args.plot)
    summary = ", ".join(
        f"{name} tau {report.online.tau:.2f} ({report.speedup:.2f}x)" for name, report in reports.items()
    )
    return f"eval: {summary}; details in {args.output}"


def _card(args: argparse.Namespace) -> str:
    from spark_generate.training.provenance import card_rows

    head = DSparkHead.from_pretrained(args.head)
    provenance_path = Path(args.provenance) if args.provenance else Path(args.head) / "provenance.json"
    provenance = json.loads(provenance_path.read_text()) if provenance_path.is_file() else None
    training = None
    if provenance is not None:
        data = provenance.get("data", {})
        steps = provenance.get("step")
        training = (
            f"Trained with spark_generate for {steps} steps on {data.get('description', 'unrecorded data')} "
            f"({data.get('num_sequences', '?')} sequences), with the frozen target computing hidden states on "
            "the fly; full provenance below."
        )
    results: dict[str, object] = {}
    if args.eval:
        for domain, report in json.loads(Path(args.eval).read_text()).items():
            results[f"tau, {domain}"] = f"{report['tau']:.2f}"
            results[f"speed-up vs plain generate(), {domain}"] = f"{report['speedup']:.2f}x"
            acceptance = " / ".join(f"{rate:.2f}" for rate in report["acceptance_by_position"])
            results[f"acceptance by position, {domain}"] = acceptance
    if args.calibration:
        from spark_generate.schedule import load_calibration

        temperatures = load_calibration(args.calibration)
        results["STS temperatures"] = " / ".join(f"{t:.2f}" for t in temperatures)
    card = head.model_card(
        model_id=args.model_id, license=args.license, datasets=args.datasets, training=training,
        provenance=None if provenance is None else card_rows(provenance), results=results or None,
    )  # fmt: skip
    output = Path(args.output) if args.output else Path(args.head) / "README.md"
    card.save(output)
    source = f"from {provenance_path}" if provenance is not None else "none found"
    return f"card: {output} ({len(results)} results, provenance {source})"


def _convert(args: argparse.Namespace) -> str:
    from spark_generate.heads.formats import write_deepspec

    head = DSparkHead.from_pretrained(args.head, sample_from_anchor=args.sample_from_anchor)
    output = Path(args.output)
    if args.to == "deepspec":
        if not args.target:
            raise ValueError("DeepSpec's format stores copies of the target's embedding and LM head: pass --target.")
        target = _load_target(args.target, args.dtype)
        head.attach(target)
        write_deepspec(head, target.get_input_embeddings().weight, target.get_output_embeddings().weight, output)
    else:
        if args.target:
            head.attach(_load_target(args.target, args.dtype))
        head.save_pretrained(
            output, model_card=head.model_card(training=f"Converted from the checkpoint {args.head}.")
        )
    return f"convert: {args.head} -> {output} ({args.to} format)"


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")
    return text.lower() == "true"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spark-generate`` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="spark-generate", description="Regenerate data, train, calibrate and evaluate DSpark draft heads."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    regenerate = commands.add_parser(
        "regenerate", help="let the target answer prompts (on-policy training data)",
        description="The target answers every prompt (chat template applied when the tokenizer has one); the "
        "documents are written as JSONL with the loss mask on the answers. Rerun to resume.",
    )  # fmt: skip
    _add_target(regenerate)
    regenerate.add_argument("--prompts", required=True, help="prompt file: .txt (one per line) or .jsonl")
    regenerate.add_argument("--output", required=True, help="JSONL file to write (resumed when it exists)")
    regenerate.add_argument("--batch-size", type=int, default=8, help="prompts per generate() call")
    regenerate.add_argument("--max-new-tokens", type=int, default=256, help="longest answer")
    regenerate.add_argument("--greedy", action="store_true", help="greedy answers instead of sampling")
    regenerate.add_argument("--temperature", type=float, default=0.7, help="sampling temperature")
    regenerate.add_argument("--top-p", type=float, default=0.8, help="nucleus sampling mass")
    regenerate.add_argument("--top-k", type=int, default=20, help="candidates kept when sampling")
    regenerate.add_argument("--seed", type=int, default=0, help="base seed (batch i uses seed + i)")
    regenerate.set_defaults(run=_regenerate)

    train = commands.add_parser(
        "train", help="train a head on regenerated data",
        description="Trains a DSpark head against the frozen target (hidden states computed on the fly). "
        "Works under `accelerate launch`. Checkpoints go to OUTPUT_DIR/checkpoint-STEP with provenance.json.",
    )  # fmt: skip
    _add_target(train)
    train.add_argument("--data", required=True, help="JSONL documents from `regenerate`")
    train.add_argument("--output-dir", required=True, help="folder for checkpoints")
    train.add_argument("--head", help="start from this head (folder or Hub id) instead of a new one")
    train.add_argument("--block-size", type=int, default=7, help="slots per block of a new head")
    train.add_argument("--num-draft-layers", type=int, default=5, help="draft layers of a new head")
    train.add_argument("--markov-rank", type=int, default=256, help="Markov head rank of a new head (0: none)")
    train.add_argument("--draft-vocab-size", type=int, help="reduced draft vocabulary from the data's token counts")
    train.add_argument("--num-steps", type=int, required=True, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=1, help="documents per micro-batch and process")
    train.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per step")
    train.add_argument("--learning-rate", type=float, default=6e-4, help="peak AdamW learning rate")
    train.add_argument("--warmup-ratio", type=float, default=0.04, help="fraction of steps of linear warmup")
    train.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    train.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping norm")
    train.add_argument("--num-anchors", type=int, default=512, help="blocks per document and micro-batch")
    train.add_argument("--mixed-precision", default="no", choices=["no", "bf16"], help="float32 or bf16 autocast")
    train.add_argument("--seed", type=int, default=0, help="fixes batch order and anchors")
    train.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: at the end)")
    train.add_argument("--resume-from", help="checkpoint folder to resume from (bit-exact)")
    train.set_defaults(run=_train)

    calibrate = commands.add_parser(
        "calibrate", help="fit STS temperatures of the confidence head",
        description="Runs speculative decoding on held-out prompts and fits one temperature per draft position "
        "(sequential temperature scaling of the cumulative confidences); writes the JSON the generation loop reads.",
    )  # fmt: skip
    _add_target(calibrate)
    calibrate.add_argument("--head", required=True, help="the head (folder or Hub id)")
    calibrate.add_argument("--prompts", required=True, help="held-out prompt file (.txt or .jsonl)")
    calibrate.add_argument("--output", required=True, help="calibration JSON to write")
    calibrate.add_argument("--plot", help="reliability diagram PNG to write")
    _add_decoding(calibrate, 128)
    calibrate.set_defaults(run=_calibrate)

    evaluate = commands.add_parser(
        "eval", help="measure tau, acceptance and speedup on prompt sets",
        description="Runs speculative decoding and plain generate() on each prompt file (one domain per file) and "
        "reports tau, per-position acceptance, tokens/s and speedup.",
    )  # fmt: skip
    _add_target(evaluate)
    evaluate.add_argument("--head", required=True, help="the head (folder or Hub id)")
    evaluate.add_argument("--prompts", required=True, nargs="+", help="prompt files, one per domain")
    evaluate.add_argument("--output", required=True, help="JSON report to write")
    evaluate.add_argument("--plot", help="PNG of acceptance curves and tau per domain")
    _add_decoding(evaluate, 128)
    evaluate.set_defaults(run=_evaluate)

    card = commands.add_parser(
        "card", help="render a head's model card from its provenance, evaluation and calibration",
        description="Writes the README.md model card of a head (Hub metadata, target, architecture, training "
        "data and provenance, measured results) from the trainer's provenance.json and the JSON of `eval` and "
        "`calibrate`.",
    )  # fmt: skip
    card.add_argument("--head", required=True, help="the head folder")
    card.add_argument("--provenance", help="provenance JSON (default: HEAD/provenance.json when present)")
    card.add_argument("--eval", help="JSON report of `spark-generate eval`")
    card.add_argument("--calibration", help="calibration JSON of `spark-generate calibrate`")
    card.add_argument("--model-id", help="the head's Hub id, used in the usage snippet")
    card.add_argument("--license", help="licence id (match the target's terms)")
    card.add_argument("--datasets", nargs="+", help="Hub ids of the training datasets")
    card.add_argument("--output", help="card file to write (default: HEAD/README.md)")
    card.set_defaults(run=_card)

    convert = commands.add_parser(
        "convert", help="move a head between the speculators and DeepSpec formats",
        description="Reads a head in either format and writes it in the speculators 'dspark' format (what "
        "vLLM serves) or in DeepSpec's format (full vocabulary, anchor-first; needs the target for its "
        "embedding and LM head copies).",
    )  # fmt: skip
    convert.add_argument("--head", required=True, help="the head to read (folder or Hub id, either format)")
    convert.add_argument("--output", required=True, help="folder to write")
    convert.add_argument("--to", required=True, choices=["speculators", "deepspec"], help="format to write")
    convert.add_argument("--target", help="target model (folder or Hub id); required for --to deepspec")
    convert.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="dtype to load the target in"
    )
    convert.add_argument(
        "--sample-from-anchor", type=_boolean, default=None,
        help="override the slot convention of the checkpoint read (true/false); default: read or inferred",
    )  # fmt: skip
    convert.set_defaults(run=_convert)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; prints its summary line (or the error) and returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        print(args.run(args))
    except ValueError as error:
        print(f"spark-generate {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
