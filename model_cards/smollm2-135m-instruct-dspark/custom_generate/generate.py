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

import inspect
import os
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download

from spark_generate import DSparkForCausalLM

HUB_OPTIONS = ("revision", "cache_dir", "local_files_only", "token")
HEAD_FILES = ["*.json", "*.safetensors", "*.md"]


def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs `model.generate(*args, **kwargs)` with DSpark speculative decoding and this repository's head."""
    folder = _head_folder({name: kwargs.pop(name) for name in HUB_OPTIONS if name in kwargs})
    weight = model.get_output_embeddings().weight
    # One wrapper per head folder and placement, kept on the model: the head is loaded once.
    wrappers = model.__dict__.setdefault("_dspark_custom_generate", {})
    key = (folder, weight.dtype, weight.device)
    if key not in wrappers:
        wrappers[key] = DSparkForCausalLM(model, folder)
    return wrappers[key].generate(*args, **kwargs)


def _head_folder(hub_options: dict[str, Any]) -> str:
    """This repository as a local folder, found from the `custom_generate` argument of `generate()`.

    Transformers runs a copy of this file from its modules cache, so `__file__` does not lead back
    to the repository; the `generate()` call that runs this function holds its name or path.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            location = frame.f_locals.get("custom_generate") if frame.f_code.co_name == "generate" else None
            if isinstance(location, (str, os.PathLike)):
                if Path(location).is_dir():
                    return str(Path(location).resolve())
                return snapshot_download(str(location), allow_patterns=HEAD_FILES, **hub_options)
            frame = frame.f_back
    finally:
        del frame
    raise ValueError(
        "cannot tell which repository this DSpark custom_generate function belongs to: no generate() call "
        "with custom_generate=<folder or Hub id> runs it. Call model.generate(..., custom_generate=<the head "
        "repository>, trust_remote_code=True), or use spark_generate.DSparkForCausalLM(model, <head>).generate."
    )
