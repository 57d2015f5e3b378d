"""spark_generate: lossless DSpark speculative decoding for Hugging Face causal language models.

A small draft head reads hidden states from a few layers of the frozen target model and drafts a
whole block of tokens in one parallel pass; a low-rank Markov head restores the dependency between
the tokens of the block, and a confidence head predicts how much of the block will survive. The
target verifies the block in one forward pass and chain rejection sampling
(:func:`spark_generate.kernels.rejection_sample`) keeps exactly the target's output distribution.

Importing this package imports neither torch nor Triton: every name below is loaded on first use,
and the Triton kernels only when a call asks for them.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_generate.config import DSparkConfig, retain_freed_memory
    from spark_generate.generation import decode
    from spark_generate.heads import DSparkHead
    from spark_generate.kernels import RandomStream, rejection_sample
    from spark_generate.modeling import DSparkForCausalLM
    from spark_generate.packing import packed_linears
    from spark_generate.profiling import profile_costs
    from spark_generate.sampling import inverse_cdf_sample, sample
    from spark_generate.schedule import AdaptiveSchedule, ConfidenceThreshold, CostTable, FixedLength, GoodputSchedule
    from spark_generate.suffix import CorpusIndex, SuffixDrafter
    from spark_generate.telemetry import DSparkGenerateOutput, SpeculativeStats

# The public API is imported on first use: importing Transformers models imports Triton through
# torch (torch._native.ops), and importing torch alone takes seconds, which `spark-generate --help`
# (spark_generate.cli, inside this package) must not pay. `spark_generate.decode` works as before.
_LAZY_EXPORTS = {
    "AdaptiveSchedule": "spark_generate.schedule",
    "ConfidenceThreshold": "spark_generate.schedule",
    "CorpusIndex": "spark_generate.suffix",
    "CostTable": "spark_generate.schedule",
    "DSparkConfig": "spark_generate.config",
    "DSparkForCausalLM": "spark_generate.modeling",
    "DSparkGenerateOutput": "spark_generate.telemetry",
    "DSparkHead": "spark_generate.heads",
    "FixedLength": "spark_generate.schedule",
    "GoodputSchedule": "spark_generate.schedule",
    "RandomStream": "spark_generate.kernels",
    "SpeculativeStats": "spark_generate.telemetry",
    "SuffixDrafter": "spark_generate.suffix",
    "decode": "spark_generate.generation",
    "inverse_cdf_sample": "spark_generate.sampling",
    "packed_linears": "spark_generate.packing",
    "profile_costs": "spark_generate.profiling",
    "rejection_sample": "spark_generate.kernels",
    "retain_freed_memory": "spark_generate.config",
    "sample": "spark_generate.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'spark_generate' has no attribute {name!r}")


__version__ = "0.1.0.dev0"

__all__ = [
    "AdaptiveSchedule",
    "ConfidenceThreshold",
    "CorpusIndex",
    "CostTable",
    "DSparkConfig",
    "DSparkForCausalLM",
    "DSparkGenerateOutput",
    "DSparkHead",
    "FixedLength",
    "GoodputSchedule",
    "RandomStream",
    "SpeculativeStats",
    "SuffixDrafter",
    "__version__",
    "decode",
    "inverse_cdf_sample",
    "packed_linears",
    "profile_costs",
    "rejection_sample",
    "retain_freed_memory",
    "sample",
]
