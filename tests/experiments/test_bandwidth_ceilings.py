"""The bandwidth-by-size table: each size measured at whole uint32 words, the read's time and the
ratio to the largest size derived from the measured bandwidth, bad sizes refused, and a CPU smoke
run writing its files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from configs import bandwidth_ceilings as config_module
from experiments import bandwidth_ceilings as bw
from experiments import harness, timing


def test_rows_derive_from_the_measured_bandwidth(monkeypatch):
    seen = []

    def fake_ceilings(n_bytes, *, smoke=False):
        seen.append(n_bytes)
        return {"read_bw": 1e9 * (n_bytes % 97 + 1), "copy_bw": 3e9 * n_bytes / 1e6}

    monkeypatch.setattr(harness, "ceilings", fake_ceilings)
    config = config_module.get_config("smoke")
    config.sizes_mb = (1.7, 1)  # unsorted; 1.7 MiB is not a whole number of words
    rows = bw.bench(config)
    assert seen == [1 << 20, int(1.7 * (1 << 20)) // 4 * 4]
    assert [r["size_mb"] for r in rows] == [1, 1.7]
    for n, r in zip(seen, rows, strict=True):
        read = 1e9 * (n % 97 + 1)
        assert r["read_tb_s"] == pytest.approx(read / 1e12, rel=1e-12)
        assert r["read_us"] == pytest.approx(n / read * 1e6, rel=1e-12)
        assert r["copy_tb_s"] == pytest.approx(3e9 * n / 1e6 / 1e12, rel=1e-12)
        assert r["read_vs_largest"] == pytest.approx(read / (1e9 * (seen[-1] % 97 + 1)), rel=1e-12)


@pytest.mark.parametrize("sizes", [(), (0, 4), (-1,)])
def test_bad_sizes_are_refused(sizes):
    config = config_module.get_config("smoke")
    config.sizes_mb = sizes
    with pytest.raises(ValueError, match="sizes_mb must be positive"):
        bw.bench(config)


def test_smoke_run_writes_its_table(tmp_path):
    rows = bw.run(config_module.get_config("smoke"), outdir=str(tmp_path), name="bw")
    assert [r["size_mb"] for r in rows] == [1, 2]
    assert all(r["read_tb_s"] > 0 and r["copy_tb_s"] > 0 for r in rows)
    assert rows[-1]["read_vs_largest"] == 1.0
    payload = json.loads((tmp_path / "bw.json").read_text())
    assert payload["rows"] == rows
    assert "read_vs_largest" in (tmp_path / "bw.md").read_text()


@pytest.mark.parametrize("smoke", [True, False])
def test_the_device_loop_reads_fresh_bytes_every_pass(monkeypatch, smoke):
    calls = []

    def fake_time_fn(fn, *args, **kwargs):
        calls.append((fn, args))
        return 0.5

    monkeypatch.setattr(timing, "time_fn", fake_time_fn)
    n = 4096
    reps = 2 if smoke else bw.LOOP_BYTES // n
    assert bw.loop_read_seconds(n, smoke=smoke) == 0.5 / reps
    if smoke:  # the loop's result: every pass sums the bytes XORed with its index
        ((fn, (a,)),) = calls
        b = np.asarray(a).astype(np.int64)
        want = sum(int(np.sum(b ^ i)) for i in range(reps))
        assert int(fn(a)) == want and want != reps * int(np.sum(b))
