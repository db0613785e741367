"""Where a rollout's device time goes: kernel times read from profiler traces (a GPU's streams, the
CPU's XLA thunks), grouped and split into prefill and decode step, and one smoke run end to end."""

from __future__ import annotations

import collections
import json
import random

import pytest

from configs import profile_rollout as config_module
from experiments import harness, profile_rollout

GPU_PID, HOST_PID = 1, 2
COMPUTE_TID, COPY_TID, OPS_TID, MODULES_TID = 13, 20, 30, 31


def metadata(kind, pid, name, tid=None):
    """A trace's "M" event naming a process (kind "process_name") or a thread ("thread_name")."""
    event = {"ph": "M", "name": kind, "pid": pid, "args": {"name": name}}
    return event if tid is None else {**event, "tid": tid}


def complete(pid, tid, name, dur, ts=0.0, **args):
    """A complete ("X") event."""
    return {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def kernel_totals(events):
    """Name -> (count, summed duration) of `events`."""
    out = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        out[e["name"]][0] += 1
        out[e["name"]][1] += e["dur"]
    return dict(out)


def assert_kernel_times(got, want):
    assert set(got) == set(want)
    for name, (count, us) in want.items():
        assert got[name]["count"] == count, name
        assert got[name]["us"] == pytest.approx(us), name


def gpu_trace(rng):
    """A GPU-style trace: kernels and copies on the device's stream threads (the only events to
    count), repeated on its derived "XLA Ops" / "XLA Modules" threads, and host events that name
    their HLO op (a host thread shares a stream's thread id). Returns (events, stream events)."""
    pool = [f"kernel_{i}_{rng.randrange(10**6)}" for i in range(8)]
    streams = [
        complete(GPU_PID, COMPUTE_TID, rng.choice(pool), rng.uniform(1, 500), ts=i)
        for i in range(rng.randint(30, 60))
    ]
    streams += [
        complete(GPU_PID, COPY_TID, rng.choice(["MemcpyH2D", "MemcpyD2H"]), rng.uniform(1, 50))
        for _ in range(rng.randint(3, 10))
    ]
    ops = [complete(GPU_PID, OPS_TID, e["name"], e["dur"], ts=e["ts"]) for e in streams]
    total = sum(e["dur"] for e in streams)
    host = [
        complete(HOST_PID, COMPUTE_TID, e["name"], 2 * e["dur"], hlo_op=e["name"])
        for e in streams[:10]
    ]
    events = [
        metadata("process_name", GPU_PID, "/device:GPU:0"),
        metadata("thread_name", GPU_PID, "Stream #13(Compute)", COMPUTE_TID),
        metadata("thread_name", GPU_PID, "Stream #20(MemcpyH2D)", COPY_TID),
        metadata("thread_name", GPU_PID, "XLA Ops", OPS_TID),
        metadata("thread_name", GPU_PID, "XLA Modules", MODULES_TID),
        metadata("process_name", HOST_PID, "/host:CPU"),
        metadata("thread_name", HOST_PID, "tf_XLACpuThunk", COMPUTE_TID),
        complete(GPU_PID, MODULES_TID, "jit_generate(1)", total),
        {"ph": "i", "name": pool[0], "pid": GPU_PID, "tid": COMPUTE_TID, "ts": 0.0},  # not "X"
        *streams,
        *ops,
        *host,
    ]
    rng.shuffle(events)  # metadata may come after the events it names
    return events, streams


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_device_kernel_times_count_the_device_streams_only(seed):
    events, streams = gpu_trace(random.Random(seed))
    got = profile_rollout.device_kernel_times(iter(events))  # any iterable
    assert_kernel_times(got, kernel_totals(streams))


def test_a_device_process_without_stream_threads_is_refused():
    events = [
        metadata("process_name", GPU_PID, "/device:GPU:0"),
        metadata("thread_name", GPU_PID, "XLA Ops", OPS_TID),
        complete(GPU_PID, OPS_TID, "fusion_1", 3.0),
        metadata("process_name", HOST_PID, "/host:CPU"),
        complete(HOST_PID, COMPUTE_TID, "fusion_1", 3.0, hlo_op="fusion_1"),
    ]
    with pytest.raises(ValueError, match=r"without 'Stream' threads.*'XLA Ops'"):
        profile_rollout.device_kernel_times(events)


def test_on_the_cpu_the_host_thunks_that_name_their_hlo_op_are_counted_control_flow_not():
    rng = random.Random(3)
    names = ["fusion.3", "dot.1", "add", "call_fusion.4", "while_body_fusion", "copy.7"]
    control_flow = ["while.12", "cond.3", "call", "conditional.5", "while"]
    thunks = [
        complete(HOST_PID, 1 + i % 3, rng.choice(names), rng.uniform(1, 100), ts=i)
        for i in range(50)
    ]
    for t in thunks:
        t["args"]["hlo_op"] = t["name"]
    runners = [
        complete(HOST_PID, 1, name, 1e4, hlo_op=name) for name in control_flow for _ in range(2)
    ]
    others = [
        complete(HOST_PID, 1, "ThunkExecutor::Execute", 5e3),  # no hlo_op
        complete(HOST_PID, 1, "PjRtCpuLoadedExecutable::Execute", 7e3, hlo_module="jit_f"),
        {"ph": "X", "name": "fusion.3", "pid": HOST_PID, "tid": 1, "dur": 9e3},  # no args
        complete(HOST_PID, 1, "fusion.3 (outer)", 11.0, hlo_op="fusion.3"),  # not its name
        {"ph": "B", "name": "dot.1", "pid": HOST_PID, "tid": 2, "args": {"hlo_op": "dot.1"}},
    ]
    events = [metadata("process_name", HOST_PID, "/host:CPU"), *thunks, *runners, *others]
    rng.shuffle(events)
    got = profile_rollout.device_kernel_times(events)
    assert_kernel_times(got, kernel_totals(thunks))
    assert not set(got) & set(control_flow)


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("fp4_grouped_matmul_kernel", "pallas fp4"),  # the first matching group wins
        ("FP4_Decode_Attn", "pallas fp4"),
        ("grouped_matmul__1", "pallas bf16 grouped matmul"),
        ("gmm", "pallas bf16 grouped matmul"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "library attention"),
        ("sm90_xmma_gemm_bf16bf16_wgmma_64x128", "library matmul"),  # "wgmma" is no "gmm"
        ("fp4_moe_matmul_predecoded", "pallas fp4"),
        ("prefill_attention", "pallas prefill attention"),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "library matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "library matmul"),
        ("cutlass_80_tensorop_s16816gemm", "library matmul"),
        ("input_fusion_3", "xla fusion"),
        ("loop_reduce_fusion", "xla fusion"),
        ("dynamic_update_slice", "xla fusion"),
        ("Memcpy DtoD", "copy / memset"),
        ("Memset", "copy / memset"),
        ("foo", "other"),
        ("rng_bit_generator", "other"),
    ],
)
def test_kernel_group(name, group):
    assert profile_rollout.kernel_group(name) == group


