"""Per-device bytes of the trainer's state on abstract meshes, against hand counts from the
parameter shapes (no array is allocated)."""

from __future__ import annotations

import optax
import pytest

from tests import tiny
from trace_jax.models import ModelConfig
from trace_jax.rl.memory_fit import (
    GB,
    abstract_train_state,
    memory_fit_rows,
    train_state_bytes,
)
from trace_jax.rl.sharding import abstract_mesh

# AdamW's count, its schedule's count (int32) and nnx.Optimizer's step (uint32): 4 bytes each,
# on every device.
COUNTER_BYTES = 3 * 4


def hand_param_bytes(cfg: ModelConfig, fsdp: int, expert: int, itemsize: int = 4) -> int:
    """Bytes of one device's parameters, counted from `cfg`'s shapes with the placement written
    out: matrices split by fsdp (every dimension of these configs that fsdp must split divides),
    routed experts also by expert, vectors whole."""
    v, d, h, kv, dh = cfg.vocab_size, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    e, f, n = cfg.n_experts, cfg.d_ff_expert, cfg.n_layers
    matrices = 2 * v * d + n * (d * h * dh + 2 * d * kv * dh + h * dh * d + d * e)
    experts = n * 3 * e * f * d
    vectors = d + n * (2 * d + 2 * dh)  # final, attention and MLP norms; q and k norms
    elements = matrices // fsdp + experts // (fsdp * expert) + vectors
    return elements * itemsize


@pytest.fixture(scope="module")
def tiny_state():
    return abstract_train_state(tiny.model_config())


@pytest.mark.parametrize("data,fsdp,expert", [(1, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_tiny_state_bytes_equal_a_hand_count(tiny_state, data, fsdp, expert):
    cfg = tiny.model_config()
    state = train_state_bytes(*tiny_state, abstract_mesh(data, expert, fsdp=fsdp))
    params = hand_param_bytes(cfg, fsdp, expert)
    assert state.params == params and state.gradients == params
    assert state.optimizer == 2 * params + COUNTER_BYTES  # mu and nu, like their parameters
    assert state.total == 4 * params + COUNTER_BYTES


def test_paper_preset_on_64_abstract_devices():
    """All 48 blocks of the paper-sized preset on 8 x 8 (fsdp, expert) devices that do not exist,
    for float32 and bfloat16 master copies; the fit columns follow from the state."""
    cfg = ModelConfig.qwen3_5_35b_a3b()
    rows = memory_fit_rows(
        cfg, [(1, 8, 8)], capacities_gb=(10.0, 141.0), param_dtypes=("float32", "bfloat16")
    )
    assert [r["param_dtype"] for r in rows] == ["float32", "bfloat16"]
    for row, itemsize in zip(rows, (4, 2), strict=True):
        params = hand_param_bytes(cfg, 8, 8, itemsize)
        assert (row["devices"], row["data"], row["fsdp"], row["expert"]) == (64, 1, 8, 8)
        assert row["params_GB"] * GB == pytest.approx(params, rel=1e-12)
        assert row["state_GB"] * GB == pytest.approx(4 * params + COUNTER_BYTES, rel=1e-12)
        for capacity in (10, 141):
            left = capacity - row["state_GB"]
            assert row[f"left_{capacity}GB"] == pytest.approx(left)
            assert row[f"fits_{capacity}GB"] == ("yes" if left >= 0 else "no")
    assert rows[0]["fits_10GB"] == "no" and rows[1]["fits_10GB"] == "yes"  # 10.3 and 5.2 GB


def test_other_optimizer_and_bad_mesh():
    """Plain SGD keeps no moments: the optimizer holds only the counters."""
    cfg = tiny.model_config()
    params, opt_state = abstract_train_state(cfg, optax.sgd(0.1))
    state = train_state_bytes(params, opt_state, abstract_mesh(2, 2, fsdp=2))
    assert state.params == hand_param_bytes(cfg, 2, 2) and state.optimizer == 4  # the step
    with pytest.raises(ValueError, match=r"\(data, fsdp, expert\) sizes, got \(2, 2\)"):
        memory_fit_rows(cfg, [(2, 2)])
