"""`DSparkForCausalLM`: any Transformers causal LM, generating with a DSpark head.

The wrapper holds the target (``.model``) and optionally a default head (``.head``) and behaves
like the target: attribute access (``config``, ``device``, ``dtype``, ``generation_config``,
``save_pretrained``, ...) and ``forward`` go to the target, which is never modified. Only
``generate`` differs::

    model = DSparkForCausalLM.from_pretrained("Qwen/Qwen3-4B", dtype=torch.bfloat16)
    out = model.generate(**inputs, assistant="org/dspark-qwen3-4b", max_new_tokens=256)

With an ``assistant`` (a :class:`~spark_generate.heads.DSparkHead`, a local folder or a Hub id)
or a default head, ``generate`` runs the target's own ``generate()`` with the DSpark loop as its
decoding strategy (:func:`spark_generate.generation.decode`), so every input preparation of
``generate()`` (generation config merging, processors, stopping criteria, masks) is the stock one.
Without a head it *is* the target's ``generate()``.

The wrapper intercepts the arguments ``generate()`` would refuse or not forward to a decoding
callable: ``assistant`` (also accepted under Transformers' own name ``assistant_model`` when it is
a DSpark head), ``streamer``, ``seed``, ``schedule``, and ``stop_strings`` with its ``tokenizer``
(turned into a :class:`~transformers.StopStringCriteria` by :mod:`spark_generate.hf`).

However a head is passed (a folder, a Hub id, a :class:`~spark_generate.heads.DSparkHead` from
``from_pretrained``, or ``target.generate(custom_generate=spark_generate.decode, dspark_head=head)``),
it drafts the same: in the dtype of the target's LM head
(:meth:`~spark_generate.heads.DSparkHead.for_drafting`: a head in another dtype drafts through a
copy, and the head itself is left as it is), and with its own STS calibration
(:attr:`~spark_generate.heads.DSparkHead.sts_temperatures`, read from the folder's
``calibration.json``) in the default schedule. A head given by name is loaded on the target's
device, in the target's dtype.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel, StoppingCriteriaList

from spark_generate.generation import decode, suffix_enabled
from spark_generate.heads import DSparkHead
from spark_generate.hf import route_generate_arguments
from spark_generate.schedule import AdaptiveSchedule, Schedule
from spark_generate.suffix import CorpusIndex
from spark_generate.telemetry import DSparkGenerateOutput

__all__ = ["DSparkForCausalLM"]

HeadLike = DSparkHead | str | os.PathLike


class DSparkForCausalLM(nn.Module):
    """A causal LM that generates with DSpark speculative decoding, without changing its output.

    Args:
        model: Any loaded Transformers causal LM (the target).
        head: Default draft head for :meth:`generate` (a head, a folder or a Hub id), or None.
    """

    def __init__(self, model: PreTrainedModel, head: HeadLike | None = None):
        super().__init__()
        if not isinstance(model, PreTrainedModel) or not hasattr(model, "generate"):
            raise ValueError(
                f"DSparkForCausalLM wraps a Transformers causal LM; got {type(model).__name__}. "
                "Load the target with AutoModelForCausalLM.from_pretrained(...)."
            )
        self.model = model
        self.head = None if head is None else self._load_head(head)

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, assistant: HeadLike | None = None, **kwargs: Any
    ) -> DSparkForCausalLM:
        """Loads the target with ``AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)``.

        Args:
            pretrained_model_name_or_path: Hub id or folder of the target.
            assistant: Default draft head (a head, a folder or a Hub id), or None.
            **kwargs: Passed to ``AutoModelForCausalLM.from_pretrained`` (``dtype``, ``device_map``, ...).
        """
        return cls(AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, **kwargs), assistant)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "model" not in self.__dict__.get("_modules", {}):
                raise
            return getattr(self._modules["model"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The target's forward, unchanged."""
        return self.model(*args, **kwargs)

    def _load_head(self, head: HeadLike) -> DSparkHead:
        """Attaches a head; one given by name is loaded on the target's LM head device, in its dtype."""
        if isinstance(head, DSparkHead):
            return head.attach(self.model)
        device = self.model.get_output_embeddings().weight.device
        return DSparkHead.from_pretrained(head, device=device).for_drafting(self.model)

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        assistant: HeadLike | None = None,
        streamer: Any = None,
        seed: int | torch.Tensor | None = None,
        schedule: Schedule | AdaptiveSchedule | None = None,
        pack_linears: bool | None = None,
        suffix: bool | CorpusIndex | None = None,
        stopping_criteria: StoppingCriteriaList | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | DSparkGenerateOutput | Any:
        """Generates like ``model.generate``, drafting with ``assistant`` (or the default head).

        Args:
            inputs: ``[B, P]`` prompt ids (left-padded for ``B > 1``), as for ``generate()``; a
                list of token ids (or of equal-length lists) is accepted too.
            generation_config: As for ``generate()``.
            assistant: A :class:`DSparkHead`, a local folder or a Hub id; default: ``self.head``.
                Without any head, greedy decoding and sampling draft from the suffix index alone
                (``suffix=False``: plain ``generate()``), and other modes are plain
                ``generate()``. ``assistant_model=`` is accepted for a DSpark head too.
            streamer: A Transformers streamer (batch size 1): the prompt, then each committed chunk.
            seed: Philox seed for sampling: ``int`` or int64 ``[B]`` per row (see
                :func:`spark_generate.decode`); None draws from torch's global generator.
            schedule: How many drafts to verify per step (:mod:`spark_generate.schedule`);
                default: :class:`~spark_generate.schedule.AdaptiveSchedule` with the head's
                :attr:`~spark_generate.heads.DSparkHead.sts_temperatures`.
            pack_linears: Run the float32 CPU linear layers of the model and head through oneDNN
                with pre-packed weights while speculating, from the row counts at which that
                measured faster on this machine (:mod:`spark_generate.packing`); None: on a CPU
                for a float32 model.
            suffix: Suffix drafting from what the prompt and the output already hold
                (:mod:`spark_generate.suffix`), chosen per row and round beside the head: None or
                True on (the default), a :class:`~spark_generate.suffix.CorpusIndex` on with that
                corpus of earlier texts, False off.
            stopping_criteria: Extra stopping criteria, as for ``generate()``.
            **kwargs: Everything else ``generate()`` accepts (``max_new_tokens``, ``do_sample``,
                ``temperature``, ``stop_strings`` with ``tokenizer``, ``attention_mask``, ...).

        Returns:
            What ``generate()`` returns: sequences, or with ``return_dict_in_generate=True`` a
            :class:`~spark_generate.telemetry.DSparkGenerateOutput` with ``dspark_stats``.

        Raises:
            ValueError: An unsupported decoding mode (beam search, contrastive search), a head
                built for another target, or invalid inputs.
        """
        inputs = _as_input_ids(inputs, self.model.device)
        if isinstance(kwargs.get("assistant_model"), (DSparkHead, str, os.PathLike)):
            if assistant is not None:
                raise ValueError(
                    "got both assistant= and assistant_model=; pass the DSpark head once, as assistant=head."
                )
            assistant = kwargs.pop("assistant_model")
        head = self._load_head(assistant) if assistant is not None else self.head
        if head is None and not self._suffix_alone(suffix, generation_config, kwargs):
            return self.model.generate(
                inputs, generation_config, streamer=streamer, stopping_criteria=stopping_criteria, **kwargs
            )
        if kwargs.get("assistant_model") is not None:
            raise ValueError(
                "got both a DSpark head and assistant_model=; pass the DSpark head as assistant= and drop "
                "assistant_model (which selects Transformers' own assisted decoding)."
            )
        generation_config, stopping_criteria = route_generate_arguments(generation_config, stopping_criteria, kwargs)
        return self.model.generate(
            inputs,
            generation_config,
            stopping_criteria=stopping_criteria,
            custom_generate=decode,
            dspark_head=head,
            dspark_streamer=streamer,
            dspark_seed=seed,
            dspark_schedule=schedule,
            dspark_pack_linears=pack_linears,
            dspark_suffix=suffix,
            **kwargs,
        )

    def _suffix_alone(self, suffix: bool | CorpusIndex | None, generation_config: Any, kwargs: dict) -> bool:
        """Whether a generation without a head drafts from the suffix index: on, and greedy or sampling."""
        if not suffix_enabled(suffix):
            return False
        config = copy.deepcopy(generation_config or self.model.generation_config)
        config.update(**{key: value for key, value in kwargs.items() if hasattr(config, key)})
        return config.get_generation_mode().value in ("greedy_search", "sample") and not kwargs.get("assistant_model")


def _as_input_ids(inputs: Any, device: torch.device) -> torch.Tensor | None:
    """``inputs`` as an int64 ``[B, P]`` tensor: a tensor, a list of ids, or a list of equal-length lists.

    Raises:
        ValueError: Lists of different lengths (they need padding and an attention mask).
    """
    if inputs is None or isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, (list, tuple)):
        rows = [list(inputs)] if all(isinstance(token, int) for token in inputs) else [list(row) for row in inputs]
        if rows and len({len(row) for row in rows}) == 1:
            return torch.tensor(rows, dtype=torch.long, device=device)
        raise ValueError(
            f"inputs is a list of {len(rows)} prompts of lengths {sorted({len(row) for row in rows})}; expected "
            "equal lengths. Pad them: tokenizer(prompts, padding=True, padding_side='left', return_tensors='pt')."
        )
    raise ValueError(f"inputs is a {type(inputs).__name__}; expected a [B, P] tensor of token ids (or a list of ids).")
