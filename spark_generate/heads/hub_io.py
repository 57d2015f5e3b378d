"""Hub I/O of DSpark heads: save, push and load in the speculators format, load DeepSpec folders.

:class:`DSparkHubMixin` overrides the :class:`~transformers.PreTrainedModel` entry points so that
saving also writes the model card and the ``custom_generate/`` folder that lets a plain
Transformers model decode with the head (:mod:`spark_generate.heads.custom_generate`), pushing
keeps that card, and loading goes through :mod:`spark_generate.heads.formats`, which reads both
checkpoint formats and refuses to build a half-loaded head. speculators and vLLM read only
``config.json`` and the weights, so the extra files do not disturb them.

A head carries its STS calibration (:attr:`DSparkHubMixin.sts_temperatures`, one temperature per
draft slot for the confidence head): ``from_pretrained`` reads it from the folder's
``calibration.json`` (what ``spark-generate calibrate`` writes) and ``save_pretrained`` writes it
back, so a head plans the default schedule with the same confidences however it is passed.

A name that reads as a local path (:func:`local_path_or_hub_id`) but names no folder fails with
one line naming the folder and the working directory, instead of being tried as a Hub id.
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers import PreTrainedModel
from typing_extensions import Self

from spark_generate.config import DSparkConfig, DSparkConfigError
from spark_generate.heads.card import render_model_card
from spark_generate.heads.custom_generate import write_custom_generate
from spark_generate.heads.feature_scale import export_state_dict
from spark_generate.heads.formats import DSparkCheckpointError, load_checkpoint, validate_state_dict

__all__ = ["CALIBRATION_NAME", "DSparkHubMixin", "load_calibration", "local_path_or_hub_id"]

CALIBRATION_NAME = "calibration.json"


def load_calibration(path: str | os.PathLike) -> torch.Tensor:
    """Reads per-slot STS temperatures ``[S]`` (float32) from a JSON file ``{"temperatures": [T_1, ..., T_S]}``.

    Raises:
        ValueError: The file is not a JSON object, or holds no list of positive numbers under ``"temperatures"``.
    """
    try:
        temperatures = json.loads(Path(path).read_text()).get("temperatures")
    except (json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f'{path} is not a JSON object ({error}); expected {{"temperatures": [...]}}.') from None
    numbers = isinstance(temperatures, list) and all(isinstance(t, (int, float)) for t in temperatures)
    if not numbers or not temperatures or any(t <= 0 for t in temperatures):
        raise ValueError(f"{path} holds temperatures={temperatures!r}; expected a non-empty list of positive numbers.")
    return torch.tensor(temperatures, dtype=torch.float32)


def _path_reason(name: str) -> str | None:
    """Why ``name`` reads as a local path rather than a Hub id (``name`` or ``org/name``), or None."""
    if name.startswith((".", "/", "~", os.sep)):
        return f"it starts with {name[0]!r}"
    parts = name.replace(os.sep, "/").split("/")
    if len(parts) > 2:
        return "it has more than one path separator"
    if len(parts) == 2 and Path(parts[0]).is_dir():
        return f"{parts[0]!r} is a folder in the current directory"
    try:
        validate_repo_id(name)
    except HFValidationError as error:
        return f"it is not a valid Hub id: {error}"
    return None


def local_path_or_hub_id(name_or_path: str | os.PathLike) -> str | Path:
    """A head's location: an existing local folder (``~`` expanded), else a Hub id.

    A name reads as a local path when it is an :class:`os.PathLike` or an existing file, starts
    with ``.``, ``/`` or ``~``, has more than one path separator, starts with a folder of the
    current directory (as ``model_cards/...`` does in this repository), or is not a valid Hub id
    (``name`` or ``org/name``, of letters, digits, ``-``, ``_`` and ``.``). Any other name that is
    not a local folder is a Hub id.

    Raises:
        DSparkCheckpointError: A local path that is not an existing folder, in one line that names
            the folder, the current directory and a similarly named folder if there is one. It is
            raised without a cause, so no chain of Hub connection errors follows it.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    where = path.resolve()
    if where.exists():
        problem = f"{where} is a file, not a head folder"
    else:
        reason = _path_reason(name_or_path) if isinstance(name_or_path, str) else "it is a path object"
        if reason is None:
            return str(name_or_path)
        problem = f"it reads as a local path ({reason}) and there is no folder {where}"
        neighbours = (
            [entry.name for entry in where.parent.iterdir() if entry.is_dir()] if where.parent.is_dir() else []
        )
        close = difflib.get_close_matches(where.name, neighbours, n=1)
        if close:
            problem += f" (did you mean {str(Path(name_or_path).with_name(close[0]))!r}?)"
    raise DSparkCheckpointError(
        f"cannot load a DSpark head from {str(name_or_path)!r}: {problem}; the current directory is {Path.cwd()}. "
        "Expected a head folder (config.json and model.safetensors) or a Hub id such as 'org/name': correct the "
        "path, or pass an absolute one."
    ) from None


