"""The policy-version handshake and the staleness window a read accepts."""

from __future__ import annotations

import pytest

from tests.guidance.support import RUN, numpy_guidance
from trace_jax.guidance import EntryKey, GuidanceStore, GuidanceVersionError
from trace_jax.guidance.versions import check_staleness


def test_staleness_window_is_closed_on_both_sides():
    key = EntryKey(RUN, 0)
    for version in (4, 5, 6):
        check_staleness(key, version, expected=6, max_staleness=2)
    for version in (3, 7):  # too old, and sampled with a policy newer than the trainer's
        with pytest.raises(GuidanceVersionError, match=f"policy version {version}.*expects 4..6"):
            check_staleness(key, version, expected=6, max_staleness=2)


def test_policy_versions():
    store = GuidanceStore.in_memory()
    store.write(RUN, 0, numpy_guidance(0), policy_version=5)
    store.read(RUN, 0, expected_version=5)
    store.read(RUN, 0, expected_version=7, max_staleness=2)
    with pytest.raises(GuidanceVersionError, match=r"policy version 5.*expects 6 "):
        store.read(RUN, 0, expected_version=6)
    with pytest.raises(GuidanceVersionError, match=r"expects 8..10"):
        store.read(RUN, 0, expected_version=10, max_staleness=2)
    with pytest.raises(GuidanceVersionError):  # sampled with a newer policy than the trainer's
        store.read(RUN, 0, expected_version=4, max_staleness=3)
    assert store.read(RUN, 0, expected_version=6, fallback="rtn") is None
    assert store.fallbacks == {"version": 1}

    assert store.published_version(RUN) is None
    store.publish_version(RUN, 0)
    store.publish_version(RUN, 2)
    assert store.published_version(RUN) == 2
    with pytest.raises(ValueError, match="cannot publish older"):
        store.publish_version(RUN, 1)
    assert store.wait_for_version(RUN, 2, timeout_s=0) == 2
    with pytest.raises(TimeoutError, match="policy version 3 not published"):
        store.wait_for_version(RUN, 3, timeout_s=0.05)
    store.close()
