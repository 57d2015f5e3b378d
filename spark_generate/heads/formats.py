"""Reading DSpark checkpoints: the speculators ``"dspark"`` format and DeepSpec's format.

Both formats use the same backbone and head tensor names (``fc``, ``hidden_norm``, ``layers.*``,
``norm``, ``markov_head.*``, ``confidence_head.proj``); they differ in ``config.json`` and in which
frozen copies of the target they carry:

* **speculators** (what :meth:`DSparkHead.save_pretrained` writes, and vLLM serves):
  ``speculators_model_type: "dspark"``, ``aux_hidden_state_layer_ids`` (= layer id + 1), the draft
  decoder in ``transformer_layer_config``, possibly a reduced vocabulary with ``lm_head`` rows and
  ``t2d``/``d2t``. A missing ``sample_from_anchor`` is resolved by
  :func:`~spark_generate.config.resolve_sample_from_anchor`.
* **DeepSpec** (``deepseek-ai/dspark_*``): ``config.json`` is the target's Qwen3 config with
  ``architectures: ["Qwen3DSparkModel"]``, ``num_hidden_layers`` = draft layers, 0-based
  ``target_layer_ids``, full vocabulary, always anchor-first; it stores full-vocabulary copies of
  ``embed_tokens`` and ``lm_head``, which are dropped here (the attached target provides them).
  DeepSpec's Gemma-4 drafter (``Gemma4DSparkModel``: Gemma-4 draft layers, ``sqrt(H)``-scaled
  embeddings, soft-capped draft logits) computes something else and is refused.

Loading is all or nothing: the whole state dict is read and checked against the head (missing,
unexpected and mis-shaped tensors, inconsistent vocabulary maps) before any weight is copied, and
every failure raises :class:`DSparkCheckpointError` naming the folder and the fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from spark_generate.config import DSparkConfig, DSparkConfigError

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
DEEPSPEC_FIELDS = (
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "num_target_layers",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
# Frozen copies of the target or training-only tensors that some checkpoints carry; the attached
# target provides the embedding (and the LM head for a full vocabulary).
IGNORED_TENSORS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "mask_embedding")
FULL_VOCAB_TENSORS = ("lm_head.weight", "t2d", "d2t")


class DSparkCheckpointError(ValueError):
    """A DSpark checkpoint is missing, corrupt, or inconsistent with its config."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint read into memory and converted to the native names.

    Attributes:
        folder: Where it was read from.
        config: The head's configuration.
        state_dict: Tensors by speculators name (frozen target copies removed).
    """

    folder: Path
    config: DSparkConfig
    state_dict: dict[str, torch.Tensor]


def resolve_folder(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None,
    cache_dir: str | os.PathLike | None,
    local_files_only: bool,
    token: str | bool | None,
) -> Path:
    """Returns a local folder for a path or Hub id (a cached snapshot when offline)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    try:
        return Path(
            snapshot_download(
                str(name_or_path),
                revision=revision,
                cache_dir=cache_dir,
                local_files_only=local_files_only,
                token=token,
                allow_patterns=["*.json", "*.safetensors", "*.md"],
            )
        )
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise DSparkCheckpointError(
            f"cannot find a DSpark head at {str(name_or_path)!r}: it is not a local folder and the Hub "
            f"snapshot could not be fetched ({type(error).__name__}: {error}). Pass an existing folder, or "
            "a Hub id that is in the cache when offline."
        ) from error


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DSparkCheckpointError(f"{path} is missing: a DSpark head folder needs config.json") from error
    except json.JSONDecodeError as error:
        raise DSparkCheckpointError(f"{path} is not valid JSON ({error}); re-download or re-save it") from error


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """Reads ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``."""
    if (folder / WEIGHTS_INDEX_NAME).is_file():
        shards = sorted(set(_read_json(folder / WEIGHTS_INDEX_NAME)["weight_map"].values()))
    elif (folder / WEIGHTS_NAME).is_file():
        shards = [WEIGHTS_NAME]
    else:
        found = sorted(p.name for p in folder.iterdir())
        raise DSparkCheckpointError(
            f"{folder} has no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME} (found {found}); "
            "DSpark heads are stored as safetensors: re-save the head with save_pretrained"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            state_dict.update(load_file(folder / shard))
        except (SafetensorError, OSError) as error:
            raise DSparkCheckpointError(
                f"cannot read the weight file {folder / shard}: {error}. The file is missing, truncated "
                "or corrupt; re-download or re-save the head."
            ) from error
    return state_dict


def is_deepspec_config(raw: dict[str, Any]) -> bool:
    """Whether a ``config.json`` dict is DeepSpec's (``*DSparkModel`` architecture, 0-based layer ids)."""
    architectures = raw.get("architectures") or []
    return any(name.endswith("DSparkModel") for name in architectures) and "target_layer_ids" in raw


def config_from_deepspec(raw: dict[str, Any], *, sample_from_anchor: bool | None) -> DSparkConfig:
    """Converts DeepSpec's config (a target config plus DSpark fields) to a :class:`DSparkConfig`.

    Raises:
        DSparkConfigError: For a DeepSpec drafter other than ``Qwen3DSparkModel``.
    """
    architectures = raw.get("architectures") or []
    if architectures != [DEEPSPEC_ARCHITECTURE]:
        raise DSparkConfigError(
            f"architectures={architectures}: expected [{DEEPSPEC_ARCHITECTURE!r}]. spark_generate runs the "
            "speculators DSpark computation (Qwen3 draft layers, raw embedding rows, uncapped draft logits); "
            "DeepSpec's other drafters, such as Gemma4DSparkModel, differ in all three. Use a speculators-format "
            "head for this target."
        )
    fields = {key: raw[key] for key in DEEPSPEC_FIELDS if key in raw}
    ignored = {*DEEPSPEC_FIELDS, "architectures", "model_type", "transformers_version", "num_anchors", "auto_map"}
    layer_fields = {key: value for key, value in raw.items() if key not in ignored and not key.startswith("_")}
    layer_config = Qwen3Config(**layer_fields)
    return DSparkConfig(
        **fields,
        sample_from_anchor=True if sample_from_anchor is None else sample_from_anchor,
        transformer_layer_config=layer_config,
    )


def config_from_speculators(raw: dict[str, Any], *, sample_from_anchor: bool | None) -> DSparkConfig:
    """Builds a :class:`DSparkConfig` from a speculators ``config.json`` dict."""
    kind = raw.get("speculators_model_type")
    if kind != "dspark":
        raise DSparkCheckpointError(
            f"speculators_model_type={kind!r}: expected 'dspark'. This folder holds another kind of "
            "speculator; spark_generate loads DSpark heads only."
        )
    raw = {key: value for key, value in raw.items() if key not in ("model_type", "architectures")}
    if sample_from_anchor is not None:
        raw["sample_from_anchor"] = sample_from_anchor
    raw.setdefault("speculators_config", {})  # a speculators file: a missing slot field is resolved
    return DSparkConfig(**raw)


def load_checkpoint(
    name_or_path: str | os.PathLike,
    *,
    sample_from_anchor: bool | None,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    token: str | bool | None = None,
) -> Checkpoint:
    """Reads a speculators or DeepSpec folder into a :class:`Checkpoint` with native names."""
    folder = resolve_folder(
        name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token
    )
    raw = _read_json(folder / "config.json")
    try:
        if is_deepspec_config(raw):
            config = config_from_deepspec(raw, sample_from_anchor=sample_from_anchor)
        elif "speculators_model_type" in raw:
            config = config_from_speculators(raw, sample_from_anchor=sample_from_anchor)
        else:
            raise DSparkCheckpointError(
                f"{folder / 'config.json'} is neither a speculators DSpark config (no speculators_model_type) "
                "nor a DeepSpec one (no *DSparkModel architecture with target_layer_ids)"
            )
    except DSparkConfigError as error:
        raise DSparkCheckpointError(f"{folder / 'config.json'}: {error}") from error
    state_dict = read_state_dict(folder)
    dropped = IGNORED_TENSORS
    if config.draft_vocab_size == config.target_vocab_size:
        dropped += FULL_VOCAB_TENSORS
    state_dict = {name: tensor for name, tensor in state_dict.items() if name not in dropped}
    return Checkpoint(folder, config, state_dict)


def validate_state_dict(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], folder: Path) -> None:
    """Checks names, shapes and vocabulary maps of a loaded state dict before anything is copied.

    Raises:
        DSparkCheckpointError: Listing every missing, unexpected or mis-shaped tensor.
    """
    problems = [f"missing {name} {list(expected[name].shape)}" for name in sorted(expected.keys() - loaded.keys())]
    problems += [f"unexpected {name}" for name in sorted(loaded.keys() - expected.keys())]
    problems += [
        f"{name} has shape {list(loaded[name].shape)}, expected {list(expected[name].shape)}"
        for name in sorted(expected.keys() & loaded.keys())
        if loaded[name].shape != expected[name].shape
    ]
    if not problems and "t2d" in loaded:
        selected = loaded["t2d"].bool().nonzero().squeeze(1)
        draft_ids = torch.arange(len(loaded["d2t"]))
        if len(selected) != len(draft_ids) or not torch.equal(selected, draft_ids + loaded["d2t"].long()):
            problems.append("t2d and d2t disagree: expected d2t[i] = (i-th selected id of t2d) - i")
    if problems:
        raise DSparkCheckpointError(
            f"the weights in {folder} do not match its config.json: " + "; ".join(problems) + ". The files are "
            "from different heads or corrupt; re-download or re-save the head."
        )


