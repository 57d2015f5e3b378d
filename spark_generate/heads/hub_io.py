"""Hub I/O of DSpark heads: save, push and load in the speculators format, load DeepSpec folders.

:class:`DSparkHubMixin` overrides the :class:`~transformers.PreTrainedModel` entry points so that
saving also writes the model card and the ``custom_generate/`` folder that lets a plain
Transformers model decode with the head (:mod:`spark_generate.heads.custom_generate`), pushing
keeps that card, and loading goes through :mod:`spark_generate.heads.formats`, which reads both
checkpoint formats and refuses to build a half-loaded head. speculators and vLLM read only
``config.json`` and the weights, so the extra files do not disturb them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard
from transformers import PreTrainedModel
from typing_extensions import Self

from spark_generate.config import DSparkConfig, DSparkConfigError
from spark_generate.heads.card import render_model_card
from spark_generate.heads.custom_generate import write_custom_generate
from spark_generate.heads.feature_scale import export_state_dict
from spark_generate.heads.formats import load_checkpoint, validate_state_dict


class DSparkHubMixin(PreTrainedModel):
    """Model card, ``save_pretrained``, ``push_to_hub`` and ``from_pretrained`` of :class:`DSparkHead`."""

    config: DSparkConfig

    def model_card(
        self,
        *,
        model_id: str | None = None,
        license: str | None = None,
        datasets: list[str] | None = None,
        training: str | None = None,
        provenance: Mapping[str, object] | None = None,
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

        Args:
            pretrained_model_name_or_path: A local folder or a Hub id (read through the cache
                when offline).
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

        Raises:
            DSparkCheckpointError: If the folder, config or weights are missing, corrupt or do
                not match each other.
        """
        unsupported = sorted(name for name, value in auto_model_kwargs.items() if value)
        if unsupported:
            raise TypeError(f"DSparkHead.from_pretrained does not support {unsupported}; use dtype and device")
        checkpoint = load_checkpoint(
            pretrained_model_name_or_path,
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
        head = cls(checkpoint.config)
        validate_state_dict(checkpoint.state_dict, head.state_dict(), checkpoint.folder)
        head.load_state_dict(checkpoint.state_dict, strict=True)
        head.to(device=device, dtype=dtype or checkpoint.state_dict["fc.weight"].dtype)
        if head.confidence_head is not None:
            head.confidence_head.float()
        return head.eval()