# kernel names by the group they belong to, built so that `kernel_group` has one answer
GROUP_PREFIXES = {
    "pallas fp4": "fp4_kernel_",
    "pallas bf16 grouped matmul": "grouped_matmul_",
    "library matmul": "nvjet_tst_",
    "xla fusion": "loop_fusion_",
    "copy / memset": "Memcpy_",
    "other": "foo_",
}


def random_kernels(rng, names):
    return {n: {"count": rng.randint(1, 40), "us": rng.uniform(1.0, 5e3)} for n in names}


def test_difference_subtracts_per_kernel_name_missing_names_counting_zero():
    rng = random.Random(4)
    names = [f"k{i}" for i in range(12)]
    a = random_kernels(rng, names[:9])
    b = random_kernels(rng, names[4:])  # 4 shared names, 3 in a only, 3 in b only
    got = profile_rollout.difference(a, b)
    assert set(got) == set(names)
    for n in names:
        ca, ua = (a[n]["count"], a[n]["us"]) if n in a else (0, 0.0)
        cb, ub = (b[n]["count"], b[n]["us"]) if n in b else (0, 0.0)
        assert got[n]["count"] == ca - cb and got[n]["us"] == pytest.approx(ua - ub)
    assert profile_rollout.difference(a, {}) == a


