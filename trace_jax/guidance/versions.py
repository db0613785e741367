"""The policy-version handshake between trainer and rollout, and the staleness rule.

The trainer publishes the policy version it is at (`PolicyVersions.publish`, never backwards); the
rollout waits for a recent enough one (`wait_for`) and records it in each entry it writes; the
reader accepts an entry only if its version is in `[expected - max_staleness, expected]`
(`check_staleness`): older guidance describes a policy the trainer has moved past, newer guidance
one it has not reached.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from trace_jax.guidance import layout
from trace_jax.guidance.errors import GuidanceCorruptError, GuidanceIOError, GuidanceVersionError
from trace_jax.guidance.kvstore import Kv, kv_call
from trace_jax.guidance.layout import EntryKey

# Attempts of `publish`'s read / conditional-write cycle before it gives up: each failed attempt
# means another publisher wrote in between, so this only runs out under pathological contention.
_PUBLISH_ATTEMPTS = 100


def check_version(name: str, version: int) -> int:
    """`version` as an int if it is a non-negative int, else raises ValueError naming `name`."""
    if isinstance(version, bool) or not isinstance(version, int | np.integer) or version < 0:
        raise ValueError(f"{name} must be a non-negative int, got {version!r}")
    return int(version)


def check_staleness(key: EntryKey, version: int, expected: int, max_staleness: int) -> None:
    """Raises `GuidanceVersionError` unless `expected - max_staleness <= version <= expected`."""
    if not expected - max_staleness <= version <= expected:
        window = f"{expected}" if max_staleness == 0 else f"{expected - max_staleness}..{expected}"
        raise GuidanceVersionError(
            f"{key} was sampled with policy version {version}, but the trainer expects "
            f"{window} (max_staleness={max_staleness})"
        )


class PolicyVersions:
    """The published policy version of each run (`<run>/policy_version.json`). Thread-safe."""

    def __init__(self, kv: Kv, *, poll_s: float):
        self._kv = kv.store
        self._poll_s = poll_s

    def publish(self, run: str, version: int) -> None:
        """Trainer: records that run `run` is now at policy `version` (never moves backwards)."""
        key = layout.version_key(run)
        version = check_version("version", version)
        for _ in range(_PUBLISH_ATTEMPTS):
            current = kv_call(self._kv.read(key), key)
            if current.state == "value":
                at = self._decode(run, current.value)
                if version < at:
                    raise ValueError(
                        f"run {run!r} is at policy version {at}; cannot publish older {version}"
                    )
            doc = {"version": version, "time": time.time(), "pid": os.getpid()}
            # Conditional on the generation just read, so a concurrent publish is never lost.
            done = kv_call(
                self._kv.write(key, json.dumps(doc).encode(), if_equal=current.stamp.generation),
                key,
            )
            if done.generation:
                return
        raise GuidanceIOError(f"could not publish policy version {version} of run {run!r}")

    def published(self, run: str) -> int | None:
        """The policy version the trainer published for `run` (None before the first)."""
        key = layout.version_key(run)
        got = kv_call(self._kv.read(key), key)
        return self._decode(run, got.value) if got.state == "value" else None

    def wait_for(self, run: str, at_least: int, *, timeout_s: float) -> int:
        """Rollout: waits until the published version is >= `at_least`; returns it.

        Raises:
          TimeoutError: naming the run, the version waited for and the last one seen.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            version = self.published(run)
            if version is not None and version >= at_least:
                return version
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"run {run!r}: policy version {at_least} not published within {timeout_s:g} s "
                    f"(latest: {version})"
                )
            time.sleep(self._poll_s)

    @staticmethod
    def _decode(run: str, raw: bytes) -> int:
        try:
            return check_version("version", json.loads(raw)["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise GuidanceCorruptError(
                f"run {run!r}: {layout.version_key(run)!r} is not a valid version record ({e})"
            ) from None
