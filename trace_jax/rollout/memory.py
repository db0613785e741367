"""What a rollout needs in device memory at given shapes, from the compiler, with nothing allocated.

`rollout_memory` lowers and compiles `generate` for abstract parameters and prompts on the default
backend (run it on the GPU to see the GPU compile's buffers) and returns XLA's memory analysis:
a rollout fits a device when its arguments (parameters), outputs and temporaries do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from trace_jax.fp4 import GuidanceMode
from trace_jax.models import ModelConfig, abstract_model
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rollout.sampler import generate
from trace_jax.rollout.sampling import SamplingConfig


def rollout_memory(
    cfg: ModelConfig,
    *,
    batch: int,
    prompt_len: int,
    sampling: SamplingConfig,
    qcfg: QuantConfig,
    mode: SiteMode = SiteMode.RTN,
    capture: tuple[str, ...] = (),
    capture_mode: GuidanceMode = GuidanceMode.COMPACT,
    implementation: str = "xla",
) -> dict[str, int]:
    """XLA's memory analysis of `generate` compiled for a `[batch, prompt_len]` prompt batch.

    The model is `abstract_model(cfg)` (parameters in `cfg.param_dtype`, never allocated); the
    other arguments are `generate`'s. Compiling the paper's shapes on a CPU takes minutes.

    Returns bytes: "argument" (parameters, prompts), "output" (the `Rollout`), "temp" (the
    compiled program's temporaries, the part chunked prefill bounds), "alias", "peak" (the
    backend's own peak figure; the CPU's counts arguments and outputs only) and "total" =
    argument + output + temp - alias, what the rollout needs on the device.
    """
    graphdef, params = nnx.split(abstract_model(cfg))
    prompts = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = jax.eval_shape(jax.random.key, 0)
    compiled = generate.lower(
        graphdef,
        params,
        prompts,
        lengths,
        key,
        sampling=sampling,
        qcfg=qcfg,
        mode=mode,
        capture=tuple(capture),
        capture_mode=capture_mode,
        implementation=implementation,
    ).compile()
    stats = compiled.memory_analysis()
    out = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "peak": int(getattr(stats, "peak_memory_in_bytes", 0) or 0),
    }
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return out
