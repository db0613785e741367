"""Rollout and trainer linked only by the exchange, here the workdir (policy versions, rollout
batches, the guidance store), reproduce the single-process loop; a lagging rollout trains stale
guidance within max_staleness. The two sides run as two threads here: they share nothing but
the exchange, as two processes would (`experiments/disaggregated.py` starts them as processes).
Each watches the other's heartbeat and gives up waiting as soon as it is stale or says it
exited; a workdir where a role ran is refused up front. `test_disaggregated_s3.py` runs the
pair over S3 against the same single-process reference (`single_process_history`)."""

from __future__ import annotations

import concurrent.futures
import functools
import os
import tempfile
import threading
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.rl.rollouts import loop_config_dict
from trace_jax import fp4
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig
from trace_jax.rl import disaggregated, policy_bundles, workers
from trace_jax.rl.disaggregated import (
    Heartbeat,
    PartnerGoneError,
    PartnerWatch,
    WorkdirReusedError,
    load_rollout,
    read_heartbeat,
    refuse_reused_workdir,
    run_rollout,
    run_trainer,
    save_rollout,
    wait_for,
)
from trace_jax.rl.exchange import Exchange, ExchangeExistsError
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.loop import RLLoop
from trace_jax.rl.policy_bundles import PolicyPrefetcher, policy_prefix, publish_policy
from trace_jax.rl.workers import RolloutBatch, RolloutWorker, init_policy

# One pytest-xdist worker runs the tests that compare with the single-process reference.
REFERENCE_GROUP = pytest.mark.xdist_group("disaggregated_reference")


def config_dict(lag: int = 0, **rl):
    """`loop_config_dict`'s runs (the loop tests' shapes) without evaluation, the rollout
    process at most `lag` steps ahead."""
    cd = loop_config_dict(**{"eval_every": 0, **rl})
    cd.disaggregated.update(lag=lag, timeout_s=120.0)
    return cd


def _config(lag: int = 0, **rl) -> ExperimentConfig:
    return ExperimentConfig.from_config_dict(config_dict(lag, **rl))


@functools.cache
def single_process_history() -> tuple[dict, ...]:
    """`RLLoop`'s metric rows on `_config()`: what a lag-0 pair must reproduce (computed once
    per test process)."""
    with tempfile.TemporaryDirectory() as workdir:
        return tuple(RLLoop(_config(), workdir).run())


def assert_reproduces_single_process(trainer: list[dict], rollout: list[dict]) -> None:
    assert [r["step"] for r in trainer] == [0, 1, 2]
    assert [r["policy_version"] for r in rollout] == [0, 1, 2]
    for a, b in zip(single_process_history(), trainer, strict=True):
        for k in ("reward", "loss", "grad_norm", "train_rollout_gap_mean", "response_length"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-6, err_msg=k)
        assert b["guidance_rtn_fallback_rows"] == 0 and b["max_staleness_used"] == 0


