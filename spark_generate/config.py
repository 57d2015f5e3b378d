"""The configuration of a DSpark draft head, and the one place where its defaults live.

A DSpark head (arXiv 2607.05147) is a DFlash backbone (a few Qwen3-style decoder layers that read
fused hidden states of the frozen target model) plus a low-rank Markov head and a confidence head.
:class:`DSparkConfig` describes all of it, and its serialized form *is* the speculators ``"dspark"``
checkpoint format, so a folder written here is read by vLLM (``"method": "dspark"``) and by the
speculators library, and a folder written by them is read here.

Two conventions are easy to get wrong and are pinned down here:

* **Layer ids.** ``target_layer_ids`` are 0-based decoder-layer indices: id ``l`` is the raw output
  of decoder layer ``l``, i.e. ``hidden_states[l + 1]`` of a Transformers forward. The speculators
  field ``aux_hidden_state_layer_ids`` counts hidden-state slots instead, so
  ``aux_hidden_state_layer_ids = target_layer_ids + 1`` (DeepSpec's id -1, the embedding output, is
  aux id 0). The final layer is never tapped, because
  Transformers stores its *normed* output in the last slot.
* **Slots.** With ``sample_from_anchor=True`` (DSpark, DeepSpec, vLLM) block slot ``k`` predicts
  the token at position ``p + k + 1`` and a block of ``K`` slots drafts ``K`` tokens; with
  ``False`` (DFlash, early speculators DSpark checkpoints) slot 0 only carries the anchor and the
  block drafts ``K - 1`` tokens. A file that omits the field is resolved by
  :func:`resolve_sample_from_anchor`.

Worked example for a 36-layer target with the default five taps::

    default_target_layer_ids(36, 5)        -> [1, 9, 17, 25, 33]
    to_aux_layer_ids([1, 9, 17, 25, 33])   -> [2, 10, 18, 26, 34]
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import os
import platform
import tempfile
import time
import warnings
from itertools import pairwise
from pathlib import Path
from typing import Any

import transformers
from transformers import AutoConfig, PretrainedConfig, Qwen3Config

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DEFAULT_NUM_TARGET_TAPS = 5
"""Number of tapped target layers chosen by :func:`default_target_layer_ids` (paper, Table 1)."""
DEFAULT_NUM_DRAFT_LAYERS = 5
"""Number of draft decoder layers ``N_d`` (paper, Table 1)."""
DEFAULT_SAMPLE_FROM_ANCHOR = True
"""Slot convention of new heads: anchor-first, as in the paper, DeepSpec and vLLM."""


def cache_folder() -> Path:
    """Where spark_generate caches what it measures: ``$SPARK_GENERATE_CACHE`` or ``~/.cache/spark_generate``."""
    return Path(os.environ.get("SPARK_GENERATE_CACHE", Path.home() / ".cache" / "spark_generate"))


def write_json_atomically(path: Path, value: object) -> None:
    """Writes ``value`` as JSON to ``path``, creating its folder: a temporary file of its own renamed over it.

    A reader sees the old file or the new one, never a part; writers racing (threads, processes)
    each rename a whole file of their own.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as handle:
        handle.write(json.dumps(value, indent=2) + "\n")
    os.replace(handle.name, path)


# Machine measurements (packing crossovers, cost tables) taken while other processes kept more
# than this many processor cores busy on average serve the process that took them but are not
# saved; ``SPARK_GENERATE_MAX_OTHER_CORES`` overrides it ("inf": save whatever the load).
MAX_OTHER_CORES = 0.25