@pytest.mark.parametrize("seed", [5, 6])
def test_phase_summary_scales_groups_and_ranks_negative_entries_counting_zero(seed):
    rng = random.Random(seed)
    group_of = {f"{prefix}{i}": group for group, prefix in GROUP_PREFIXES.items() for i in range(4)}
    names = list(group_of)
    rng.shuffle(names)
    kernels = random_kernels(rng, names)
    negative = names[:6]  # ran less in the whole rollout than in the one-token one
    for n in negative:
        kernels[n] = {"count": -rng.randint(1, 5), "us": -rng.uniform(1.0, 5e3)}
    scale, top = 1 / rng.randint(2, 40), 7
    got = profile_rollout.phase_summary(kernels, scale, top)

    ms = {n: max(k["us"], 0.0) * scale / 1e3 for n, k in kernels.items()}
    launches = {n: max(k["count"], 0) * scale for n, k in kernels.items()}
    busy = sum(ms.values())
    positive_us = sum(k["us"] for k in kernels.values() if k["us"] > 0)
    assert got["busy_ms"] == pytest.approx(positive_us * scale / 1e3)
    assert got["launches"] == pytest.approx(sum(launches.values()))
    groups = got["groups"]
    assert set(groups) == set(GROUP_PREFIXES)
    for group in GROUP_PREFIXES:
        members = [n for n in names if group_of[n] == group]
        assert groups[group]["ms"] == pytest.approx(sum(ms[n] for n in members))
        assert groups[group]["launches"] == pytest.approx(sum(launches[n] for n in members))
        assert groups[group]["share"] == pytest.approx(groups[group]["ms"] / busy)
    assert sum(g["share"] for g in groups.values()) == pytest.approx(1.0)
    group_ms = [g["ms"] for g in groups.values()]
    assert group_ms == sorted(group_ms, reverse=True)

    ranked = sorted(names, key=lambda n: -ms[n])[:top]
    assert [r["kernel"] for r in got["top"]] == ranked
    for r in got["top"]:
        n = r["kernel"]
        assert r["group"] == group_of[n]
        assert r["ms"] == pytest.approx(ms[n]) and r["launches"] == pytest.approx(launches[n])
        assert r["share"] == pytest.approx(ms[n] / busy)
    everything = profile_rollout.phase_summary(kernels, scale, top=100)["top"]
    assert len(everything) == len(names)
    assert {r["kernel"]: r["ms"] for r in everything if r["kernel"] in negative} == dict.fromkeys(
        negative, 0.0
    )
    empty = profile_rollout.phase_summary({}, scale, top)
    assert empty == {"busy_ms": 0, "launches": 0, "groups": {}, "top": []}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One smoke run of both variants (the 1-block smoke model at row (2, 8, 3)), traces kept."""
    config = config_module.get_config("smoke")
    config.keep_traces = True
    outdir = tmp_path_factory.mktemp("profile_rollout")
    inits, rollout_policy = [], profile_rollout.rollout_policy

    def policy_of(cfg, **kw):  # records the init the entry point asks for
        inits.append(kw.get("init"))
        return rollout_policy(cfg, **kw)

    with harness.smoke_interpretation(config), pytest.MonkeyPatch.context() as patch:
        patch.setattr(profile_rollout, "rollout_policy", policy_of)
        records = profile_rollout.run(config, outdir=str(outdir), name="profile_rollout")
    assert inits == [config.model_init]
    return config, outdir, records


# One worker runs the shared smoke run (a module fixture) for the tests that read it.
@pytest.mark.xdist_group("profile_rollout_smoke_run")
def test_smoke_run_profiles_prefill_and_a_decode_step_of_every_variant(smoke_run):
    config, outdir, records = smoke_run
    assert list(records) == list(config.variants) == ["bf16", "fp4"]
    for variant, phases in records.items():
        assert set(phases) == {"prefill", "decode_step"}, variant
        # a timed call takes time; a decode step's wall time is a slope between two timings,
        # which a loaded machine can push to or below zero: its busy share is None then
        assert phases["prefill"]["wall_ms"] > 0, variant
        for phase, s in phases.items():
            assert s["busy_ms"] > 0 and s["launches"] > 0, (variant, phase)
            if s["wall_ms"] > 0:
                assert s["busy_fraction"] == pytest.approx(s["busy_ms"] / s["wall_ms"])
            else:
                assert s["busy_fraction"] is None
            assert sum(g["share"] for g in s["groups"].values()) == pytest.approx(1.0)
            assert 0 < len(s["top"]) <= config.top
    saved = json.loads((outdir / "profile_rollout.json").read_text())
    assert saved["row"] == [2, 8, 3]
    assert saved["model_init"] == config.model_init == "selective_attention"
    assert saved["rows"] == json.loads(
        json.dumps([{"variant": v, **phases} for v, phases in records.items()])
    )
    md = (outdir / "profile_rollout.md").read_text()
    assert "SMOKE RUN" in md and "### bf16, decode step:" in md and "### fp4, prefill:" in md
    assert "`model_init=selective_attention`: q/k norm scales 4" in md


@pytest.mark.xdist_group("profile_rollout_smoke_run")
def test_smoke_run_keeps_both_traces_of_every_variant(smoke_run):
    config, outdir, _ = smoke_run
    traces = outdir / "profile_rollout_traces"
    want = {f"{v}_{phase}.trace.json.gz" for v in config.variants for phase in ("whole", "prefill")}
    assert {p.name for p in traces.iterdir()} == want and len(want) == 4
    whole = profile_rollout.device_kernel_times(
        profile_rollout.read_trace(str(traces / "fp4_whole.trace.json.gz"))
    )
    prefill = profile_rollout.device_kernel_times(
        profile_rollout.read_trace(str(traces / "fp4_prefill.trace.json.gz"))
    )
    assert whole and prefill
    # 3 new tokens run more thunks than 1
    assert sum(k["count"] for k in whole.values()) > sum(k["count"] for k in prefill.values())


def test_markdown_writes_n_a_for_a_phase_without_positive_wall_time():
    """A decode slope at or below zero (noise over few steps) has no busy share: "n/a", no crash."""
    summary = profile_rollout.phase_summary({"fusion_1": {"count": 2, "us": 40.0}}, 1.0, top=3)
    phases = {
        "prefill": {**summary, "wall_ms": 0.08, "busy_fraction": 0.5},
        "decode_step": {**summary, "wall_ms": -0.01, "busy_fraction": None},
    }
    text = profile_rollout.markdown({"fp4": phases})
    assert "### fp4, prefill: 0.080 ms wall, 0.040 ms of kernels (50%), 2 kernels" in text
    assert "### fp4, decode step: -0.010 ms wall, 0.040 ms of kernels (n/a), 2 kernels" in text
    assert "| fusion_1 | xla fusion |" in text


def test_unknown_variants_and_short_rows_are_refused_before_any_work(tmp_path):
    config = config_module.get_config("smoke")
    config.variants = ("bf16", "fp8")
    with pytest.raises(ValueError, match=r"unknown variants \['fp8'\]; choose from"):
        profile_rollout.run(config, outdir=str(tmp_path), name="p")
    config.variants, config.row = ("bf16",), (2, 8, 1)
    with pytest.raises(ValueError, match="new tokens >= 2"):
        profile_rollout.run(config, outdir=str(tmp_path), name="p")
    assert not list(tmp_path.iterdir())
