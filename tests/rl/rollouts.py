"""Small RL runs for the tests: a task rollout for the step tests (problems -> prompts x group
-> `generate`) and the config the loop tests share."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from tests import tiny
from trace_jax import tasks
from trace_jax.rl.methods import MethodSetup
from trace_jax.rollout import Rollout, SamplingConfig, generate

# The blocks of the RL loop tests' runs (and of the fault probes' and the trained table's, which
# share their compiled steps): the loop's resume, store, mesh and evaluation paths treat every
# block alike, and a block less is about 40% less to compile. (TRACE guides the deeper half of
# the blocks: the one block here.)
LOOP_LAYERS = 1


def loop_config_dict(**rl) -> ml_collections.ConfigDict:
    """The RL loop tests' runs, `rl` overriding: 3 steps of 2 prompts x 2 samples of 8 new tokens
    on the `LOOP_LAYERS`-block tiny model. The single-process and the disaggregated loop tests
    share these shapes, and so their compiled steps."""
    cd = tiny.experiment_config()
    cd.model.n_layers = LOOP_LAYERS
    cd.rl.update(
        steps=3,
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=8,
        learning_rate=1e-2,
        mismatch_every=0,  # on in its own test (each mismatch step compiles a forward)
    )
    cd.rl.update(rl)
    return cd


def task_rollout(
    model,
    setup: MethodSetup,
    *,
    n_problems: int,
    group_size: int,
    capture=None,
    capture_mode=None,
    seed: int = 2,
) -> Rollout:
    """Rolls out `n_problems` level-1 training problems `group_size` times with `setup`;
    `capture` / `capture_mode` replace the method's (None: its own), `seed` the sampling key's."""
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
        jax.random.key(seed),
        sampling=sampling,
        qcfg=setup.rollout_qcfg,
        mode=setup.rollout_mode,
        capture=setup.capture if capture is None else capture,
        capture_mode=setup.capture_mode if capture_mode is None else capture_mode,
        residual_fraction=setup.rollout_residual_channels,
    )