def write_deepspec(
    head: torch.nn.Module, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, folder: Path
) -> None:
    """Writes a head in DeepSpec's format, the inverse of :func:`config_from_deepspec` and loading.

    ``config.json`` is the draft decoder's Qwen3 config plus DeepSpec's DSpark fields (0-based
    ``target_layer_ids``), and the weights carry full-vocabulary copies of the target's embedding
    and LM head, as DeepSpec's ``save_pretrained`` does.

    Args:
        head: A :class:`~spark_generate.heads.DSparkHead` with the full target vocabulary.
        embed_weight: ``[V, H]`` the target's input embedding.
        lm_head_weight: ``[V, H]`` the target's LM head.
        folder: Where to write ``config.json`` and ``model.safetensors``.

    Raises:
        DSparkCheckpointError: The head cannot be expressed in DeepSpec's format (a reduced draft
            vocabulary, or the DFlash slot convention).
    """
    config: DSparkConfig = head.config
    if config.draft_vocab_size != config.target_vocab_size:
        raise DSparkCheckpointError(
            f"this head drafts over a reduced vocabulary ({config.draft_vocab_size} of {config.target_vocab_size} "
            "tokens), and DeepSpec's format holds full-vocabulary heads only; keep the speculators format."
        )
    if not config.sample_from_anchor:
        raise DSparkCheckpointError(
            "this head uses the DFlash slot convention (sample_from_anchor=False), and DeepSpec's format is always "
            "anchor-first; keep the speculators format."
        )
    raw = config.transformer_layer_config.to_dict()
    raw.update(
        architectures=["Qwen3DSparkModel"], model_type="qwen3", num_hidden_layers=config.num_draft_layers,
        num_target_layers=config.num_target_layers, block_size=config.block_size,
        target_layer_ids=list(config.target_layer_ids), mask_token_id=config.mask_token_id,
        markov_rank=config.markov_rank, markov_head_type=config.markov_head_type,
        enable_confidence_head=config.enable_confidence_head,
        confidence_head_with_markov=config.confidence_head_with_markov, tie_word_embeddings=False,
        layer_types=["full_attention"] * config.num_draft_layers,
    )  # fmt: skip
    weights = {name: tensor.detach().contiguous() for name, tensor in head.state_dict().items()}
    weights["embed_tokens.weight"] = embed_weight.detach().contiguous()
    weights["lm_head.weight"] = lm_head_weight.detach().contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    save_file(weights, folder / WEIGHTS_NAME)
