"""DSpark draft heads: the DFlash backbone, the Markov and confidence heads, and their Hub formats.

:class:`DSparkHead` is the model users hold; the other names are the pieces the generation loop and
the trainer use (see :mod:`spark_generate.heads.dspark` for a drafting round written out). Importing
this package registers :class:`~spark_generate.config.DSparkConfig` and :class:`DSparkHead` with the
Transformers Auto classes (``model_type: "dspark_head"``), so that afterwards ``AutoConfig`` and
``AutoModel`` load saved heads without remote code.
"""

from transformers import AutoConfig, AutoModel

from spark_generate.config import DSparkConfig
from spark_generate.heads.backbone import DraftKVCache, block_attention_mask
from spark_generate.heads.dspark import DraftBlockLogits, DraftStep, DSparkBackboneOutput, DSparkHead
from spark_generate.heads.formats import DSparkCheckpointError
from spark_generate.heads.markov import MarkovHead, MarkovStep

AutoConfig.register(DSparkConfig.model_type, DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkHead, exist_ok=True)

__all__ = [
    "DSparkBackboneOutput",
    "DSparkCheckpointError",
    "DSparkHead",
    "DraftBlockLogits",
    "DraftKVCache",
    "DraftStep",
    "MarkovHead",
    "MarkovStep",
    "block_attention_mask",
]
