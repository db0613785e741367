"""The RL loop on the fast path: rollouts on the Pallas kernels record what the XLA path records,
and the trainer trains on the rollout's own guidance while the store's copy is checked behind it."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests.rl.rollouts import loop_config_dict
from trace_jax import fp4
from trace_jax.guidance import GuidanceCorruptError, GuidanceIOError, GuidanceStore
from trace_jax.guidance.shards import span
from trace_jax.rl import guidance_io, workers
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.sharding import make_mesh
from trace_jax.rl.workers import RolloutWorker, Trainer, check_same_guidance, init_policy
from trace_jax.rollout import Rollout

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")


def _store_entry(worker: RolloutWorker, batch) -> dict[str, fp4.Guidance]:
    """The batch's guidance as its worker writes it to a store, read back (host arrays)."""
    with GuidanceStore.in_memory() as store:
        for write in worker.publish_guidance(store, batch):
            write.result()
        return store.read(worker.config.rl.run_id, batch.step, expected_version=0)


def test_pallas_rollout_worker_records_what_the_xla_one_does(monkeypatch):
    """One RolloutWorker step of the 1-block tiny model with `rl.rollout_implementation`
    "pallas" (interpret mode: fused quantize + capture, FP4 decode attention, FP4 expert matmul)
    and "xla", full guidance at every site, float32 compute. One block: the worker's wiring is
    what this checks (the sampler's own comparison, in `tests/rollout/test_sampler.py`, runs
    two), and a block less is about 40% less to compile.

    Identical: the tokens, and in the store every site's FP4 codes and block scales. To float32
    rounding: the kernels sum the expert matmuls and the decode attention in another order than
    XLA, which moves log-probs (measured 5e-7; bound 1e-5) and a row's amax, so its NVFP4 global
    scale (measured 8e-7 relative; bound 1e-5, about the float32 error bound of the 64-term
    sums, twice). A code flips only where a value lies within such a rounding of an FP4
    boundary (none here); a wiring error (another layer's weights, a lost scale) changes most
    codes. (In bfloat16 the paths differ more: `tests/rollout/test_sampler.py`.)"""
    cd = loop_config_dict(method="trace_full")
    cd.model.head_dim = 32  # the decode-attention kernel's smallest head
    cd.model.n_layers = 1
    base = ExperimentConfig.from_config_dict(cd)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, dtype=jnp.float32))
    model = init_policy(base, None)
    sampled_with, real_generate = [], workers.generate

    def generate(*args, **kw):  # the implementation the worker asks the sampler for
        sampled_with.append(kw["implementation"])
        return real_generate(*args, **kw)

    monkeypatch.setattr(workers, "generate", generate)
    batches, entries = {}, {}
    for implementation in ("xla", "pallas"):
        rl = dataclasses.replace(base.rl, rollout_implementation=implementation)
        config = dataclasses.replace(base, rl=rl)
        worker = RolloutWorker(config, model, config.method_setup())
        assert worker.implementation == implementation
        batch = worker.rollout(0, 0)
        batches[implementation] = batch.rollout
        entries[implementation] = _store_entry(worker, batch)
    assert sampled_with == ["xla", "pallas"]
    a, b = batches["xla"], batches["pallas"]
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
    np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), rtol=0, atol=1e-5)
    ga, gb = entries["xla"], entries["pallas"]
    assert sorted(ga) == sorted(gb) == sorted(base.method_setup().capture)
    for site in ga:
        assert ga[site].mode is gb[site].mode is fp4.GuidanceMode.FULL
        np.testing.assert_array_equal(ga[site].payload, gb[site].payload, err_msg=site)  # codes
        np.testing.assert_array_equal(
            ga[site].scales.view(np.uint8), gb[site].scales.view(np.uint8), err_msg=site
        )
        np.testing.assert_allclose(
            ga[site].global_scale, gb[site].global_scale, rtol=1e-5, err_msg=site
        )


def test_check_same_guidance_compares_every_leaf_byte():
    x = np.random.default_rng(0).normal(size=(2, 3, 32)).astype(np.float32)
    own = {"1/k": fp4.make_guidance(fp4.quantize(jnp.asarray(x), "nvfp4"), "compact")}
    host = {k: jax.tree.map(np.asarray, g) for k, g in own.items()}  # as a store read gives
    check_same_guidance(host, own, "entry")
    g = host["1/k"]
    flipped = g.payload.copy()
    flipped[1, 2, 0] ^= 1
    scales = g.scales.view(np.uint8).copy()  # 12 bytes: compared as one 8-byte word and 4 bytes
    assert scales.size % 8
    scales.reshape(-1)[-1] ^= 1
    for bad, message in [
        ({"1/k": dataclasses.replace(g, payload=flipped)}, "'1/k' payload differs"),
        ({"1/k": dataclasses.replace(g, scales=scales.view(g.scales.dtype))}, "'1/k' scales"),
        ({"1/k": dataclasses.replace(g, global_scale=g.global_scale * 2)}, "global_scale"),
        ({"1/v": g}, r"holds sites \['1/v'\], expected \['1/k'\]"),
        (None, "round-to-nearest fallback"),
    ]:
        with pytest.raises(GuidanceCorruptError, match=message):
            check_same_guidance(bad, own, "entry")