class DSparkHubMixin(PreTrainedModel):
    """Model card, ``save_pretrained``, ``push_to_hub`` and ``from_pretrained`` of :class:`DSparkHead`."""

    config: DSparkConfig
    _sts_temperatures: torch.Tensor | None = None

    @property
    def sts_temperatures(self) -> torch.Tensor | None:
        """``[S]`` float32 STS temperatures of the confidence head (``c_j = sigmoid(z_j / T_j)``), or None.

        Read by :meth:`from_pretrained` from the folder's ``calibration.json`` and written by
        :meth:`save_pretrained`; the default schedule plans with them. Set it to a fitted
        calibration (e.g. ``load_calibration("sts.json")``), or to None for raw confidences.

        Raises:
            ValueError: On assignment of anything but ``S = config.num_draft_tokens`` finite
                positive temperatures.
        """
        return self._sts_temperatures

    @sts_temperatures.setter
    def sts_temperatures(self, temperatures: torch.Tensor | None) -> None:
        if temperatures is None:
            self._sts_temperatures = None
            return
        temperatures = torch.as_tensor(temperatures, dtype=torch.float32).detach().cpu()
        num_slots = self.config.num_draft_tokens
        if temperatures.shape != (num_slots,) or not (torch.isfinite(temperatures) & (temperatures > 0)).all():
            raise ValueError(
                f"sts_temperatures has shape {list(temperatures.shape)} and values {temperatures.tolist()}; expected "
                f"{num_slots} finite positive temperatures, one per draft slot of this head. Calibrate this head with "
                "`spark-generate calibrate`."
            )
        self._sts_temperatures = temperatures

    def _place(self, *, dtype: torch.dtype, device: str | torch.device | None) -> None:
        """Moves the head to ``device`` and casts it to ``dtype``; the confidence head stays float32.

        The confidence head's float32 values are restored after the cast, so they are never rounded
        through ``dtype`` (loading a checkpoint in bfloat16 and casting it to float32 then gives the
        head loaded in float32 directly).
        """
        confidence = None
        if self.confidence_head is not None:
            confidence = {
                name: value.detach().float().clone() for name, value in self.confidence_head.state_dict().items()
            }
        self.to(device=device, dtype=dtype)
        if self.confidence_head is not None:
            self.confidence_head.float().load_state_dict(confidence)

    def model_card(
        self,
        *,
        model_id: str | None = None,
        license: str | None = None,
        datasets: list[str] | None = None,
        training: str | None = None,
        provenance: Mapping[str, object] | None = None,
        earlier_stages: Sequence[Mapping[str, object]] | None = None,
        results: Mapping[str, object] | None = None,
    ) -> ModelCard:
        """Renders the ``README.md`` model card (see :func:`~spark_generate.heads.card.render_model_card`)."""
        num_parameters = sum(p.numel() for p in self.parameters() if p.requires_grad)
        return render_model_card(
            self.config,
            num_parameters=num_parameters,
            model_id=model_id,
            license=license,
            datasets=datasets,
            training=training,
            provenance=provenance,
            earlier_stages=earlier_stages,
            results=results,
        )

    def save_pretrained(
        self,
        save_directory: str | os.PathLike,
        *,
        model_card: ModelCard | None = None,
        custom_generate: bool = True,
        **kwargs: Any,
    ) -> None:
        """Writes the speculators ``"dspark"`` format (``config.json``, ``model.safetensors``) and a card.

        With :attr:`sts_temperatures` set, ``calibration.json`` holds them (``{"temperatures": [...]}``).

        Args:
            save_directory: Target folder.
            model_card: A card from :meth:`model_card`; default: a card without training results.
            custom_generate: Also write ``custom_generate/``, so that
                ``target.generate(..., custom_generate=<this folder or its Hub id>, trust_remote_code=True)``
                decodes with this head (:mod:`spark_generate.heads.custom_generate`).
            **kwargs: Passed to :meth:`transformers.PreTrainedModel.save_pretrained`.
        """
        card = model_card or self.model_card()
        kwargs.setdefault("state_dict", export_state_dict(self))  # fc.weight folded with its feature scale
        super().save_pretrained(save_directory, **kwargs)
        card.save(Path(save_directory) / "README.md")
        if self.sts_temperatures is not None:
            calibration = {"temperatures": self.sts_temperatures.tolist()}
            (Path(save_directory) / CALIBRATION_NAME).write_text(json.dumps(calibration, indent=2) + "\n")
        if custom_generate:
            write_custom_generate(save_directory)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        model_card: ModelCard | None = None,
        token: str | bool | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> Any:
        """Uploads the head with the standard mixin, then its model card (which the mixin replaces).

        Args:
            repo_id: Hub repository id.
            model_card: A card from :meth:`model_card`; default: one naming ``repo_id``.
            token: Hub token.
            revision: Branch to push to.
            **kwargs: Passed to :meth:`transformers.PreTrainedModel.push_to_hub`.

        Returns:
            The commit info of the weights upload.
        """
        card = model_card or self.model_card(model_id=repo_id)
        commit = super().push_to_hub(repo_id, token=token, revision=revision, **kwargs)
        card.push_to_hub(repo_id, token=token, revision=revision)
        return commit

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        *,
        sample_from_anchor: bool | None = None,
        revision: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        token: str | bool | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        config: DSparkConfig | None = None,
        **auto_model_kwargs: Any,
    ) -> Self:
        """Loads a head in the speculators ``"dspark"`` or the DeepSpec format, all or nothing.

        The folder's ``calibration.json``, when there is one, becomes :attr:`sts_temperatures`. The
        head keeps the stored dtype unless ``dtype`` is given; generation drafts in the target's
        dtype whatever it is (:meth:`~spark_generate.heads.DSparkHead.for_drafting`).

        Args:
            pretrained_model_name_or_path: A local folder or a Hub id (read through the cache
                when offline). A name that reads as a local path (see :func:`local_path_or_hub_id`)
                is never tried as a Hub id.
            sample_from_anchor: Overrides the slot convention of the file (see
                :func:`~spark_generate.config.resolve_sample_from_anchor`).
            revision: Hub revision.
            cache_dir: Hub cache folder.
            local_files_only: Never touch the network.
            token: Hub token.
            dtype: Parameter dtype; default: the stored dtype (the confidence head stays float32).
            device: Device; default: CPU.
            config: Passed by ``AutoModel.from_pretrained``; the folder's ``config.json`` (with
                the format conversions above) is authoritative, so it must agree with it.
            **auto_model_kwargs: What ``AutoModel.from_pretrained`` always passes
                (``trust_remote_code``, ``adapter_kwargs``, ...); only empty values are accepted,
                so an unsupported option (e.g. ``device_map``) fails instead of being ignored.
                Its private ``_from_auto`` marker (transformers >= 5.25) is dropped.

        Raises:
            DSparkCheckpointError: If the folder, config, weights or calibration are missing,
                corrupt or do not match each other.
        """
        auto_model_kwargs.pop("_from_auto", None)
        unsupported = sorted(name for name, value in auto_model_kwargs.items() if value)
        if unsupported:
            raise TypeError(f"DSparkHead.from_pretrained does not support {unsupported}; use dtype and device")
        checkpoint = load_checkpoint(
            local_path_or_hub_id(pretrained_model_name_or_path),
            sample_from_anchor=sample_from_anchor,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            token=token,
        )
        if config is not None and config.to_dict() != checkpoint.config.to_dict():
            raise DSparkConfigError(
                f"the config passed to from_pretrained differs from {checkpoint.folder}/config.json; "
                "pass sample_from_anchor to override the slot convention, or edit the folder's config"
            )
        with torch.random.fork_rng(devices=[]):  # the random initialization is overwritten: draw nothing for it
            head = cls(checkpoint.config)
        validate_state_dict(checkpoint.state_dict, head.state_dict(), checkpoint.folder)
        head.load_state_dict(checkpoint.state_dict, strict=True)
        head._place(dtype=dtype or checkpoint.state_dict["fc.weight"].dtype, device=device)
        calibration = checkpoint.folder / CALIBRATION_NAME
        if calibration.is_file():
            try:
                head.sts_temperatures = load_calibration(calibration)
            except ValueError as error:
                raise DSparkCheckpointError(
                    f"{error} Recalibrate this head (spark-generate calibrate --output {calibration}), or delete the "
                    "file to plan with its raw confidences."
                ) from None
        return head.eval()
