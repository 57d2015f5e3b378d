"""The Transformers adapter: every place where spark_generate bends to Transformers' versions or internals.

Nothing else in the package imports Transformers' model internals (``transformers.models.*``) or
its private generation modules (``tests/test_architecture.py`` enforces it), so a new Transformers
release is adapted to here, and the rest of the code reads the same on every 5.x version:

* **The KV cache.** The keyword of ``forward`` (``cache`` from 5.24, ``past_key_values`` before;
  remote-code models may keep either), found by inspecting the model's signature once; the cache
  object ``generate()`` hands a ``custom_generate`` callable (under either name, or none at all on
  5.0); rollback, where ``Cache.crop(x)`` cuts to an absolute length for ``x >= 0`` up to 5.12 and
  removes ``|x|`` tokens for ``x <= 0`` from 5.18 on, so :func:`crop_cache` only ever calls
  ``crop(-n)`` with ``n > 0``.
* **What ``generate()`` prepares for a decoding callable** (:func:`pop_prepared_inputs`): inputs it
  adds for its own loop (``position_ids``, ``logits_to_keep``, ``use_cache``) that a speculative
  loop computes itself.
* **What ``generate()`` refuses or does not forward** to a decoding callable
  (:func:`route_generate_arguments`): ``stop_strings`` with their ``tokenizer`` become a
  :class:`~transformers.StopStringCriteria`, and the streamer travels under another name.
* **Logits processors.** The one standard processor with per-row state (the repetition penalty's
  ``prompt_ignore_length``, a ``[B]`` tensor in recent releases) is sliced to the rows of each call
  (:func:`processors_for_rows`); the warpers that never read token ids are recognised by class
  (:func:`vocabulary_free_processors`), since only those can be applied to logits over another
  vocabulary (the draft head's).
* **Hub-hosted heads** (:func:`custom_generate_repository`): Transformers runs a copy of a
  repository's ``custom_generate/generate.py`` from its modules cache, so the file cannot find its
  own repository; the ``custom_generate`` argument of the ``generate()`` call running it names it.
* **Model code reused by the draft head**: Qwen3's MLP, RMSNorm, rotary embedding and
  ``rotate_half``, re-exported from ``transformers.models.qwen3``.
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from transformers import (
    Cache,
    DynamicCache,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    GenerationConfig,
    LogitsProcessorList,
    MinPLogitsWarper,
    PreTrainedModel,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half

__all__ = [
    "CACHE_KWARG_NAMES",
    "Qwen3MLP",
    "Qwen3RMSNorm",
    "Qwen3RotaryEmbedding",
    "cache_kwarg_name",
    "crop_cache",
    "custom_generate_repository",
    "pop_prepared_inputs",
    "processors_for_rows",
    "rotate_half",
    "route_generate_arguments",
    "take_cache",
    "vocabulary_free_processors",
]

CACHE_KWARG_NAMES = ("cache", "past_key_values")

# Warpers whose output depends only on the logits row (never on token ids or the prefix).
VOCABULARY_FREE_WARPERS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
)

# The files of a head repository that a custom_generate call downloads.
HEAD_FILES = ("*.json", "*.safetensors", "*.md")

# Inputs generate() prepares for its own decoding loop; a speculative loop computes its own.
PREPARED_INPUTS = ("position_ids", "logits_to_keep", "use_cache")


# ------------------------------------------------------------------------------------ cache


def cache_kwarg_name(model: PreTrainedModel) -> str:
    """The keyword under which ``model.forward`` takes its KV cache (``cache`` or ``past_key_values``)."""
    parameters = inspect.signature(model.forward).parameters
    for name in CACHE_KWARG_NAMES:
        if name in parameters:
            return name
    raise ValueError(
        f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`; expected a "
        "Transformers causal LM with a KV cache."
    )


def take_cache(model: PreTrainedModel, model_kwargs: dict[str, Any]) -> Cache:
    """Pops the (empty) cache ``generate()`` prepared from ``model_kwargs``, or makes one.

    Calls ``activate_past_recording()`` where it exists (5.18+), which sliding-window and
    linear-attention layers need before any rollback.

    Raises:
        ValueError: The cache already holds tokens, or cannot be rolled back.
    """
    cache = None
    for name in CACHE_KWARG_NAMES:
        cache = model_kwargs.pop(name, None) or cache
    if cache is None:
        cache = DynamicCache(config=model.config)
    if cache.get_seq_length() != 0:
        raise ValueError(
            f"the cache passed to generate already holds {cache.get_seq_length()} tokens; DSpark decoding "
            "expects an empty cache (continuing from a prefilled cache is not supported): drop `cache=`."
        )
    if not getattr(cache, "is_croppable", True):
        raise ValueError(
            f"{type(cache).__name__} cannot be cropped, but speculative decoding rolls back rejected "
            "tokens; use the default dynamic cache (drop `cache_implementation=`)."
        )
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def crop_cache(cache: Cache, length: int) -> None:
    """Removes every cached token after the first ``length`` (the same call on every 5.x release)."""
    num_removed = cache.get_seq_length() - length
    if num_removed < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}: it is shorter.")
    if num_removed > 0:
        cache.crop(-num_removed)


# ---------------------------------------------------------------------------- generate()


def pop_prepared_inputs(model_kwargs: dict[str, Any]) -> None:
    """Drops the inputs ``generate()`` prepared for its own loop from a callable's ``model_kwargs``."""
    for prepared in PREPARED_INPUTS:
        model_kwargs.pop(prepared, None)