def run_pair(
    config: ExperimentConfig, trainer_workdir: str, rollout_workdir: str | None = None
) -> tuple[list[dict], list[dict]]:
    """(trainer rows, rollout rows) of the two sides run as two threads."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        trainer = pool.submit(run_trainer, config, trainer_workdir)
        rollout = pool.submit(run_rollout, config, rollout_workdir or trainer_workdir)
        concurrent.futures.wait([trainer, rollout], return_when="FIRST_EXCEPTION")
        return trainer.result(), rollout.result()


@REFERENCE_GROUP
def test_two_sides_reproduce_the_single_process_loop(tmp_path):
    trainer, rollout = run_pair(_config(), str(tmp_path / "dis"))
    assert_reproduces_single_process(trainer, rollout)
    # Every rollout batch was consumed and every guidance entry garbage-collected; the newest
    # lag + 2 policy versions are kept.
    assert not os.listdir(tmp_path / "dis" / "rollouts")
    assert sorted(os.listdir(tmp_path / "dis" / "policy")) == ["2", "3"]
    store_config = GuidanceStoreConfig(kvstore=str(tmp_path / "dis" / "guidance"))
    with GuidanceStore(store_config) as store:
        assert store.entries(_config().rl.run_id) == []
    exchange = Exchange.at(str(tmp_path / "dis"))
    for role in ("trainer", "rollout"):
        beat = read_heartbeat(exchange, role)
        assert (beat["role"], beat["step"], beat["exit"]) == (role, 2, "finished")
        # A rerun is refused before any work (nothing here resumes).
        runner = run_trainer if role == "trainer" else run_rollout
        with pytest.raises(WorkdirReusedError, match=rf"earlier {role} run.*step 2, finished"):
            runner(_config(), str(tmp_path / "dis"))


def test_lagging_rollout_trains_stale_guidance(tmp_path):
    trainer, rollout = run_pair(_config(lag=1), str(tmp_path / "lag"))
    assert [r["policy_version"] for r in rollout] == [0, 0, 1]
    assert [r["rollout_policy_version"] for r in trainer] == [0, 0, 1]
    assert [r["max_staleness_used"] for r in trainer] == [0, 1, 1]
    assert all(r["guidance_rtn_fallback_rows"] == 0 for r in trainer)
    assert all(np.isfinite(r["loss"]) for r in trainer)
    # A trainer step's wall time holds its wait for the batch and its training.
    assert all(
        r["time_step_s"] >= r["time_wait_rollout_s"] + r["time_train_s"] > 0 for r in trainer
    )


def test_policy_publisher_writes_each_version_as_submitted_behind_the_trainer(
    tmp_path, monkeypatch
):
    """`submit` returns while its version is written; the version holds the parameters at
    submission, also when the next update donates them at once; versions commit in order,
    each `submit` waiting for the previous write; the bundles to delete go after the version;
    a failed write is raised by the next `submit`, and `close` leaves nothing in flight."""
    config = _config()
    model = init_policy(config, None)
    exchange = Exchange.at(str(tmp_path))
    release, real_publish = threading.Event(), policy_bundles.publish_params

    def held_publish(exchange, params, version):  # before the device -> host copy
        assert release.wait(60)
        if version == 3:
            raise OSError("disk full")
        real_publish(exchange, params, version)

    monkeypatch.setattr(policy_bundles, "publish_params", held_publish)
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(params)  # the arrays themselves (the state follows the model)
    # Host copies of copies: a host copy of `params` itself would be cached on them.
    submitted = jax.device_get(jax.tree.map(jnp.copy, leaves))
    donating_update = jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)

    def assert_version(version, offset):
        got = policy_bundles.load_policy(exchange, version, nnx.state(model, nnx.Param))
        for a, b in zip(jax.tree.leaves(got), submitted, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b + offset)

    with policy_bundles.PolicyPublisher(exchange) as publisher:
        assert publisher.submit(model, 1) < 5  # its write waits for `release`
        nnx.update(model, donating_update(params))  # the next step's update
        assert all(x.is_deleted() for x in leaves)  # donated
        assert not exchange.committed(policy_prefix(1))
        release.set()
        publisher.submit(model, 2)
        assert_version(1, 0)  # committed before version 2 started, as submitted
        publisher.submit(model, 3)
        with pytest.raises(OSError, match="disk full"):
            publisher.submit(model, 4)
        assert not exchange.committed(policy_prefix(3))
        publisher.submit(model, 5, delete=(policy_prefix(1),))
    assert_version(2, 1)
    assert_version(5, 1)
    assert not exchange.committed(policy_prefix(1))


def test_policy_prefetcher_reads_the_next_version_ahead_and_stops_when_closed(
    tmp_path, monkeypatch
):
    """`prefetch` waits for and reads a version in the background; `take` returns it placed as
    the model's parameters, waiting for a version published later, and raises what failed in
    the background (a bundle of other parameters); `close` stops a prefetch that waits for a
    version never published at once, not after the wait's time limit."""
    config = _config()
    model = init_policy(config, None)
    exchange = Exchange.at(str(tmp_path))
    params = nnx.state(model, nnx.Param)
    expected = jax.device_get(jax.tree.map(jnp.copy, jax.tree.leaves(params)))

    waiting = threading.Event()  # the prefetcher waits for a version not yet published

    def wait(key, what, stop):
        if not exchange.exists(key):
            waiting.set()
        wait_for(exchange, key, what, timeout_s=60.0, stop=stop)

    def assert_params(state, offset=0.0):
        for a, b in zip(jax.tree.leaves(state), expected, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b + offset)

    read, real_read = threading.Event(), policy_bundles.read_policy

    def read_policy(*args):
        host = real_read(*args)
        read.set()
        return host

    monkeypatch.setattr(policy_bundles, "read_policy", read_policy)
    publish_policy(exchange, model, 0)
    with PolicyPrefetcher(exchange, params, wait) as policies:
        policies.prefetch(0)
        assert read.wait(60)
        exchange.delete(policy_prefix(0))  # read ahead: `take` reads nothing more
        assert_params(policies.take(0))
        policies.prefetch(2)  # published only later, by another thread
        nnx.update(model, jax.tree.map(lambda x: x + 1, params))
        later = threading.Timer(0.3, publish_policy, (exchange, model, 2))
        later.start()
        assert_params(policies.take(2), 1.0)
        later.join()
        exchange.write_arrays(policy_prefix(3), {"w": np.zeros(3, np.float32)}, {"version": 3})
        policies.prefetch(3)
        with pytest.raises(ValueError, match="other parameters than this model"):
            policies.take(3)
        waiting.clear()
        policies.prefetch(4)  # never published
        assert waiting.wait(60)
        t0 = time.perf_counter()
    assert time.perf_counter() - t0 < 10