class LoadWatch:
    """How many processor cores the rest of the machine kept busy while this context was open.

    Measurements that choose kernels or plan rounds are cached per machine and reused by every
    later generation, so one taken while another job shared the processors would steer them for
    good. This reads Linux's ``/proc/stat`` (the busy time of every core, time stolen by the
    hypervisor included) and ``/proc/self/stat`` (this process's, all its threads) at entry and
    exit; the others' share is the difference. Elsewhere the load is unknown (None) and
    measurements are saved as before.

    Example::

        with LoadWatch() as watch:
            seconds = measure()
        if watch.quiet:
            save(seconds)
    """

    def __enter__(self) -> LoadWatch:
        self._start = (time.perf_counter(), _busy_ticks())
        self._stop = self._start
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop = (time.perf_counter(), _busy_ticks())

    @property
    def other_cores(self) -> float | None:
        """Cores other processes used on average while open (None: unknown on this system)."""
        (start, start_ticks), (stop, stop_ticks) = self._start, self._stop
        if start_ticks is None or stop_ticks is None or stop <= start:
            return None
        busy, own = (after - before for before, after in zip(start_ticks, stop_ticks, strict=True))
        return max(0, busy - own) / os.sysconf("SC_CLK_TCK") / (stop - start)

    @property
    def quiet(self) -> bool:
        """Whether the others stayed within :func:`max_other_cores` (or their load is unknown)."""
        other_cores = self.other_cores
        return other_cores is None or other_cores <= max_other_cores()

    def warn_unsaved(self, what: str) -> None:
        """Warns that ``what`` (a measurement taken while this was open) is kept for this process only."""
        warnings.warn(
            f"{what} was measured while other processes kept {self.other_cores:.2f} processor cores busy on average "
            f"(more than {max_other_cores():g}), so it serves this process but is not saved: the next process "
            "measures it again. Measure on a quiet machine, or set SPARK_GENERATE_MAX_OTHER_CORES=inf to save "
            "it whatever the load.",
            RuntimeWarning,
            stacklevel=3,
        )


def max_other_cores() -> float:
    """:data:`MAX_OTHER_CORES`, or ``$SPARK_GENERATE_MAX_OTHER_CORES``.

    Raises:
        ValueError: The variable is not a non-negative number.
    """
    raw = os.environ.get("SPARK_GENERATE_MAX_OTHER_CORES")
    if raw is None:
        return MAX_OTHER_CORES
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise ValueError(
            f"SPARK_GENERATE_MAX_OTHER_CORES={raw!r}; expected a number of cores >= 0 (for example 0.25, "
            "or inf to save measurements whatever the load)."
        )
    return value


def _busy_ticks() -> tuple[int, int] | None:
    """Clock ticks the machine's cores and this process have been busy, from ``/proc`` (None without it)."""
    try:
        with open("/proc/stat") as stat:
            machine = [int(value) for value in stat.readline().split()[1:9]]
        with open("/proc/self/stat") as own:
            process = own.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    # user nice system idle iowait irq softirq steal; this process's utime and stime
    return sum(machine) - machine[3] - machine[4], int(process[11]) + int(process[12])


# Freed blocks up to this size stay with glibc's malloc for reuse (retain_freed_memory).
RETAINED_BLOCK_BYTES = 1 << 30
# glibc's mallopt parameters (malloc.h) and the largest mmap threshold every glibc accepts on 64-bit.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_GLIBC_MAX_MMAP_THRESHOLD = 32 << 20


