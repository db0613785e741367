"""Rollout and trainer with no shared disk: each in its own workdir, linked only by an exchange on
a local S3-compatible server (`tests.s3_server`), reproduce the single-process loop at lag 0;
rollout batches damaged behind the exchange's back (boto3) are refused, naming the object."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.test_disaggregated import (
    REFERENCE_GROUP,
    assert_reproduces_single_process,
    config_dict,
    run_pair,
)
from trace_jax.guidance import GuidanceStore
from trace_jax.rl.disaggregated import (
    WorkdirReusedError,
    load_rollout,
    read_heartbeat,
    run_exchange,
    run_trainer,
    save_rollout,
)
from trace_jax.rl.exchange import ExchangeCorruptError
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.rl.workers import RolloutBatch
from trace_jax.rollout import Rollout


def _s3_config(server, prefix: str) -> ExperimentConfig:
    cd = config_dict()
    cd.disaggregated.update(
        exchange=f"s3://{server.bucket}/{prefix}",
        exchange_s3_endpoint=server.endpoint,
        exchange_s3_region="us-east-1",
        exchange_s3_credentials="environment",
    )
    return ExperimentConfig.from_config_dict(cd)


@REFERENCE_GROUP
def test_two_sides_over_s3_reproduce_the_single_process_loop(s3_server, tmp_path):
    config = _s3_config(s3_server, "pair/")
    trainer, rollout = run_pair(config, str(tmp_path / "trainer"), str(tmp_path / "rollout"))
    assert_reproduces_single_process(trainer, rollout)
    # Each workdir holds only its own logs and settings record: everything else went by S3.
    for role, log in (("trainer", "rl_metrics.jsonl"), ("rollout", "rollout_log.jsonl")):
        found = sorted(p.name for p in (tmp_path / role).iterdir())
        assert found == sorted(["rl_config.json", log, "tensorboard"])
    keys = s3_server.keys("pair/")
    assert not [k for k in keys if k.startswith("pair/rollouts/")]  # consumed, deleted
    assert sorted({k.split("/")[2] for k in keys if k.startswith("pair/policy/")}) == ["2", "3"]
    exchange = run_exchange(config, str(tmp_path / "trainer"))
    with GuidanceStore(exchange.sub_config("guidance/")) as store:
        assert store.entries(config.rl.run_id) == []
    for role in ("trainer", "rollout"):
        assert read_heartbeat(exchange, role)["exit"] == "finished"
    # The exchange remembers the run: a trainer in a fresh workdir is refused before any work.
    with pytest.raises(WorkdirReusedError, match=r"earlier trainer run left s3://.*pair/heart"):
        run_trainer(config, str(tmp_path / "fresh"))
    assert not (tmp_path / "fresh").exists()


def _object_key(server, prefix: str, array: str) -> str:
    """The object key of `array` of the bundle committed under `prefix`."""
    raw = server.client.get_object(Bucket=server.bucket, Key=f"{prefix}manifest.json")
    body = json.loads(raw["Body"].read())["body"]
    index = [a["name"] for a in body["arrays"]].index(array)
    return f"{prefix}{body['data']}{index}"


def test_damaged_rollout_objects_are_refused_naming_them(s3_server, tmp_path):
    exchange = run_exchange(_s3_config(s3_server, "damage/"), str(tmp_path))
    b, s, layers, k = 2, 5, 2, 2
    rng = np.random.default_rng(0)
    roll = Rollout(
        tokens=jnp.asarray(rng.integers(0, 50, (b, s)), jnp.int32),
        prompt_lengths=jnp.full((b,), 2, jnp.int32),
        lengths=jnp.full((b,), s, jnp.int32),
        logprobs=jnp.asarray(-rng.random((b, s)), jnp.float32),
        response_mask=jnp.asarray(rng.random((b, s)) < 0.5),
        expert_choices=jnp.asarray(rng.integers(0, 4, (layers, b, s, k)), jnp.int32),
        guidance={},
    )
    for step in range(3):
        save_rollout(exchange, RolloutBatch(step, 1, roll))
    back = load_rollout(exchange, 0)
    assert (back.step, back.policy_version) == (0, 1)
    np.testing.assert_array_equal(np.asarray(back.rollout.logprobs), np.asarray(roll.logprobs))

    client, bucket = s3_server.client, s3_server.bucket
    # 1. A byte of an array object flipped.
    key = _object_key(s3_server, "damage/rollouts/0/", "logprobs")
    raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    raw[5] ^= 0x10
    client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))
    # 2. An array object deleted.
    key1 = _object_key(s3_server, "damage/rollouts/1/", "expert_choices")
    client.delete_object(Bucket=bucket, Key=key1)
    # 3. The manifest edited.
    manifest = "damage/rollouts/2/manifest.json"
    doc = json.loads(client.get_object(Bucket=bucket, Key=manifest)["Body"].read())
    doc["body"]["meta"]["policy_version"] = 0
    client.put_object(Bucket=bucket, Key=manifest, Body=json.dumps(doc).encode())

    url = f"s3://{bucket}/damage/rollouts"
    expected = [
        rf"{url}/0/: array 'logprobs' \(s3://{bucket}/{key}\) fails its checksum",
        rf"{url}/1/: array 'expert_choices' \(s3://{bucket}/{key1}\) is missing",
        rf"{url}/2/manifest.json fails its checksum",
    ]
    for step, match in enumerate(expected):
        with pytest.raises(ExchangeCorruptError, match=match):
            load_rollout(exchange, step)