def test_rollout_batches_round_trip(tmp_path):
    config = _config()
    worker = RolloutWorker(config, init_policy(config, None), config.method_setup())
    batch = worker.rollout(1, policy_version=7)
    exchange = Exchange.at(str(tmp_path))
    save_rollout(exchange, batch)
    back = load_rollout(exchange, 1)
    assert (back.step, back.policy_version) == (1, 7)
    assert back.rollout.guidance == {} and back.reference is None
    for k in ("tokens", "prompt_lengths", "lengths", "logprobs", "response_mask", "expert_choices"):
        got, sent = getattr(back.rollout, k), getattr(batch.rollout, k)
        assert got.dtype == sent.dtype, k
        np.testing.assert_array_equal(np.asarray(got), np.asarray(sent))
    (data,) = [p for p in os.listdir(tmp_path / "rollouts" / "1") if p != "manifest.json"]
    assert len(os.listdir(tmp_path / "rollouts" / "1" / data)) == 6  # one object per array
    with pytest.raises(ExchangeExistsError, match=r"rollouts/1/ holds a committed bundle"):
        save_rollout(exchange, batch)
    exchange.delete("rollouts/1/")
    assert not os.listdir(tmp_path / "rollouts")


def test_rollout_batch_is_published_after_its_guidance_commits(tmp_path, monkeypatch):
    config = _config(mini_batches=2)
    site = {
        "0/k": fp4.make_guidance(
            fp4.quantize(jax.random.normal(jax.random.key(0), (2, 32)), "nvfp4")
        )
    }
    sides = types.SimpleNamespace(config=config, setup=types.SimpleNamespace(capture=("0/k",)))
    worker = types.SimpleNamespace(
        publish_guidance=functools.partial(RolloutWorker.publish_guidance, sides)
    )
    roll = types.SimpleNamespace(
        tokens=np.zeros((4, 3)), rows=lambda rows: types.SimpleNamespace(guidance=site)
    )
    store = GuidanceStore.in_memory()
    commit = store.writer.commit

    def slow_commit(*a):  # commits well after write_async returned
        time.sleep(0.3)
        return commit(*a)

    monkeypatch.setattr(store.writer, "commit", slow_commit)
    # The stand-in rollout is no pytree: split it without the jitted dispatch.
    monkeypatch.setattr(
        workers,
        "split_rollout",
        lambda r, parts: [r.rows(s) for s in workers.mini_batch_slices(r.tokens.shape[0], parts)],
    )
    published = []
    monkeypatch.setattr(
        disaggregated,
        "save_rollout",
        lambda exchange, b: published.append((b.step, store.entries(config.rl.run_id))),
    )
    with store:
        disaggregated.publish_rollout(store, worker, RolloutBatch(5, 10, roll), exchange=None)
    assert published == [(5, [(5, 0), (5, 1)])]  # both entries committed before the batch


