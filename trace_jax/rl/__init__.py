"""RL of FP4 policies: GRPO advantages, policy losses (PPO-clip + truncated IS, TBPO), gap
metrics, the `GRPOConfig` and its optimizer, the registry of compared methods, and the pipeline
as objects: `ExperimentConfig`, `RLLoop` (rollout worker + trainer), `run_sft`."""

from trace_jax.rl.advantages import ADVANTAGES, get_advantage_fn, grpo_advantages
from trace_jax.rl.config import GRPOConfig, make_optimizer, make_schedule
from trace_jax.rl.evaluate import EvalSuite, pass_at_1_by_split
from trace_jax.rl.experiment import (
    DisaggregatedConfig,
    EvalConfig,
    ExperimentConfig,
    MeshConfig,
    ModelSpec,
    RLConfig,
    SFTConfig,
    TaskConfig,
    experiment_config_dict,
)
from trace_jax.rl.loop import RLLoop, RolloutBatch, step_problems
from trace_jax.rl.losses import (
    AGGREGATIONS,
    LOSSES,
    aggregate,
    get_loss_fn,
    kl_k3,
    logprob_gap_metrics,
    masked_mean,
    ppo_clip_loss,
    tbpo_loss,
    truncated_is_weight,
)
from trace_jax.rl.methods import (
    METHODS,
    Method,
    MethodSetup,
    bind_loss,
    get_method,
    register_method,
)
from trace_jax.rl.sft import run_sft, sft_or_reuse
from trace_jax.rl.workdir import WorkdirConfigError, guard_workdir, move_aside
from trace_jax.rl.workers import RolloutWorker, Trainer

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "LOSSES",
    "METHODS",
    "DisaggregatedConfig",
    "EvalConfig",
    "EvalSuite",
    "ExperimentConfig",
    "GRPOConfig",
    "MeshConfig",
    "Method",
    "MethodSetup",
    "ModelSpec",
    "RLConfig",
    "RLLoop",
    "RolloutBatch",
    "RolloutWorker",
    "SFTConfig",
    "TaskConfig",
    "Trainer",
    "WorkdirConfigError",
    "aggregate",
    "bind_loss",
    "experiment_config_dict",
    "get_advantage_fn",
    "get_loss_fn",
    "get_method",
    "grpo_advantages",
    "guard_workdir",
    "kl_k3",
    "logprob_gap_metrics",
    "make_optimizer",
    "make_schedule",
    "masked_mean",
    "move_aside",
    "pass_at_1_by_split",
    "ppo_clip_loss",
    "register_method",
    "run_sft",
    "sft_or_reuse",
    "step_problems",
    "tbpo_loss",
    "truncated_is_weight",
]
