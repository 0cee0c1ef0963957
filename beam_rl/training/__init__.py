"""Deprecated: the reference trainer moved to `beam_rl.trainer` (reference.py, policy_loss.py,
checkpoint.py). This package keeps `beam_rl.training` and its modules importing for one release."""

import sys
import warnings

from beam_rl.rundir.checkpoint_shapes import CheckpointError, tensor_shapes, validate_checkpoint
from beam_rl.trainer import checkpoint, policy_loss
from beam_rl.trainer import reference as trainer
from beam_rl.trainer.checkpoint import publish_weights
from beam_rl.trainer.policy_loss import (
    PolicyLossStats,
    check_packed_attention,
    clipped_policy_loss,
    sampled_token_logprobs,
)
from beam_rl.trainer.reference import ReferenceTrainer, StepMetrics, run_trainer

warnings.warn("beam_rl.training is deprecated: import from beam_rl.trainer (reference, policy_loss, "
              "checkpoint) instead", DeprecationWarning, stacklevel=2)

# `import beam_rl.training.policy_loss` finds the moved module itself, not a copy.
for _name, _module in (("checkpoint", checkpoint), ("policy_loss", policy_loss), ("trainer", trainer)):
    sys.modules[f"{__name__}.{_name}"] = _module

__all__ = [
    "CheckpointError",
    "PolicyLossStats",
    "ReferenceTrainer",
    "StepMetrics",
    "check_packed_attention",
    "clipped_policy_loss",
    "publish_weights",
    "run_trainer",
    "sampled_token_logprobs",
    "tensor_shapes",
    "validate_checkpoint",
]
