"""DSpark speculative decoding with the draft head stored in this repository, for a Transformers model.

    out = model.generate(**inputs, custom_generate="<this repository or folder>", trust_remote_code=True)

Transformers calls `generate` below with every argument of `model.generate`. It loads the DSpark
head saved here (config.json, model.safetensors and, if present, calibration.json), attaches it to
`model` and decodes with spark_generate (`pip install spark-generate`). The output is the model's
own: token for token under greedy decoding, the same distribution when sampling. Extra keywords:
`assistant=` (another head: a folder, a Hub id or a DSparkHead), `seed=` and `schedule=`;
`streamer=` works, and `stop_strings=` with `tokenizer=`; `revision=`, `cache_dir=`, `token=` and
`local_files_only=` say how to fetch a Hub repository. Written by DSparkHead.save_pretrained.
"""

from __future__ import annotations

from typing import Any

from spark_generate import DSparkForCausalLM
from spark_generate.hf import custom_generate_repository

HUB_OPTIONS = ("revision", "cache_dir", "local_files_only", "token")


def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs `model.generate(*args, **kwargs)` with DSpark speculative decoding and this repository's head."""
    folder = custom_generate_repository({name: kwargs.pop(name) for name in HUB_OPTIONS if name in kwargs})
    weight = model.get_output_embeddings().weight
    # One wrapper per head folder and placement, kept on the model: the head is loaded once.
    wrappers = model.__dict__.setdefault("_dspark_custom_generate", {})
    key = (folder, weight.dtype, weight.device)
    if key not in wrappers:
        wrappers[key] = DSparkForCausalLM(model, folder)
    return wrappers[key].generate(*args, **kwargs)