def route_generate_arguments(
    generation_config: GenerationConfig | None,
    stopping_criteria: StoppingCriteriaList | None,
    kwargs: dict[str, Any],
) -> tuple[GenerationConfig | None, StoppingCriteriaList | None]:
    """Turns ``stop_strings`` (argument or config field) and ``tokenizer`` into a stopping criterion.

    ``generate()`` does not forward ``tokenizer`` to a decoding callable and refuses
    ``stop_strings`` without it, so they are taken out of ``kwargs`` (and out of a copy of the
    config; the caller's config is never modified) and become a :class:`StopStringCriteria`.

    Returns:
        The generation config and stopping criteria to pass to ``generate()``.

    Raises:
        ValueError: ``stop_strings`` without a ``tokenizer``.
    """
    tokenizer = kwargs.pop("tokenizer", None)
    stop_strings = kwargs.pop("stop_strings", None)
    if generation_config is not None and generation_config.stop_strings is not None:
        stop_strings = stop_strings or generation_config.stop_strings
        generation_config = copy.deepcopy(generation_config)
        generation_config.stop_strings = None
    if stop_strings is None:
        return generation_config, stopping_criteria
    if tokenizer is None:
        raise ValueError(f"stop_strings={stop_strings!r} needs the tokenizer: pass tokenizer=... to generate().")
    stop = StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)
    return generation_config, StoppingCriteriaList([*(stopping_criteria or []), stop])


def custom_generate_repository(hub_options: dict[str, Any]) -> str:
    """The head repository a ``custom_generate/generate.py`` belongs to, as a local folder.

    Found as the ``custom_generate`` argument of the ``generate()`` call up the stack (Transformers
    runs a copy of the file, whose ``__file__`` does not lead back to the repository); a Hub id is
    fetched (``hub_options``: ``revision``, ``cache_dir``, ``local_files_only``, ``token``).

    Raises:
        ValueError: No ``generate(..., custom_generate=<folder or Hub id>)`` call is running.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            location = frame.f_locals.get("custom_generate") if frame.f_code.co_name == "generate" else None
            if isinstance(location, (str, os.PathLike)):
                if Path(location).is_dir():
                    return str(Path(location).resolve())
                return snapshot_download(str(location), allow_patterns=list(HEAD_FILES), **hub_options)
            frame = frame.f_back
    finally:
        del frame
    raise ValueError(
        "cannot tell which repository this DSpark custom_generate function belongs to: no generate() call "
        "with custom_generate=<folder or Hub id> runs it. Call model.generate(..., custom_generate=<the head "
        "repository>, trust_remote_code=True), or use spark_generate.DSparkForCausalLM(model, <head>).generate."
    )


# ------------------------------------------------------------------------------ processors


def processors_for_rows(logits_processor: LogitsProcessorList, rows: torch.Tensor) -> LogitsProcessorList:
    """The processors, with per-row state restricted to ``rows`` of the original batch."""
    view = LogitsProcessorList()
    for processor in logits_processor:
        per_row = getattr(processor, "prompt_ignore_length", None)  # a [B] tensor in recent releases only
        if isinstance(processor, RepetitionPenaltyLogitsProcessor) and torch.is_tensor(per_row):
            processor = copy.copy(processor)
            processor.prompt_ignore_length = per_row.to(rows.device)[rows]
        view.append(processor)
    return view


def vocabulary_free_processors(logits_processor: LogitsProcessorList) -> LogitsProcessorList:
    """The warpers of ``logits_processor`` that read only the logits row (temperature, top-k, top-p, ...).

    They can be applied to logits over any vocabulary, such as a draft head's reduced one.
    """
    return LogitsProcessorList(p for p in logits_processor if isinstance(p, VOCABULARY_FREE_WARPERS))
