"""Training DSpark heads for any Transformers causal LM, on one machine or several (layer 5).

* :mod:`~spark_generate.training.data`: tokenized documents (JSONL), padded batches, batch order;
* :mod:`~spark_generate.training.anchors`: anchors, block inputs, labels and prefix masks;
* :mod:`~spark_generate.training.losses`: the DSpark objective;
* :mod:`~spark_generate.training.metrics`: teacher-forced acceptance, tau, greedy accuracy;
* :mod:`~spark_generate.training.feature_cache`: the target's states on disk, built once, read every epoch;
* :mod:`~spark_generate.training.trainer`: the :class:`Trainer` (Accelerate, checkpoints, resume);
* :mod:`~spark_generate.training.provenance`: what a checkpoint was trained from;
* :mod:`~spark_generate.training.prompt_synthesis`: training prompts without a dataset (Magpie,
  reasoning-gym, the standard library), filtered, deduplicated and kept apart from the evaluation;
* :mod:`~spark_generate.training.regenerate`: on-policy data, the target answering prompts;
* :mod:`~spark_generate.training.evaluation`: teacher-forced and online metrics;
* :mod:`~spark_generate.training.calibration`: STS temperatures for the confidence head.

The last four are imported on their own (evaluation and calibration load the generation stack,
prompt synthesis imports reasoning-gym and the standard library on demand).
"""

from spark_generate.training.anchors import AnchorBatch, BlockTargets, block_targets, sample_anchors
from spark_generate.training.data import TokenBatch, TokenDataset, draft_vocab_from_data, read_jsonl, write_jsonl
from spark_generate.training.feature_cache import (
    CacheBuildResult,
    FeatureCache,
    FeatureCacheError,
    TargetStates,
    build_feature_cache,
    cache_bytes,
)
from spark_generate.training.losses import LossTerms, LossWeights, dspark_loss, position_weights
from spark_generate.training.metrics import TeacherForcedMetrics, teacher_forced_metrics
from spark_generate.training.trainer import Trainer, TrainingConfig, TrainResult, teacher_forced_step

__all__ = [
    "AnchorBatch",
    "BlockTargets",
    "CacheBuildResult",
    "FeatureCache",
    "FeatureCacheError",
    "LossTerms",
    "LossWeights",
    "TargetStates",
    "TeacherForcedMetrics",
    "TokenBatch",
    "TokenDataset",
    "TrainResult",
    "Trainer",
    "TrainingConfig",
    "block_targets",
    "build_feature_cache",
    "cache_bytes",
    "draft_vocab_from_data",
    "dspark_loss",
    "position_weights",
    "read_jsonl",
    "sample_anchors",
    "teacher_forced_metrics",
    "teacher_forced_step",
    "write_jsonl",
]
