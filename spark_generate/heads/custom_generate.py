"""The ``custom_generate/`` folder a saved head carries, so plain Transformers models can use it.

Transformers runs a repository's ``custom_generate/generate.py`` when ``generate()`` is called with
that repository (a Hub id or a local folder) as ``custom_generate`` and ``trust_remote_code=True``::

    target.generate(**inputs, custom_generate="org/dspark-head", trust_remote_code=True, max_new_tokens=64)

It first checks ``custom_generate/requirements.txt`` against the installed packages, then calls the
file's ``generate(model=target, **arguments)`` with *every* argument of ``generate()`` (the
prompt, the generation config, processors, stopping criteria, the streamer, and the extra keywords
unvalidated), and returns what it returns. The ``generate.py`` written here is a thin shell around
the package: it loads the head stored in the same repository (with its ``calibration.json``),
attaches it to the target and hands everything to :class:`~spark_generate.DSparkForCausalLM`,
whose ``generate`` runs the target's own ``generate()`` with :func:`spark_generate.decode` as the
decoding loop.

One detail decides its shape: Transformers imports a *copy* of ``generate.py`` from its modules
cache (``~/.cache/huggingface/modules``), so the file's ``__file__`` does not lead back to the
repository. The repository is the ``custom_generate`` argument of the ``generate()`` call that runs
the file, so ``generate.py`` reads it from that caller's frame; a user may instead name a head
with ``assistant=``. The file is kept here as source text (it imports the top-level package, which
no module of :mod:`spark_generate.heads` may do) and is written by
:meth:`~spark_generate.heads.DSparkHead.save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["CUSTOM_GENERATE_DIR", "GENERATE_SOURCE", "REQUIREMENTS", "write_custom_generate"]

CUSTOM_GENERATE_DIR = "custom_generate"

GENERATE_SOURCE = '''\
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
'''

REQUIREMENTS = """\
# generate.py needs spark_generate 0.1.0.dev0 or later (DSparkForCausalLM). Transformers reads
# versions as digits and dots only, so a pre-release cannot be pinned here.
spark-generate
"""


def write_custom_generate(folder: str | Path) -> None:
    """Writes ``custom_generate/generate.py`` and ``custom_generate/requirements.txt`` into a head folder."""
    target = Path(folder) / CUSTOM_GENERATE_DIR
    target.mkdir(parents=True, exist_ok=True)
    (target / "generate.py").write_text(GENERATE_SOURCE)
    (target / "requirements.txt").write_text(REQUIREMENTS)