def test_wait_for_gives_up_soon_after_the_partner_heartbeat_stops(tmp_path):
    """A trainer that beat once (a process killed after that) is reported gone after the
    heartbeat timeout, not after wait_for's own timeout."""
    exchange = Exchange.at(str(tmp_path))
    beat = Heartbeat(exchange, "trainer")
    beat.step = 3
    beat.write()  # no beating thread: it stops here
    watch = PartnerWatch(exchange, "trainer", timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(PartnerGoneError) as info:
        wait_for(exchange, "policy/1/manifest.json", "policy version 1", 60.0, partner=watch)
    assert 0.4 < time.monotonic() - t0 < 5
    message = str(info.value)
    assert f"the trainer (pid {os.getpid()}" in message and "last seen at step 3" in message
    assert "has not changed for" in message and "policy version 1" in message


def test_a_beating_partner_is_waited_for_and_its_failure_reported_at_once(tmp_path):
    exchange = Exchange.at(str(tmp_path))
    target = "rollouts/0/manifest.json"
    # The beat comes 40x more often than the timeout: a busy 2-core machine may stall the
    # beating thread for a fraction of a second, never for the whole timeout.
    watch = PartnerWatch(exchange, "rollout", timeout_s=2.0)
    with pytest.raises(RuntimeError, match="boom"), Heartbeat(exchange, "rollout", 0.05) as b:
        b.step = 4
        # Alive for longer than the heartbeat timeout: wait_for keeps waiting for its object.
        threading.Timer(3.0, lambda: exchange.write_json(target, {})).start()
        wait_for(exchange, target, "rollout batch", 60.0, partner=watch)
        raise RuntimeError("boom")
    t0 = time.monotonic()
    gone = r"the rollout .* failed at step 4, .*RuntimeError: boom"
    with pytest.raises(PartnerGoneError, match=gone):
        wait_for(exchange, "rollouts/1/manifest.json", "rollout batch", 60.0, partner=watch)
    assert time.monotonic() - t0 < watch.timeout_s  # the exit marker, not the timeout


def test_reused_workdir_is_refused_per_role(tmp_path):
    refuse_reused_workdir(str(tmp_path))  # a fresh workdir
    (tmp_path / "rollout_log.jsonl").write_text("")
    refuse_reused_workdir(str(tmp_path), ("trainer",))
    with pytest.raises(WorkdirReusedError, match=r"earlier rollout run .*rollout_log\.jsonl"):
        refuse_reused_workdir(str(tmp_path))


@pytest.mark.parametrize(
    ("exchange", "endpoint", "message"),
    [
        ("ftp://host/x/", "", r"disaggregated\.exchange.*the scheme must be one of"),
        ("s3://Bad_Bucket/x/", "", r"disaggregated\.exchange.*not a valid s3:// bucket"),
        ("", "http://127.0.0.1:9000", r"exchange_s3_endpoint.*apply to an 's3://' exchange"),
        ("s3://bucket/x/", "ftp://host", r"exchange_s3_endpoint.*'http\(s\)://host\[:port\]'"),
    ],
)
def test_bad_exchange_settings_are_refused_when_the_config_is_built(exchange, endpoint, message):
    cd = config_dict()
    cd.disaggregated.update(exchange=exchange, exchange_s3_endpoint=endpoint)
    with pytest.raises(ValueError, match=message):
        ExperimentConfig.from_config_dict(cd)
