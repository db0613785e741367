"""The rollout-throughput benchmark: rows of variants timed from whole rollouts, each decode step
against the bytes it must read, failures recorded, results merged across commands."""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import types

import jax
import jax.numpy as jnp
import matplotlib.axes
import numpy as np
import pytest
from flax import nnx

from configs import rollout_throughput as config_module
from experiments import rollout_throughput, timing
from trace_jax.fp4 import GuidanceMode
from trace_jax.models import ModelConfig, abstract_model, init_model
from trace_jax.quant import SiteMode
from trace_jax.rollout import variants
from trace_jax.rollout.variants import SELECTIVE_QK_NORM_SCALE

pytestmark = pytest.mark.usefixtures("pallas_interpreted_on_cpu")

OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 192.02GiB."


def fail_full_capture(monkeypatch):
    """`fp4 + full` fails before compiling (as XLA's autotuner can fail on a GPU)."""
    rollout_kwargs = variants.rollout_kwargs

    def kwargs_or_fail(cfg, variant, *args):
        if variant == "fp4 + full":
            raise RuntimeError(f"{OOM}\n(traceback lines)")
        return rollout_kwargs(cfg, variant, *args)

    monkeypatch.setattr(variants, "rollout_kwargs", kwargs_or_fail)


def test_smoke_run_times_every_variant_and_records_a_failure(tmp_path, monkeypatch):
    config = config_module.get_config("smoke")
    # One row and three variants keep the CPU compiles few (the capture settings, merging and
    # plotting are tested below without compiling).
    config.rows, config.variants = config.rows[:1], ("bf16", "fp4", "fp4 + full")
    fail_full_capture(monkeypatch)
    lowered, generate = [], variants.generate

    class Generate:  # counts the compiles: one per variant serves both timed lengths
        def lower(self, *args, **kw):
            lowered.append((kw["mode"], kw["sampling"].max_new_tokens, int(args[-1])))
            return generate.lower(*args, **kw)

    monkeypatch.setattr(variants, "generate", Generate())
    limits, time_interleaved = {}, timing.time_interleaved

    def timed(calls, **kw):  # the token limit each timed call passes to its compiled rollout
        limits.update({name: int(args[-1]) for name, (_, args) in calls.items()})
        return time_interleaved(calls, **kw)

    monkeypatch.setattr(timing, "time_interleaved", timed)
    records = rollout_throughput.run(config, outdir=str(tmp_path), name="rt")

    assert lowered == [(SiteMode.OFF, 3, 3), (SiteMode.RTN, 3, 3)]  # bf16, fp4: N = 3 new tokens
    assert limits == {"bf16/3": 3, "bf16/1": 1, "fp4/3": 3, "fp4/1": 1}
    assert [rollout_throughput.row_key(r) for r in records] == [(2, 8, 3)]
    (row,) = records
    v = row["variants"]
    assert list(v) == ["bf16", "fp4", "fp4 + full"]
    assert v["fp4 + full"] == {"error": f"RuntimeError: {OOM}", "run": 0}
    for name in ("bf16", "fp4"):
        e = v[name]
        assert e["tokens_per_s"] == pytest.approx(2 * 3 / e["rollout_s"])
        assert e["prefill_ms"] == pytest.approx(1e3 * e["prefill_s_by_round"][0])
        slope = (e["rollout_s_by_round"][0] - e["prefill_s_by_round"][0]) / 2
        assert e["decode_ms_per_step"] == pytest.approx(1e3 * slope)
        limit = 1e3 * e["decode_bytes_per_step"]["total"] / (1e9 * e["read_bw_GBps"])
        assert e["byte_limit_ms"] == pytest.approx(limit)
        assert e["byte_limit_ratio"] == pytest.approx(e["decode_ms_per_step"] / limit)
        assert e["compile_s"] > 0 and e["run"] == 0
        assert e["temp_gib"] > 0  # XLA's temporary buffers of the rollout
        # The warm-up rollout's routing, per layer of the smoke model.
        assert [len(x) for x in e["routing"].values()] == [config.model.n_layers] * 3
        n_experts, top_k = ModelConfig.tiny().n_experts, ModelConfig.tiny().top_k
        assert 1 <= e["prefill_busiest_over_mean"] <= n_experts / top_k
        assert top_k <= e["decode_active_experts"] <= min(n_experts, 2 * top_k)  # 2 rows
    s = {name: v[name]["rollout_s"] for name in ("bf16", "fp4")}
    assert row["fp4_speedup_vs_bf16"] == pytest.approx(s["bf16"] / s["fp4"])
    assert v["fp4"]["speedup_vs_bf16"] == row["fp4_speedup_vs_bf16"]
    assert row["compact_capture_overhead"] is None and row["full_capture_overhead"] is None
    assert row["fp4_byte_limit_ratio"] == v["fp4"]["byte_limit_ratio"]
    # the packed experts and cache are what make the FP4 step's byte limit smaller
    assert v["fp4"]["byte_limit_ms"] < v["bf16"]["byte_limit_ms"]

    saved = json.loads((tmp_path / "rt.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(records))
    assert saved["device"] == saved["meta"]["device"] and len(saved["runs"]) == 1
    assert saved["model_init"] == saved["runs"][0]["model_init"] == "selective_attention"
    assert saved["bf16_byte_limit_ratio"] == row["bf16_byte_limit_ratio"]  # batch 2 >= smoke's 2
    assert saved["fp4_byte_limit_ratio"] == row["fp4_byte_limit_ratio"]
    assert saved["compact_capture_overhead"] is None  # no compact variant ran
    md = (tmp_path / "rt.md").read_text()
    assert "SMOKE RUN" in md and OOM in md
    assert "`model_init=selective_attention`: q/k norm scales 4" in md
    assert (tmp_path / "rt.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "init, qk_norm_scale", [("selective_attention", SELECTIVE_QK_NORM_SCALE), ("normal", 1.0)]
)
def test_the_benchmark_model_is_initialized_as_model_init_says(init, qk_norm_scale):
    config = config_module.get_config("smoke")
    assert config.model_init == "selective_attention"  # the default
    config.model_init = init
    bench = rollout_throughput.RolloutBench(config, read_bw=1e6)
    model = nnx.merge(bench.graphdef, bench.params)
    assert len(model.layers) == config.model.n_layers
    for block in model.layers:
        for norm in (block.attn.q_norm, block.attn.k_norm):
            np.testing.assert_array_equal(np.asarray(norm.scale[...], np.float32), qk_norm_scale)
        np.testing.assert_array_equal(np.asarray(block.mlp_norm.scale[...], np.float32), 1.0)


def test_an_unknown_model_init_is_refused():
    config = config_module.get_config("smoke")
    config.model_init = "trained"
    with pytest.raises(ValueError, match="unknown model_init 'trained'"):
        rollout_throughput.check_config(config)


def test_compile_only_compiles_from_shapes_and_runs_nothing(tmp_path, monkeypatch, capsys):
    config = config_module.get_config("smoke")
    config.rows, config.variants = config.rows[:1], ("bf16", "fp4 + full")
    config.compile_only = True
    fail_full_capture(monkeypatch)

    def no_parameters(*args, **kw):
        raise AssertionError("compile_only made parameters")

    monkeypatch.setattr(variants, "init_model", no_parameters)
    (row,) = rollout_throughput.run(config, outdir=str(tmp_path), name="rt")
    bf16 = row["variants"]["bf16"]
    assert set(bf16) == {"compile_s", "temp_gib", "run"}  # compiled, never run
    assert bf16["compile_s"] > 0 and bf16["temp_gib"] > 0
    assert row["variants"]["fp4 + full"]["error"] == f"RuntimeError: {OOM}"
    # the estimate counts the measured compile, and the per-block guess for the failed variant
    guess = config.estimate.fp4_compile_s * config.model.n_layers
    assert row["estimate_s"]["compile_s"] == pytest.approx(bf16["compile_s"] + guess)
    assert not list(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert "row (2, 8, 3): about" in out and "| compile_s |" in out and OOM in out


def test_estimate_adds_compiles_and_rollouts_at_the_assumed_rates():
    config = config_module.get_config("smoke")
    config.compile_only, config.repeats, config.variants = True, 3, ("bf16", "fp4")
    config.estimate.update(bf16_compile_s=2.0, fp4_compile_s=5.0, over_limit=4.0)
    config.estimate.prefill_flop_per_s = 1e9
    bench = rollout_throughput.RolloutBench(config, read_bw=1e6)
    batch, prompt_len, new_tokens = 4, 8, 3
    # the 1-block tiny model, head_dim 32: attention, router and top-2 of the experts per token
    d, h, kv, dh, e, f = 64, 4, 2, 32, 8, 64
    block = d * h * dh * 2 + d * kv * dh * 2 + 2 * dh + 2 * d + d * e + 2 * 3 * f * d
    block += d  # the final norm rides along
    flops = 2 * block * batch * prompt_len + 2 * batch * prompt_len**2 * h * dh
    prefill_s = flops / 1e9
    run_s = 0.0
    for variant in config.variants:
        step = variants.decode_step_bytes(
            bench.graphdef, bench.params, variant, "nvfp4", batch, prompt_len + 1
        )
        rollout_s = prefill_s + 2 * 4.0 * step["total"] / 1e6
        run_s += 4 * rollout_s + 3 * prefill_s  # warm-up + 3 rounds of both lengths
    est = bench.estimate_s((batch, prompt_len, new_tokens))
    assert est["compile_s"] == pytest.approx(2.0 + 5.0)  # 1 block each
    assert est["run_s"] == pytest.approx(run_s)
    assert est["total_s"] == pytest.approx(7.0 + run_s)
    measured = bench.estimate_s((batch, prompt_len, new_tokens), {"fp4": 30.0})
    assert measured["compile_s"] == pytest.approx(2.0 + 30.0)


def test_parameters_are_init_model_s_made_by_small_compiles_shared_across_depths():
    """The bench's parameters are `init_model(cfg, seed=0)`'s with sharpened attention (the
    default `model_init`), made eagerly: one small compiled op per distinct parameter shape, so a
    deeper model of the same shapes compiles nothing new (one jitted init of the whole model
    would compile once per depth)."""
    config = config_module.get_config("smoke")
    bench = rollout_throughput.RolloutBench(config, read_bw=1.0)
    model = init_model(bench.cfg, seed=0)
    variants.sharpen_attention(model.layers)
    want = nnx.split(model)[1]
    for got, ref in zip(jax.tree.leaves(bench.params), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    lowered = []

    def listen(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    config.model.n_layers = 3
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        deeper = rollout_throughput.RolloutBench(config, read_bw=1.0)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len(deeper.cfg and deeper.graphdef and jax.tree.leaves(deeper.params)) > len(
        jax.tree.leaves(bench.params)
    )
    assert lowered == []


def test_decode_step_bytes_count_dense_weights_touched_experts_and_the_cache():
    cfg = ModelConfig.tiny(n_layers=2, head_dim=32, param_dtype=jnp.bfloat16)
    graphdef, params = nnx.split(abstract_model(cfg))  # shapes only
    d, h, kv, dh, e, f, v = 64, 4, 2, 32, 8, 64, 64
    attention = d * h * dh * 2 + d * kv * dh * 2 + 2 * dh + 2 * d  # q, o, k, v, q/k/block norms
    dense = 2 * (attention + d * e) + d + d * v  # + routers; final norm, LM head
    batch, context = 3, 10
    active = e * (1 - (1 - 2 / e) ** batch)
    bf16 = variants.decode_step_bytes(graphdef, params, "bf16", "nvfp4", batch, context)
    assert bf16["dense"] == 2 * dense and bf16["embedding"] == 2 * batch * d
    assert bf16["active_experts"] == pytest.approx(active)
    assert bf16["experts"] == pytest.approx(2 * active * 3 * f * d * 2)  # 2 layers, bf16
    assert bf16["kv"] == 2 * 2 * batch * context * kv * dh * 2  # layers, k and v, bf16
    fp4 = variants.decode_step_bytes(graphdef, params, "fp4", "nvfp4", batch, context)
    # NVFP4: 4-bit codes + one e4m3 scale per 16 values + a float32 global scale per expert
    # matrix (weights) or per cached head vector (cache)
    assert fp4["experts"] == pytest.approx(2 * active * 3 * (f * d // 2 + f * d // 16 + 4))
    assert fp4["kv"] == 2 * 2 * batch * context * kv * (dh // 2 + dh // 16 + 4)
    assert fp4["dense"] == bf16["dense"]  # attention and the LM head stay bf16
    for r in (bf16, fp4):
        total = r["dense"] + r["embedding"] + r["experts"] + r["kv"]
        assert r["total"] == pytest.approx(total)
    # "fp4 xla" fake-quantizes bf16 expert weights each step: it reads them unpacked
    xla = variants.decode_step_bytes(graphdef, params, "fp4 xla", "nvfp4", batch, context)
    assert xla["experts"] == bf16["experts"] and xla["kv"] == fp4["kv"]


def test_expected_active_experts_is_the_mean_union_of_random_top_k_choices():
    e, k, b = 5, 2, 3
    choices = list(itertools.combinations(range(e), k))
    union = [len(set().union(*c)) for c in itertools.product(choices, repeat=b)]
    expected = variants.expected_active_experts(e, k, b)
    assert expected == pytest.approx(statistics.mean(union))
    assert variants.expected_active_experts(128, 8, 1) == pytest.approx(8)


def test_variants_set_the_rollouts_quantization_capture_and_kernels():
    cfg = ModelConfig.tiny(n_layers=2)

    def kwargs(variant):
        return variants.rollout_kwargs(cfg, variant, 5, "nvfp4", None)

    bf16, fp4, compact, full, xla = map(
        kwargs, ["bf16", "fp4", "fp4 + compact", "fp4 + full", "fp4 xla"]
    )
    assert (bf16["mode"], bf16["capture"]) == (SiteMode.OFF, ())
    assert (fp4["mode"], fp4["capture"], fp4["implementation"]) == (SiteMode.RTN, (), "pallas")
    assert compact["capture"] == ("1/expert_in", "1/expert_mid", "1/k", "1/v")  # deeper half
    assert compact["capture_mode"] is GuidanceMode.COMPACT
    assert full["capture"] == fp4["qcfg"].all_keys(2) and full["capture_mode"] is GuidanceMode.FULL
    assert (xla["mode"], xla["implementation"]) == (SiteMode.RTN, "xla")
    assert fp4["sampling"].max_new_tokens == 5 and fp4["sampling"].stop_tokens == ()
    chunked = variants.rollout_kwargs(cfg, "fp4", 5, "nvfp4", 16)
    assert chunked["sampling"].prefill_chunk_tokens == 16
    # The prefill-attention twins: the same rollout arguments, the model's prefill attention
    # "auto" (the flash kernel on a GPU) or "cudnn".
    graphdef, params = nnx.split(abstract_model(cfg))
    for base in ("bf16", "fp4"):
        assert variants.variant_graphdef(cfg, graphdef, base) is graphdef
        for twin, setting in (("flash prefill", "auto"), ("cudnn prefill", "cudnn")):
            twin = f"{base} + {twin}"
            assert kwargs(twin) == kwargs(base)
            model = nnx.merge(variants.variant_graphdef(cfg, graphdef, twin), params)
            assert model.cfg == dataclasses.replace(cfg, prefill_attention=setting)
    # The in-kernel decode twins: the same rollout, the model's FP4 experts never decoded before
    # a call (the op's default decodes prefill-sized calls first).
    for twin, base, settings in (
        ("fp4 + in-kernel decode", "fp4", {}),
        ("fp4 + cudnn prefill + in-kernel decode", "fp4", {"prefill_attention": "cudnn"}),
    ):
        assert kwargs(twin) == kwargs(base)
        model = nnx.merge(variants.variant_graphdef(cfg, graphdef, twin), params)
        assert model.cfg == dataclasses.replace(cfg, predecode_experts=False, **settings)


def entry(seconds_by_round, run, tokens=1.0):
    return {
        "rollout_s": statistics.median(seconds_by_round),
        "rollout_s_by_round": seconds_by_round,
        "tokens_per_s": tokens,
        "byte_limit_ratio": 2.0,
        "run": run,
    }


def record(batch, prompt_len, new_tokens, variants):
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "variants": variants,
    }


def test_merge_replaces_entries_by_row_and_variant_and_pairs_rounds_of_one_command():
    old = [
        record(64, 1024, 256, {"bf16": entry([2.0, 4.0, 9.0], 0), "fp4": entry([1.0, 1.0, 3.0], 0)})
    ]
    merged = rollout_throughput.merge_rows(old, [])
    # one command: the median of same-round ratios (2, 4, 3), not the ratio of medians 4 / 1
    assert merged[0]["fp4_speedup_vs_bf16"] == 3.0
    assert merged[0]["variants"]["fp4"]["speedup_vs_bf16"] == 3.0
    new = [
        record(
            64,
            1024,
            256,
            {"fp4": entry([1.0, 2.0, 4.0], 1), "fp4 + compact": entry([1.1, 2.0, 4.04], 1)},
        ),
        record(16, 1024, 256, {"bf16": {"error": "RuntimeError: x", "run": 1}}),
    ]
    merged = rollout_throughput.merge_rows(old, new)
    assert [rollout_throughput.row_key(r) for r in merged] == [(64, 1024, 256), (16, 1024, 256)]
    first = merged[0]
    assert list(first["variants"]) == ["bf16", "fp4", "fp4 + compact"]
    assert first["variants"]["fp4"]["run"] == 1  # the newer command's entry wins
    assert first["fp4_speedup_vs_bf16"] == 4.0 / 2.0  # two commands: the ratio of medians
    # one command: same-round ratios 1.1, 1.0, 1.01 (the ratio of medians would give 0)
    assert first["compact_capture_overhead"] == pytest.approx(0.01)
    assert first["full_capture_overhead"] is None
    assert merged[1]["fp4_speedup_vs_bf16"] is None and merged[1]["bf16_byte_limit_ratio"] is None
    assert "speedup_vs_bf16" not in old[0]["variants"]["fp4"]  # the inputs are left as they were
    summary = rollout_throughput.summarize(merged, min_batch=64)
    assert summary["fp4_speedup_vs_bf16_worst"] == 2.0
    assert summary["fp4_byte_limit_ratio"] == 2.0 and summary["summary_min_batch"] == 64
    assert rollout_throughput.summarize(merged, min_batch=128)["bf16_byte_limit_ratio"] is None


def test_merge_run_adds_its_rows_and_command_to_an_existing_result(tmp_path, monkeypatch):
    measured = []

    class FakeBench:  # the model and its rollouts are the smoke test's; here: the bookkeeping
        def __init__(self, config, read_bw):
            self.cfg = ModelConfig.tiny(n_layers=1)

        def estimate_s(self, row):
            return {"compile_s": 1.0, "run_s": 2.0, "total_s": 3.0}

        def measure(self, row, run):
            measured.append((row, run))
            return record(*row, {"bf16": entry([1.0], run), "fp4": entry([0.5], run)})

    monkeypatch.setattr(rollout_throughput, "RolloutBench", FakeBench)
    config = config_module.get_config("smoke")
    config.variants = ("bf16", "fp4")
    rollout_throughput.run(config, outdir=str(tmp_path), name="rt")
    config.rows, config.merge = ((4, 8, 3), (8, 8, 3)), True
    records = rollout_throughput.run(config, outdir=str(tmp_path), name="rt")
    assert measured == [((2, 8, 3), 0), ((4, 8, 3), 0), ((4, 8, 3), 1), ((8, 8, 3), 1)]
    saved = json.loads((tmp_path / "rt.json").read_text())
    assert saved["rows"] == records and len(saved["runs"]) == 2
    keys = [(rollout_throughput.row_key(r), r["variants"]["fp4"]["run"]) for r in records]
    assert keys == [((2, 8, 3), 0), ((4, 8, 3), 1), ((8, 8, 3), 1)]
    assert all(r["fp4_speedup_vs_bf16"] == 2.0 for r in records)
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"variant": "bf16"}]}))
    with pytest.raises(ValueError, match=r"not a result written by experiments\.rollout_"):
        rollout_throughput.run(config, outdir=str(tmp_path), name="other")


def test_plot_draws_tokens_per_s_against_batch_and_context(tmp_path, monkeypatch):
    records = [
        record(64, 1024, 256, {"bf16": entry([1.0], 0, 100.0), "fp4": entry([1.0], 0, 300.0)}),
        record(256, 1024, 256, {"bf16": entry([1.0], 0, 200.0), "fp4": {"error": "x", "run": 0}}),
        record(64, 8192, 256, {"bf16": entry([1.0], 0, 50.0), "fp4": entry([1.0], 0, 150.0)}),
        record(16, 1024, 1024, {"bf16": entry([1.0], 0, 70.0)}),  # on neither line
    ]
    (tmp_path / "rt.json").write_text(json.dumps({"meta": {}, "rows": records}))
    lines = []
    plot = matplotlib.axes.Axes.plot

    def draw(self, x, y, **kw):
        lines.append((kw["label"], list(x), list(y)))
        return plot(self, x, y, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", draw)
    png = rollout_throughput.plot_from(str(tmp_path / "rt.json"))
    assert png == str(tmp_path / "rt.png") and (tmp_path / "rt.png").exists()
    assert lines == [
        ("bf16", [64, 256], [100.0, 200.0]),  # against batch at prompt 1024, 256 new tokens
        ("bf16", [1280, 8448], [100.0, 50.0]),  # against context at batch 64
        ("fp4", [64], [300.0]),  # its batch-256 rollout failed
        ("fp4", [1280, 8448], [300.0, 150.0]),
    ]


@pytest.mark.parametrize(
    "override, message",
    [
        ({"variants": ("bf16", "fp8")}, "unknown variants"),
        ({"rows": ((2, 8, 1),)}, r"row \(2, 8, 1\) is not"),
        ({"rows": ((2, 8, 3), (2, 8, 3))}, "repeat a row"),
        ({"repeats": 0}, "repeats must be >= 1"),
    ],
)
def test_bad_settings_are_refused_before_any_work(override, message, tmp_path):
    config = config_module.get_config("smoke")
    config.update(override)
    with pytest.raises(ValueError, match=message):
        rollout_throughput.run(config, outdir=str(tmp_path), name="x")
    assert not list(tmp_path.iterdir())


def test_timing_times_compiled_calls_as_they_are():
    compiled = jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
    rounds = timing.time_interleaved({"c": (compiled, (jnp.ones(3),))}, rounds=2, warmup=0)
    assert len(rounds["c"]) == 2 and all(t > 0 for t in rounds["c"])


def test_routing_balance_counts_each_prompt_s_rows_and_each_decode_step_s_experts():
    """Against per-row counts written out by loops: prompts of 5 and 3 tokens, rows ending at 9
    and 8 (decode slots 5 and 6 are processed by both), 2 layers, top-2 of 4 experts."""
    rng = np.random.default_rng(0)
    choices = rng.integers(0, 4, size=(2, 2, 9, 2)).astype(np.int32)
    choices[1, 0, :5] = [0, 1]  # layer 1, prompt 0: every token on experts 0 and 1
    roll = types.SimpleNamespace(
        expert_choices=jnp.asarray(choices),
        prompt_lengths=jnp.array([5, 3]),
        lengths=jnp.array([9, 8]),
    )
    got = variants.routing_balance(roll, n_experts=4)
    want_busiest, want_active, want_decode = [], [], []
    for layer in range(2):
        per_prompt = []
        for b, p in ((0, 5), (1, 3)):
            counts = [0] * 4
            for s in range(p):
                for e in choices[layer, b, s]:
                    counts[e] += 1
            per_prompt.append((max(counts) / (sum(counts) / 4), sum(c > 0 for c in counts)))
        want_busiest.append((per_prompt[0][0] + per_prompt[1][0]) / 2)  # median of two
        want_active.append((per_prompt[0][1] + per_prompt[1][1]) / 2)
        steps = [len(set(choices[layer, :, s].reshape(-1).tolist())) for s in (5, 6)]
        want_decode.append(sum(steps) / 2)
    np.testing.assert_allclose(got["prefill_busiest_over_mean"], want_busiest)
    np.testing.assert_allclose(got["prefill_active_experts"], want_active)
    np.testing.assert_allclose(got["decode_active_experts"], want_decode)
    assert got["prefill_busiest_over_mean"][1] >= (2.0 + 1) / 2  # prompt 0 of layer 1: 4 / 2


def test_a_rollout_that_stops_early_is_refused():
    """Rates assume every sequence decodes all its new tokens: a short one raises."""

    def call(*args):
        return types.SimpleNamespace(
            prompt_lengths=jnp.array([8, 8]), lengths=jnp.array([8 + int(args[-1]), 8 + 1])
        )

    inputs = (None, jnp.zeros((2, 8), jnp.int32), None, None)
    with pytest.raises(RuntimeError, match="fp4: 4 tokens decoded, want 6"):
        variants.run_full_length({"call": call}, inputs, "fp4", 3)
    full = {"call": lambda *a: types.SimpleNamespace(prompt_lengths=jnp.array([8, 8]),
                                                   lengths=jnp.array([11, 11]))}  # fmt: skip
    variants.run_full_length(full, inputs, "fp4", 3)  # every sequence decoded 3: no error
