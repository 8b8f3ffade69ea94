"""Training: the trainer and its grouped settings, optimizers, checkpointing and the train step.

The gin names of what a run binds resolve here: ``terra.training.Trainer``,
``terra.training.CheckpointSettings``, ``terra.training.adafactor``, ...
"""

from terra.training.checkpointing import Checkpointer, load_params
from terra.training.optimizers import (
    OptimizerSpec,
    adafactor,
    adamw,
    build_optimizer,
    constant_schedule,
    rsqrt_schedule,
    sgd,
    warmup_cosine_schedule,
)
from terra.training.settings import (
    CheckpointSettings,
    EvaluationHook,
    EvaluationSettings,
    LoggingSettings,
    ParallelSettings,
    StepHook,
)
from terra.training.trainer import Trainer, TrainingDiverged, TrainResult

__all__ = [
    "CheckpointSettings",
    "Checkpointer",
    "EvaluationHook",
    "EvaluationSettings",
    "LoggingSettings",
    "OptimizerSpec",
    "ParallelSettings",
    "StepHook",
    "TrainResult",
    "Trainer",
    "TrainingDiverged",
    "adafactor",
    "adamw",
    "build_optimizer",
    "constant_schedule",
    "load_params",
    "rsqrt_schedule",
    "sgd",
    "warmup_cosine_schedule",
]
