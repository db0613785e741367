"""Trainer side: the teacher-forced forward that consumes the rollout's guidance."""

from trace_jax.train.forward import TrainForward, train_forward

__all__ = ["TrainForward", "train_forward"]