def retain_freed_memory(block_bytes: int = RETAINED_BLOCK_BYTES) -> bool:
    """Has glibc's ``malloc`` keep freed blocks of up to ``block_bytes`` for reuse instead of returning them.

    By default glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh
    ``mmap`` and gives it back with ``munmap`` when freed, and trims freed memory from the top of
    its heap. A CPU forward over many tokens allocates and frees such buffers in every layer (the
    MLP activations of a batch-16 prefill of 458-token prompts on SmolLM2-135M: 43 MiB each), so
    the kernel maps and zeroes their pages again each time: 1.6-1.9 million minor page faults and
    2.5-3.6 s of system time per batch-16 ``generate()`` of SmolLM2-135M on a 2-core Xeon (one
    thread, 2 new tokens: 17.6-20.1 s a call), against about 10 thousand faults and 0.06 s with
    the blocks retained (14.9-15.3 s); at 2 threads, 40 new tokens after 311-token prompts, 0.3-0.6
    million faults and 8.5-9.1 s a call against thousands and 8.1-8.5 s.

    This sets the process's allocator (``mallopt``: the mmap and trim thresholds and the top pad,
    what ``MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=1073741824
    MALLOC_TOP_PAD_=268435456`` in the environment set before Python starts), so it is left to the
    application: call it once, at start. The price is memory: the process keeps what its largest
    forward freed (up to ``block_bytes`` beyond what it holds) instead of returning it to the
    system. Plain ``generate()`` in the same process gains as much.

    Args:
        block_bytes: Blocks up to this size are carved from the heap and kept once freed (glibc
            versions that refuse more than 32 MiB get 32 MiB).

    Returns:
        Whether the allocator took the settings (False where the C library is not glibc).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process runs on
    except (OSError, AttributeError, TypeError):  # TypeError: Windows loads no library by the name None
        return False
    threshold = mallopt(_M_MMAP_THRESHOLD, block_bytes) or mallopt(
        _M_MMAP_THRESHOLD, min(block_bytes, _GLIBC_MAX_MMAP_THRESHOLD)
    )
    return bool(threshold and mallopt(_M_TRIM_THRESHOLD, block_bytes) and mallopt(_M_TOP_PAD, block_bytes // 4))


def processor_name() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else the platform's): part of the keys of what is measured."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class DSparkConfigError(ValueError):
    """A DSpark configuration value is invalid; the message says what was given and how to fix it."""


def to_aux_layer_ids(target_layer_ids: list[int]) -> list[int]:
    """Converts 0-based decoder-layer ids to speculators ``aux_hidden_state_layer_ids`` (``+ 1``)."""
    return [layer_id + 1 for layer_id in target_layer_ids]


def from_aux_layer_ids(aux_layer_ids: list[int]) -> list[int]:
    """Converts speculators ``aux_hidden_state_layer_ids`` to 0-based decoder-layer ids (``- 1``)."""
    return [layer_id - 1 for layer_id in aux_layer_ids]


def default_target_layer_ids(num_target_layers: int, num_taps: int = DEFAULT_NUM_TARGET_TAPS) -> list[int]:
    """Chooses evenly spaced target layers to tap, never the final one.

    For targets of 5 or more layers this is the DFlash rule (``[L // 2]`` for one tap, else evenly
    spaced between layer 1 and ``L - 3``), which reproduces DeepSpec's Qwen3 configs. Smaller
    targets (2-4 layers, as in tests) spread the taps over layers ``0 .. L - 2``. When fewer
    distinct layers are available than ``num_taps``, fewer taps are returned.

    Args:
        num_target_layers: Number of decoder layers of the target, ``L``.
        num_taps: Number of layers wanted.

    Returns:
        Strictly increasing 0-based layer ids, all below ``L - 1``.

    Raises:
        DSparkConfigError: If the target has fewer than 2 layers or ``num_taps < 1``.
    """
    if num_target_layers < 2 or num_taps < 1:
        raise DSparkConfigError(
            f"cannot choose tap layers for a target with {num_target_layers} layers and {num_taps} taps; "
            "a DSpark head needs a target of at least 2 decoder layers and at least 1 tap"
        )
    low, high = (1, num_target_layers - 3) if num_target_layers >= 5 else (0, num_target_layers - 2)
    num_taps = min(num_taps, high - low + 1)
    if num_taps == 1:
        return [min(num_target_layers // 2, high)]
    return [round(low + i * (high - low) / (num_taps - 1)) for i in range(num_taps)]


def resolve_sample_from_anchor(config_dict: dict[str, Any]) -> bool:
    """Applies the slot-convention rule to a speculators ``config.json`` dict.

    Early speculators DSpark checkpoints were trained with the DFlash convention and may lack the
    field, while vLLM defaults a missing field to True; the rule below reads what such a file does
    say about its slots before falling back to the DFlash convention.

    1. If ``sample_from_anchor`` is present, it is obeyed.
    2. Else it is inferred from ``speculators_config.proposal_methods[0].speculative_tokens``:
       equal to ``block_size`` means True, ``block_size - 1`` means False.
    3. Else a warning is issued and False is returned: only early speculators checkpoints, which
       used the DFlash convention, omit both. (DeepSpec folders are converted with True.)
    """
    if config_dict.get("sample_from_anchor") is not None:
        return bool(config_dict["sample_from_anchor"])
    block_size = config_dict.get("block_size")
    methods = (config_dict.get("speculators_config") or {}).get("proposal_methods") or [{}]
    speculative_tokens = methods[0].get("speculative_tokens")
    if block_size is not None and speculative_tokens == block_size:
        return True
    if block_size is not None and speculative_tokens == block_size - 1:
        return False
    warnings.warn(
        "the checkpoint config has no `sample_from_anchor` and its speculative_tokens "
        f"({speculative_tokens}) does not determine it for block_size {block_size}; assuming the DFlash "
        "convention of early speculators checkpoints (sample_from_anchor=False). Pass "
        "`sample_from_anchor=True` to `from_pretrained` if the head was trained anchor-first.",
        stacklevel=3,
    )
    return False


def draft_layer_config(fields: dict[str, Any]) -> Qwen3Config:
    """Reads a ``transformer_layer_config`` dict as the Qwen3 config of the draft layers.

    Speculators writes the *diff* of that config against the defaults of its ``model_type`` and
    reads it back with that type's defaults; so does this function, before keeping the fields a
    :class:`~transformers.Qwen3Config` knows (the draft layers are Qwen3 layers in every format).
    """
    fields = dict(fields)
    model_type = fields.pop("model_type", "qwen3")
    if model_type != "qwen3":
        known = inspect.signature(Qwen3Config.__init__).parameters
        full = AutoConfig.for_model(model_type, **fields).to_dict()
        fields = {key: value for key, value in full.items() if key in known and key != "transformers_version"}
    return Qwen3Config(**fields)


def _ignore_final_logit_softcapping(softcap: float | None) -> None:
    """Warns about a ``final_logit_softcapping`` key, written by earlier versions for Gemma targets.

    Such heads soft-capped their draft logits and scaled block embeddings by ``sqrt(H)``, which
    speculators and vLLM never do; the key is dropped and the head runs (and is saved) with their
    computation, which it was not trained for.
    """
    if softcap is not None:
        warnings.warn(
            f"the head config has final_logit_softcapping={softcap}: it was saved by an older spark_generate "
            "that soft-capped draft logits and scaled block embeddings for Gemma targets. Draft heads now use "
            "raw embedding rows and uncapped logits, as speculators and vLLM do; the key is ignored. Retrain "
            "the head if its acceptance drops.",
            stacklevel=3,
        )


def _fail(field: str, given: Any, expected: str, fix: str) -> DSparkConfigError:
    return DSparkConfigError(f"{field}={given!r} is invalid: expected {expected}. {fix}")


class DSparkConfig(PretrainedConfig):
    """Configuration of a :class:`~spark_generate.heads.DSparkHead`.

    Every default of the head lives here. The draft decoder's shape (hidden size, heads, MLP width,
    RoPE, ``vocab_size`` = the *target* vocabulary) is a :class:`~transformers.Qwen3Config` in
    ``transformer_layer_config``, as in the speculators format; ``num_draft_layers`` is its
    ``num_hidden_layers``.

    Args:
        block_size: Block length ``K`` (anchor slot included).
        sample_from_anchor: Slot convention (see the module docstring). ``None`` means
            :data:`DEFAULT_SAMPLE_FROM_ANCHOR` for a new config, and
            :func:`resolve_sample_from_anchor` for a speculators file that omits the field.
        target_layer_ids: 0-based decoder layers of the target whose raw outputs are fused.
        aux_hidden_state_layer_ids: The same in speculators convention (``target_layer_ids + 1``);
            give one or the other (both only if consistent).
        mask_token_id: Target-vocabulary id that fills the non-anchor slots of a block.
        draft_vocab_size: ``V_d``; ``None`` means the full target vocabulary.
        markov_rank: Rank ``r`` of the Markov head; 0 disables it (pure DFlash).
        markov_head_type: ``"vanilla"``, ``"gated"`` or ``"rnn"``.
        enable_confidence_head: Whether the head predicts per-slot acceptance logits.
        confidence_head_with_markov: Whether the confidence head also reads ``W1[x_{k-1}]``.
        transformer_layer_config: The draft decoder's shape (a ``Qwen3Config`` or its dict).
        num_target_layers: ``L`` of the target, used to check tap layers; ``None`` if unknown.
        verifier_name_or_path: Hub id or path of the target the head was trained for.
        verifier_architectures: The target's ``architectures``.
        speculators_config: The speculators block read from a file; only its verifier fields and
            speculative-token count are used (it is rebuilt on save).
        **kwargs: Standard :class:`~transformers.PretrainedConfig` fields, and extra keys of
            speculators files, which are kept.
    """

    model_type = "dspark_head"

    def __init__(
        self,
        *,
        block_size: int = 7,
        sample_from_anchor: bool | None = None,
        target_layer_ids: list[int] | None = None,
        aux_hidden_state_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        draft_vocab_size: int | None = None,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        transformer_layer_config: Qwen3Config | dict[str, Any] | None = None,
        num_target_layers: int | None = None,
        verifier_name_or_path: str | None = None,
        verifier_architectures: list[str] | None = None,
        speculators_config: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        # Written by to_dict for speculators and vLLM; derived from the fields above.
        target_hidden_size = kwargs.pop("target_hidden_size", None)
        sliding_window_non_causal = kwargs.pop("sliding_window_non_causal", False)
        for generated_key in ("speculators_model_type", "tie_word_embeddings"):
            kwargs.pop(generated_key, None)
        _ignore_final_logit_softcapping(kwargs.pop("final_logit_softcapping", None))
        if sample_from_anchor is None and speculators_config is None:
            sample_from_anchor = DEFAULT_SAMPLE_FROM_ANCHOR
        elif sample_from_anchor is None:
            sample_from_anchor = resolve_sample_from_anchor(
                {"block_size": block_size, "speculators_config": speculators_config}
            )
        verifier = (speculators_config or {}).get("verifier") or {}
        self.block_size = block_size
        self.sample_from_anchor = sample_from_anchor
        self.target_layer_ids = self._resolve_layer_ids(target_layer_ids, aux_hidden_state_layer_ids)
        self.mask_token_id = mask_token_id
        if isinstance(transformer_layer_config, dict):
            transformer_layer_config = draft_layer_config(transformer_layer_config)
        self.transformer_layer_config = transformer_layer_config or Qwen3Config(
            num_hidden_layers=DEFAULT_NUM_DRAFT_LAYERS
        )
        self.draft_vocab_size = draft_vocab_size or self.transformer_layer_config.vocab_size
        self.markov_rank = markov_rank
        self.markov_head_type = markov_head_type
        self.enable_confidence_head = enable_confidence_head
        self.confidence_head_with_markov = confidence_head_with_markov
        self.num_target_layers = num_target_layers
        self.verifier_name_or_path = verifier_name_or_path or verifier.get("name_or_path")
        self.verifier_architectures = verifier_architectures or verifier.get("architectures")
        super().__init__(tie_word_embeddings=False, **kwargs)
        self.validate()
        self._refuse_unsupported(target_hidden_size, sliding_window_non_causal)

    def _refuse_unsupported(self, target_hidden_size: int | None, sliding_window_non_causal: bool) -> None:
        """Refuses speculators options this implementation does not run, rather than ignoring them."""
        hidden_size = self.transformer_layer_config.hidden_size
        if target_hidden_size is not None and target_hidden_size != hidden_size:
            raise _fail(
                "target_hidden_size",
                target_hidden_size,
                f"the draft hidden size {hidden_size} (a draft narrower than its target is not supported)",
                "Use a head whose transformer_layer_config.hidden_size equals the target's.",
            )
        layer_types = set(self.transformer_layer_config.layer_types or ["full_attention"])
        if layer_types != {"full_attention"} or sliding_window_non_causal:
            raise _fail(
                "transformer_layer_config.layer_types",
                sorted(layer_types),
                "only full-attention draft layers (sliding-window draft layers are not supported yet)",
                "Use a head trained with full attention.",
            )

    @classmethod
    def for_target(
        cls,
        target_config: PretrainedConfig,
        *,
        num_draft_layers: int = DEFAULT_NUM_DRAFT_LAYERS,
        num_target_taps: int = DEFAULT_NUM_TARGET_TAPS,
        **overrides: Any,
    ) -> DSparkConfig:
        """Sizes an untrained head for a target: its hidden size, heads, vocabulary and RoPE.

        The draft layers are Qwen3 layers shaped like the target's (as in every public DSpark
        implementation). Tap layers follow :func:`default_target_layer_ids`. The mask token is the
        target's ``pad_token_id``, else its (first) ``eos_token_id``, unless given.

        Args:
            target_config: The target's config (its text config is used for multimodal models).
            num_draft_layers: ``N_d``.
            num_target_taps: Number of target layers to tap when ``target_layer_ids`` is not given.
            **overrides: Any other :class:`DSparkConfig` field (``block_size``, ``markov_rank``, ...).

        Raises:
            DSparkConfigError: If no mask token can be chosen, or a field is invalid.
        """
        text = target_config.get_text_config()
        rope = text.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        rope = rope.get("full_attention", rope)  # Gemma-style per-layer-type parameters
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        layer_config = Qwen3Config(
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_hidden_layers=num_draft_layers,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=head_dim,
            max_position_embeddings=text.max_position_embeddings,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=dict(rope),
            attention_bias=getattr(text, "attention_bias", False),
        )
        eos = text.eos_token_id if text.eos_token_id is not None else target_config.eos_token_id
        eos = eos[0] if isinstance(eos, list) else eos
        pad = text.pad_token_id if text.pad_token_id is not None else target_config.pad_token_id
        architectures = target_config.architectures
        derived = {
            "transformer_layer_config": layer_config,
            "mask_token_id": pad if pad is not None else eos,
            "num_target_layers": text.num_hidden_layers,
            "verifier_name_or_path": target_config.name_or_path or None,
            "verifier_architectures": list(architectures) if architectures else None,
        }
        if "aux_hidden_state_layer_ids" not in overrides:
            derived["target_layer_ids"] = default_target_layer_ids(text.num_hidden_layers, num_target_taps)
        fields = {**derived, **overrides}
        if fields["mask_token_id"] is None:
            raise _fail(
                "mask_token_id",
                None,
                "a token id (the target defines no pad or eos token)",
                "Pass mask_token_id.",
            )
        return cls(**fields)

    @staticmethod
    def _resolve_layer_ids(target_layer_ids: list[int] | None, aux_ids: list[int] | None) -> list[int] | None:
        if aux_ids is None:
            return None if target_layer_ids is None else list(target_layer_ids)
        converted = from_aux_layer_ids(list(aux_ids))
        if target_layer_ids is not None and list(target_layer_ids) != converted:
            raise _fail(
                "target_layer_ids",
                target_layer_ids,
                f"aux_hidden_state_layer_ids - 1 = {converted} (aux ids given: {aux_ids})",
                "Give only one of the two; aux_hidden_state_layer_ids = target_layer_ids + 1.",
            )
        return converted

    @property
    def num_draft_layers(self) -> int:
        """Number of draft decoder layers ``N_d``."""
        return self.transformer_layer_config.num_hidden_layers

    @property
    def target_vocab_size(self) -> int:
        """Vocabulary size ``V`` of the target (and of the Markov ``W1`` table)."""
        return self.transformer_layer_config.vocab_size

    @property
    def vocab_size(self) -> int:
        """Not a Transformers assistant model's vocabulary: fails with what to call instead.

        ``generate(assistant_model=...)`` reads ``vocab_size`` first; a DSpark head cannot drive
        Transformers' own assisted decoding, so the error says how to decode with it.
        """
        raise AttributeError(
            "generate(assistant_model=...) got a DSpark head, which is not a Transformers assistant model: "
            "assistant_model runs Transformers' own assisted decoding and expects a smaller causal LM. Decode "
            "with the head through DSparkForCausalLM(target).generate(..., assistant=head), or "
            "target.generate(..., custom_generate=spark_generate.decode, dspark_head=head)."
        )

    @property
    def aux_hidden_state_layer_ids(self) -> list[int] | None:
        """Tap layers in speculators convention (``target_layer_ids + 1``)."""
        return None if self.target_layer_ids is None else to_aux_layer_ids(self.target_layer_ids)

    @property
    def num_draft_tokens(self) -> int:
        """Tokens drafted per block: ``block_size``, or ``block_size - 1`` in the DFlash convention."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def validate(self) -> None:
        """Checks every field; raises :class:`DSparkConfigError` with what was given and how to fix it."""
        minimum_block = 1 if self.sample_from_anchor else 2
        if not isinstance(self.block_size, int) or self.block_size < minimum_block:
            raise _fail(
                "block_size",
                self.block_size,
                f"an int >= {minimum_block} (sample_from_anchor={self.sample_from_anchor})",
                "Use the paper's 7.",
            )
        if not isinstance(self.markov_rank, int) or self.markov_rank < 0:
            raise _fail("markov_rank", self.markov_rank, "an int >= 0 (0 disables the Markov head)", "Use 256.")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise _fail("markov_head_type", self.markov_head_type, f"one of {MARKOV_HEAD_TYPES}", "")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise _fail(
                "confidence_head_with_markov",
                True,
                "False when markov_rank=0 (the confidence head reads the Markov embedding W1[x_{k-1}])",
                "Set confidence_head_with_markov=False or enable_confidence_head=False, or markov_rank > 0.",
            )
        vocab_size = self.target_vocab_size
        if not 1 <= self.draft_vocab_size <= vocab_size:
            raise _fail(
                "draft_vocab_size",
                self.draft_vocab_size,
                f"between 1 and the target vocabulary size {vocab_size}",
                "Leave it unset for the full vocabulary.",
            )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < vocab_size:
            raise _fail("mask_token_id", self.mask_token_id, f"a token id in [0, {vocab_size})", "")
        self._validate_layer_ids()

    def _validate_layer_ids(self) -> None:
        ids = self.target_layer_ids
        if ids is None:
            return
        if not ids or any(b <= a for a, b in pairwise(ids)) or ids[0] < -1:
            raise _fail(
                "target_layer_ids",
                ids,
                "a non-empty, strictly increasing list of ids >= -1 (-1 is the embedding output)",
                "Sort them.",
            )
        if self.num_target_layers is not None and ids[-1] >= self.num_target_layers - 1:
            raise _fail(
                "target_layer_ids",
                ids,
                f"0-based decoder-layer ids below {self.num_target_layers - 1} for a "
                f"{self.num_target_layers}-layer target (the final layer is never tapped)",
                f"Use e.g. {default_target_layer_ids(self.num_target_layers)}; if these are speculators "
                "aux ids, pass them as aux_hidden_state_layer_ids.",
            )

    def check_target(self, target_config: PretrainedConfig, *, target_name: str | None = None) -> None:
        """Checks that a target model matches this head before any generation.

        Args:
            target_config: The target's config (its text config is used for multimodal models).
            target_name: The target's hub id or path, compared with ``verifier_name_or_path``.

        Raises:
            DSparkConfigError: On a vocabulary, hidden-size or layer-count mismatch, or tap layers
                out of range. A differing verifier name with matching shapes only warns.
        """
        text_config = target_config.get_text_config()
        num_layers = text_config.num_hidden_layers
        checks = [
            ("vocab_size", text_config.vocab_size, self.target_vocab_size),
            ("hidden_size", text_config.hidden_size, self.transformer_layer_config.hidden_size),
            ("num_hidden_layers", num_layers, self.num_target_layers or num_layers),
        ]
        for field, got, expected in checks:
            if got != expected:
                raise DSparkConfigError(
                    f"this DSpark head was built for a target with {field}={expected} "
                    f"({self.verifier_name_or_path or 'unnamed verifier'}), but the given target has "
                    f"{field}={got}. Load the head trained for this target, or build one with "
                    "DSparkHead.from_target(target)."
                )
        if self.target_layer_ids is not None and self.target_layer_ids[-1] >= num_layers - 1:
            raise _fail(
                "target_layer_ids",
                self.target_layer_ids,
                f"ids below {num_layers - 1} for this {num_layers}-layer target",
                "The head does not fit this target.",
            )
        if target_name and self.verifier_name_or_path and target_name != self.verifier_name_or_path:
            warnings.warn(
                f"the DSpark head was trained for {self.verifier_name_or_path!r} but is attached to "
                f"{target_name!r}; shapes match, so it runs, but acceptance may be low.",
                stacklevel=2,
            )

    def to_dict(self) -> dict[str, Any]:
        """Serializes to the speculators ``"dspark"`` config format, every field written explicitly."""
        layer_config = self.transformer_layer_config.to_diff_dict()
        layer_config.pop("transformers_version", None)
        return {
            "architectures": ["DSparkDraftModel"],
            "model_type": self.model_type,
            "speculators_model_type": "dspark",
            "block_size": self.block_size,
            "sample_from_anchor": self.sample_from_anchor,
            "draft_vocab_size": self.draft_vocab_size,
            "mask_token_id": self.mask_token_id,
            "aux_hidden_state_layer_ids": self.aux_hidden_state_layer_ids,
            "target_hidden_size": self.transformer_layer_config.hidden_size,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "sliding_window_non_causal": False,
            "tie_word_embeddings": False,
            "num_target_layers": self.num_target_layers,
            "speculators_config": {
                "algorithm": "dspark",
                "proposal_methods": [
                    {
                        "proposal_type": "greedy",
                        "speculative_tokens": self.num_draft_tokens,
                        "verifier_accept_k": 1,
                        "accept_tolerance": 0.0,
                    }
                ],
                "default_proposal_method": "greedy",
                "verifier": {
                    "name_or_path": self.verifier_name_or_path,
                    "architectures": self.verifier_architectures,
                },
            },
            "transformer_layer_config": layer_config,
            "dtype": str(self.dtype).removeprefix("torch.") if self.dtype is not None else None,
            "transformers_version": transformers.__version__,
        }

    def to_diff_dict(self) -> dict[str, Any]:
        """Returns :meth:`to_dict`: readers with other defaults (speculators, vLLM) need every field."""
        return self.to_dict()
