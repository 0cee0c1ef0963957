"""The reference trainer that closes the RL loop: policy loss, training steps, weight publishing."""

from beam_rl.checkpoint_shapes import CheckpointError, tensor_shapes, validate_checkpoint
from beam_rl.training.checkpoint import publish_weights
from beam_rl.training.policy_loss import (
    PolicyLossStats,
    check_packed_attention,
    clipped_policy_loss,
    sampled_token_logprobs,
)
from beam_rl.training.trainer import ReferenceTrainer, StepMetrics, run_trainer

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
