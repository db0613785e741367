"""Garbage collection of consumed steps and discarding of steps a resumed run samples again."""

from __future__ import annotations

import pytest

from tests.guidance.support import RUN, assert_same_guidance, file_store, numpy_guidance
from trace_jax.guidance import GuidanceMissingError


def test_gc_and_discard_remove_their_steps_only(tmp_path):
    with file_store(tmp_path) as store:
        store.publish_version(RUN, 1)
        for step in range(4):
            for mb in range(2):
                store.write(RUN, step, numpy_guidance(step), policy_version=1, micro_batch=mb)
        store.write("other-run", 0, numpy_guidance(9), policy_version=0)

        assert store.gc(RUN, 1) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert store.entries(RUN) == [(2, 0), (2, 1), (3, 0), (3, 1)]
        with pytest.raises(GuidanceMissingError):
            store.read(RUN, 1, micro_batch=1, expected_version=1)
        assert_same_guidance(numpy_guidance(3), store.read(RUN, 3, expected_version=1))
        assert store.entries("other-run") == [(0, 0)]
        assert store.published_version(RUN) == 1
        assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == [
            "policy_version.json",
            "step_0000000002",
            "step_0000000003",
        ]
        assert store.gc(RUN, 1) == []
        # A resumed run redoes steps >= 3: their entries go, uncommitted data too; earlier
        # steps, other runs and the published version stay.
        (tmp_path / RUN / "step_0000000005" / "mb_00000" / "data_x").mkdir(parents=True)
        (tmp_path / RUN / "step_0000000005" / "mb_00000" / "data_x" / "junk").write_bytes(b"x")
        assert store.discard_from(RUN, 3) == [(3, 0), (3, 1)]
        assert store.entries(RUN) == [(2, 0), (2, 1)]
        assert store.entries("other-run") == [(0, 0)]
        assert store.published_version(RUN) == 1
        assert sorted(p.name for p in (tmp_path / RUN).iterdir()) == [
            "policy_version.json",
            "step_0000000002",
        ]
        assert store.discard_from(RUN, 3) == []
