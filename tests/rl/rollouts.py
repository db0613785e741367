"""A small task rollout for RL step tests: problems -> prompts x group -> `generate`."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax import tasks
from trace_jax.rl.methods import MethodSetup
from trace_jax.rollout import Rollout, SamplingConfig, generate


def task_rollout(model, setup: MethodSetup, *, n_problems: int, group_size: int) -> Rollout:
    """Rolls out `n_problems` level-1 training problems `group_size` times with `setup`."""
    problems = list(itertools.islice(tasks.train_stream(1, levels=(1,)), n_problems))
    prompts, lengths = tasks.encode_prompts([p for p in problems for _ in range(group_size)])
    graphdef, params = nnx.split(model)
    sampling = SamplingConfig(
        max_new_tokens=6, temperature=1.0, stop_tokens=(tasks.EOS_ID,), pad_id=tasks.PAD_ID
    )
    return generate(
        graphdef,
        params,
        jnp.asarray(prompts),
        jnp.asarray(lengths),
        jax.random.key(2),
        sampling=sampling,
        qcfg=setup.rollout_qcfg,
        mode=setup.rollout_mode,
        capture=setup.capture,
        capture_mode=setup.capture_mode,
        residual_fraction=setup.rollout_residual_channels,
    )
