"""Model cards for DSpark heads, rendered from ``model_card_template.md`` (``model_cards/TEMPLATE.md``).

Every saved head gets a ``README.md`` whose YAML header links it into its target's model tree on
the Hub (``base_model``, ``library_name: spark_generate``, ``tags: [dspark, speculative-decoding]``)
and whose body states the target, the head's architecture, where its training data came from and
what was measured. The template uses ``$name`` placeholders (:class:`string.Template`), so no
template engine is needed; the YAML header is written by :class:`huggingface_hub.ModelCardData`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from string import Template

from huggingface_hub import ModelCard, ModelCardData

from spark_generate.config import DSparkConfig

TEMPLATE_PATH = Path(__file__).resolve().parent / "model_card_template.md"
TAGS = ["dspark", "speculative-decoding", "draft-model"]
NOT_MEASURED = "Not measured yet: no acceptance lengths or speed-ups have been recorded for this head."
NO_TRAINING = "Untrained: this head was built by `DSparkHead.from_target` and has random weights."


def _table(rows: Mapping[str, object]) -> str:
    lines = ["| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows.items()]
    return "\n".join(lines)


def _column_table(rows: Sequence[Mapping[str, object]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(str(value) for value in row.values()) + " |" for row in rows]
    return "\n".join(lines)


def render_model_card(
    config: DSparkConfig,
    *,
    num_parameters: int,
    model_id: str | None = None,
    license: str | None = None,
    datasets: list[str] | None = None,
    training: str | None = None,
    provenance: Mapping[str, object] | None = None,
    earlier_stages: Sequence[Mapping[str, object]] | None = None,
    results: Mapping[str, object] | None = None,
) -> ModelCard:
    """Renders the model card of a head.

    Args:
        config: The head's configuration.
        num_parameters: Number of trainable parameters of the head.
        model_id: The head's Hub id, used in the usage snippets.
        license: The licence id (match the target's terms).
        datasets: Hub ids of the training datasets.
        training: How the head was trained, in prose (data, regeneration, recipe).
        provenance: Facts such as commit, date, hardware, seed; rendered as a table.
        earlier_stages: The stages the head was trained in before, newest first, one summary row
            each (the same keys in every row); rendered as a table after ``provenance``.
        results: Measured numbers (mean accepted length, speed-up with hardware, temperature).

    Returns:
        The card; ``card.save(path)`` writes it.
    """
    base_model = config.verifier_name_or_path or "unknown-target"
    card_data = ModelCardData(
        base_model=config.verifier_name_or_path,
        library_name="spark_generate",
        license=license,
        datasets=datasets,
        tags=TAGS,
        pipeline_tag="text-generation",
    )
    markov = "disabled (`markov_rank=0`, pure DFlash)"
    if config.markov_rank:
        markov = f"{config.markov_head_type}, rank {config.markov_rank}"
    confidence = "disabled"
    if config.enable_confidence_head:
        confidence = "hidden state" + (" + Markov embedding" if config.confidence_head_with_markov else "")
    draft_vocab = f"{config.draft_vocab_size} of {config.target_vocab_size} target tokens"
    training_text = training or NO_TRAINING
    if provenance:
        training_text += "\n\n" + _table(provenance)
    if earlier_stages:
        training_text += (
            "\n\nEarlier stages, newest first (`provenance.json` keeps every field of each):\n\n"
            + _column_table(earlier_stages)
        )
    values = {
        "card_data": card_data.to_yaml(),
        "model_name": f"DSpark head for {base_model}",
        "model_id": model_id or "<this-repo>",
        "base_model": base_model,
        "verifier_architectures": ", ".join(config.verifier_architectures or ["unknown"]),
        "target_layer_ids": config.target_layer_ids,
        "aux_layer_ids": config.aux_hidden_state_layer_ids,
        "num_draft_layers": config.num_draft_layers,
        "hidden_size": config.transformer_layer_config.hidden_size,
        "block_size": config.block_size,
        "num_draft_tokens": config.num_draft_tokens,
        "sample_from_anchor": config.sample_from_anchor,
        "markov_head": markov,
        "confidence_head": confidence,
        "draft_vocab": draft_vocab,
        "mask_token_id": config.mask_token_id,
        "num_parameters": f"{num_parameters:,}",
        "training": training_text,
        "results": _table(results) if results else NOT_MEASURED,
    }
    return ModelCard(Template(TEMPLATE_PATH.read_text()).substitute(values))
