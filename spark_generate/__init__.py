"""spark_generate: lossless DSpark speculative decoding for Hugging Face causal language models.

A small draft head reads hidden states from a few layers of the frozen target model and drafts a
whole block of tokens in one parallel pass; a low-rank Markov head restores the dependency between
the tokens of the block, and a confidence head predicts how much of the block will survive. The
target verifies the block in one forward pass and chain rejection sampling
(:func:`spark_generate.kernels.rejection_sample`) keeps exactly the target's output distribution.

Importing this package never imports Triton: the Triton kernels are loaded lazily, and only when a
call asks for them.
"""

from spark_generate.kernels import RandomStream, rejection_sample
from spark_generate.sampling import sample

__version__ = "0.1.0.dev0"

__all__ = [
    "RandomStream",
    "__version__",
    "rejection_sample",
    "sample",
]
