"""`rollout_memory`: the compiled rollout's buffers, and what chunked prefill saves."""

from __future__ import annotations

import jax.numpy as jnp

from tests import tiny
from trace_jax.quant import QuantConfig, SiteMode
from trace_jax.rollout import SamplingConfig, rollout_memory


def test_prefill_chunks_bound_the_rollouts_temporaries():
    """A bf16 rollout of 8 prompts of 256 tokens, compiled (nothing runs): prefilled in one piece
    its temporaries hold every prompt token's activations and expert buffers at once; in chunks
    of one prompt they hold one prompt's, while parameters and outputs stay the same."""
    cfg = tiny.model_config(n_layers=1, dtype=jnp.float32)
    batch, prompt_len = 8, 256

    def memory(chunk_tokens):
        sampling = SamplingConfig(max_new_tokens=2, prefill_chunk_tokens=chunk_tokens)
        return rollout_memory(
            cfg,
            batch=batch,
            prompt_len=prompt_len,
            sampling=sampling,
            qcfg=QuantConfig.nvfp4(),
            mode=SiteMode.OFF,
        )

    whole, chunked = memory(batch * prompt_len), memory(prompt_len)
    assert set(whole) == {"argument", "output", "temp", "alias", "peak", "total"}
    assert whole["argument"] == chunked["argument"] > 0
    assert whole["output"] == chunked["output"] > 0
    assert whole["total"] == whole["argument"] + whole["output"] + whole["temp"] - whole["alias"]
    # One prompt's per-token buffers instead of 8 prompts' (attention scores, expert rows):
    # measured 0.12 of the one-piece temporaries.
    assert chunked["temp"] < 0.4 * whole["temp"], (chunked["temp"], whole["temp"])