def test_split_rollout_splits_each_parts_guidance_by_rows():
    """On a 2-device mesh a rollout whose guidance the sampler left replicated splits into
    mini-batches whose guidance rows lie split over the devices like the batch (what each
    process writes to the store and reads back), the values those of the rows taken."""
    mesh = make_mesh(data=2)
    rows, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 4, 32)).astype(np.float32)
    guidance = fp4.make_guidance(fp4.quantize(jnp.asarray(x), "nvfp4"), "compact")
    roll = Rollout(
        tokens=jax.device_put(np.arange(32, dtype=np.int32).reshape(8, 4), rows),
        prompt_lengths=jax.device_put(np.ones(8, np.int32), rows),
        lengths=jax.device_put(np.full(8, 4, np.int32), rows),
        logprobs=jax.device_put(np.zeros((8, 4), np.float32), rows),
        response_mask=jax.device_put(np.ones((8, 4), bool), rows),
        expert_choices=jax.device_put(np.zeros((2, 8, 4, 2), np.int32), replicated),
        guidance={"1/expert_in": jax.device_put(guidance, replicated)},
    )
    for m, part in enumerate(workers.split_rollout(roll, 2)):
        g = part.guidance["1/expert_in"]
        for leaf in ("payload", "scales"):
            a = getattr(g, leaf)
            assert a.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), a.ndim), leaf
            np.testing.assert_array_equal(a, np.asarray(getattr(guidance, leaf))[4 * m : 4 * m + 4])


def test_guidance_check_compares_rows_however_each_copy_is_placed():
    """The check compares each part read on this process with the overlapping parts of the
    guidance trained on, whichever way each is split (rows or replicated): equal bytes pass, a
    flipped byte in any part is found, and rows the trained-on copy does not hold here are an
    error, not a pass."""
    mesh = make_mesh(data=4)
    x = np.random.default_rng(2).integers(0, 256, size=(8, 12), dtype=np.uint8)

    def parts(spec):
        a = jax.device_put(x, NamedSharding(mesh, spec))
        return list({span(s.index, x.shape): s.data for s in a.addressable_shards}.items())

    by_rows, replicated, by_columns = parts(P("data")), parts(P()), parts(P(None, "data"))
    for own, read in [(replicated, by_rows), (by_rows, replicated), (by_columns, by_rows)]:
        assert guidance_io.differences_in_parts(own, read) is None
        for k in range(len(read)):  # one byte flipped in one part of the read copy
            where, data = read[k]
            bad = np.asarray(data).copy()
            bad.reshape(-1)[-1] ^= 1
            tampered = [*read[:k], (where, bad), *read[k + 1 :]]
            assert "1 bytes in" in guidance_io.differences_in_parts(own, tampered)
    half = [p for p in by_rows if p[0][0][0] < 4]  # own rows 0..3 here, rows 4..7 read here too
    assert "not checkable here" in guidance_io.differences_in_parts(half, by_rows)


def test_trainer_checks_the_store_behind_its_step_and_collects_in_the_background(monkeypatch):
    """The trainer trains on the batch's own guidance: a step whose committed entry differs
    from it fails once its update is done; consumed entries are deleted in the background
    during the next step (a deletion still running after the next update is waited for and
    timed), and a failed deletion is raised by the next `train` call."""
    config = ExperimentConfig.from_config_dict(loop_config_dict())  # the loop tests' steps
    setup = config.method_setup()
    model = init_policy(config, None)
    worker = RolloutWorker(config, model, setup)
    trainer = Trainer(config, model, setup)
    batch = worker.rollout(0, 0)
    run_id = config.rl.run_id
    with contextlib.ExitStack() as stack:
        stack.callback(trainer.close)
        clean, tampered, slow, failing = (
            stack.enter_context(GuidanceStore.in_memory()) for _ in range(4)
        )
        # A clean step: its entry is deleted by the time the next step returns or fails.
        metrics, blocked = trainer.train(batch, clean, worker.publish_guidance(clean, batch))
        assert np.isfinite(metrics["loss"]) and blocked["read"] > 0
        # The committed entry differs from the guidance trained on (one bit of one site).
        guidance = dict(batch.rollout.guidance)
        site = sorted(guidance)[-1]
        payload = np.asarray(guidance[site].payload).copy()
        payload[0, 0, 0] ^= 1
        guidance[site] = dataclasses.replace(guidance[site], payload=jnp.asarray(payload))
        tampered.write(run_id, 0, guidance, policy_version=0)
        with pytest.raises(GuidanceCorruptError, match=f"{site}' payload differs"):
            trainer.train(batch, tampered)
        assert clean.entries(run_id) == []
        # A deletion still running when the next update ends is waited for, and timed.
        deleted = threading.Event()

        def slow_gc(*args):
            deleted.wait(timeout=30)

        monkeypatch.setattr(slow, "gc", slow_gc)
        _, blocked = trainer.train(batch, slow, worker.publish_guidance(slow, batch))
        assert blocked["delete_wait"] < 1.0  # the failed step's deletion had ended
        threading.Timer(1.5, deleted.set).start()  # the next update takes far less
        _, blocked = trainer.train(batch, slow)  # its entries are still there
        assert blocked["delete_wait"] > 0.5
        # A failed deletion is raised by the next call.

        def gc(*args):
            raise GuidanceIOError("the disk is gone")

        monkeypatch.setattr(failing, "gc", gc)
        trainer.train(batch, failing, worker.publish_guidance(failing, batch))
        with pytest.raises(GuidanceIOError, match="the disk is gone"):
            trainer.train(batch, failing)
