r"""One decode step of a model preset: bf16 against FP4 W/A/KV; guidance capture off, compact, full.

Times `steps_per_call` decode steps in one jitted loop, as the sampler runs them, over a cache
holding `context` random tokens per sequence, and reports the time per step. Variants: bf16 (no
quantization, XLA), FP4 with each kernel implementation of `config.implementations`, and on the
Pallas one also compact and full guidance capture, each step's records packed into one byte row
of a step-indexed buffer as the sampler keeps them. Every variant of a context is compiled first,
then all are timed in `rounds` alternating rounds (`timing.time_interleaved`): the capture
overheads are a few percent, so device drift between variants must not decide their sign. A row
has each variant's median over rounds (`<variant>_ms`), speedups and overheads as medians of
same-round ratios, every round's times (`ms_by_round`) and the wall seconds of each part of the
command (`wall_s_by_part`: cache fills, compiles, timing). Writes `<outdir>/<name>.{json,md}`
(default `kernels_decode_step`) after every context. Launch commands: configs/bench_decode_step.py.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx
from ml_collections import ConfigDict

from experiments import harness, timing
from trace_jax import fp4
from trace_jax.models import (
    KVCache,
    LayerKVCache,
    ModelConfig,
    PackedLayerKVCache,
    decode_step,
    init_model,
    pack_model_experts,
)
from trace_jax.quant import QuantConfig, QuantSites, SiteMode, quant_recipe
from trace_jax.rl.config_dict import from_section
from trace_jax.rl.experiment import ModelSpec
from trace_jax.rollout.sampler import pack_rows

COLUMNS = ["preset", "context", "batch", "bf16_ms", "fp4_xla_no capture_ms"]
COLUMNS += ["fp4_pallas_no capture_ms", "fp4_pallas_compact_ms", "fp4_pallas_full_ms"]
COLUMNS += ["fp4_pallas_speedup_vs_bf16", "fp4_pallas_compact_overhead"]
COLUMNS += ["fp4_pallas_full_overhead"]


class Laps:
    """Wall seconds between successive calls: `lap(part)` records the time since the previous
    call (or since construction) in `seconds[part]`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, part: str) -> None:
        now = time.perf_counter()
        self.seconds[part], self.last = now - self.last, now


def quant_sites(
    qcfg: QuantConfig, n_layers: int, mode: SiteMode, capture, implementation: str, packed_experts
) -> QuantSites:
    """The rollout's quantization hook for one step: FP4 kernels by `implementation` ("xla" |
    "pallas"; the packed expert weights are used by "pallas" only), capturing `capture`."""
    return QuantSites(
        qcfg,
        n_layers,
        mode,
        capture=capture,
        differentiable=False,
        implementation=implementation,
        packed_experts=packed_experts if implementation == "pallas" else None,
    )


def filled_cache(
    cfg: ModelConfig, batch: int, context: int, kv_format: str | None, seed: int, extra: int = 1
) -> KVCache:
    """A cache holding `context` random tokens per sequence (as if prefilled) and `extra` free
    slots, bf16 (`kv_format` None) or packed FP4."""
    layers = []
    for i in range(cfg.n_layers):
        k, v = harness.random_kv(batch, context + extra, cfg.n_kv_heads, cfg.head_dim, seed + 2 * i)
        if kv_format is None:
            layers.append(LayerKVCache(k=k, v=v))
        else:
            fmt = fp4.get_format(kv_format)
            layers.append(
                PackedLayerKVCache(
                    k=harness.packed_kv_cache(k, fmt),
                    v=harness.packed_kv_cache(v, fmt),
                )
            )
    return KVCache(layers=tuple(layers), lengths=jnp.full((batch,), context, jnp.int32))


class DecodeStepBench:
    """The model, its packed expert weights and the jitted step loop of `config`, set up once;
    `measure(context)` times every variant at one context (see the module docstring)."""

    def __init__(self, config: ConfigDict):
        impls = tuple(config.implementations)
        if "pallas" not in impls or not set(impls) <= {"xla", "pallas"}:
            raise ValueError(
                f"implementations must include 'pallas' and be among xla, pallas; got {impls}"
            )
        self.config, self.implementations = config, impls
        self.model = cfg = from_section(ModelSpec, config.model).build()
        self.qcfg = qcfg = quant_recipe(config.recipe)
        # Parameters are arguments of the timed step, never constants baked into it: as
        # constants, XLA constant-folded the weight quantization (minutes of compile per variant
        # on the H200).
        self.graphdef, self.params = nnx.split(init_model(cfg))
        # The Pallas rollout packs FP4 expert weights once per policy version, as the sampler
        # does; packing is outside the timed step, as there.
        pack = lambda p: pack_model_experts(nnx.merge(self.graphdef, p), qcfg)
        self.packed = jax.jit(pack)(self.params)
        self.capture_keys = qcfg.guided_keys(cfg.n_layers)
        self.tokens = jnp.ones((config.batch,), jnp.int32)

    def one_step(self, params, packed, cache, tok, mode, capture, impl, full):
        """One decode step -> (logits, the step's records in one byte row, cache)."""
        keys = self.capture_keys if capture else ()
        sites = quant_sites(self.qcfg, self.model.n_layers, mode, keys, impl, packed)
        logits, aux, cache = decode_step(nnx.merge(self.graphdef, params), cache, tok, site=sites)
        g = sites.captured_guidance("full" if full else "compact")
        # A step's records as the sampler keeps them: experts and guidance in one byte row.
        row = pack_rows([jnp.moveaxis(aux["topk_idx"], 1, 0), *jax.tree.leaves(g)])
        return logits, row, cache

    def steps(self, params, packed, cache, tok, mode, capture, impl, full):
        """`steps_per_call` decode steps in one jitted loop (one call per step would time the
        dispatch of its outputs at short contexts), every step's records written to a
        step-indexed buffer -> (the last logits, the records)."""
        n_steps = self.config.steps_per_call
        args = (params, packed, cache, tok, mode, capture, impl, full)
        row = jax.eval_shape(lambda: self.one_step(*args)[1])
        rows = jnp.zeros((n_steps, *row.shape), row.dtype)

        def body(i, carry):
            cache, tok, rows, _ = carry
            step_args = (params, packed, cache, tok, mode, capture, impl, full)
            logits, row, cache = self.one_step(*step_args)
            rows = jax.lax.dynamic_update_index_in_dim(rows, row, i, 0)
            return cache, jnp.argmax(logits, -1).astype(jnp.int32), rows, logits

        init = (cache, tok, rows, jnp.zeros((tok.shape[0], self.model.vocab_size), jnp.float32))
        _, _, rows, logits = jax.lax.fori_loop(0, n_steps, body, init)
        return logits, rows

    def measure(self, ctx: int) -> dict:
        """One row: every variant at context `ctx`."""
        config, cfg, b = self.config, self.model, self.config.batch
        n_steps = config.steps_per_call
        lap = Laps()
        caches = {"bf16": filled_cache(cfg, b, ctx, None, seed=11, extra=n_steps)}
        lap("fill bf16")
        calls = {
            "bf16": (
                lambda p, c, t: self.steps(p, None, c, t, SiteMode.OFF, False, "xla", False),
                (self.params, caches["bf16"], self.tokens),
            )
        }
        # Both implementations read the same packed cache (the same RTN codes either way).
        caches["fp4"] = filled_cache(cfg, b, ctx, self.qcfg.kv_format, seed=11, extra=n_steps)
        lap("fill fp4")
        for impl in self.implementations:
            variants = [("no capture", False, False), ("compact", True, False)]
            variants += [("full", True, True)]
            for label, capture, full in variants if impl == "pallas" else variants[:1]:
                calls[f"fp4_{impl}_{label}"] = (
                    lambda p, w, c, tk, impl=impl, cap=capture, f=full: self.steps(
                        p, w, c, tk, SiteMode.RTN, cap, impl, f
                    ),
                    (self.params, self.packed, caches["fp4"], self.tokens),
                )

        def ready(name):
            lap(f"compile {name}")
            logging.info("decode step @%d: %s compiled and warm", ctx, name)

        trials = dict(inner=config.inner, trials=config.trials, warmup=1 if config.smoke else 3)
        per_round = timing.time_interleaved(calls, rounds=config.rounds, on_ready=ready, **trials)
        lap("timing")
        ms = {k: [1e3 * t / n_steps for t in v] for k, v in per_round.items()}
        row = {
            "op": "decode step",
            "preset": config.model.preset,
            "context": ctx,
            "batch": b,
            "steps_per_call": n_steps,
            "rounds": config.rounds,
        }
        for name, values in ms.items():
            row[f"{name}_ms"] = statistics.median(values)
        for impl in self.implementations:
            no_capture = f"fp4_{impl}_no capture"
            row[f"fp4_{impl}_speedup_vs_bf16"] = timing.paired_ratio(ms, "bf16", no_capture)
        for label in ("compact", "full"):
            base = "fp4_pallas_no capture"
            overhead = timing.paired_ratio(ms, f"fp4_pallas_{label}", base) - 1
            row[f"fp4_pallas_{label}_overhead"] = overhead
        row["ms_by_round"] = ms
        row["wall_s_by_part"] = lap.seconds
        logging.info("%s", row)
        return row


def summarize(rows: list[dict]) -> dict:
    """Per context: the Pallas FP4 step's speedup over bf16 and the capture overheads."""
    return {
        "speedup_vs_bf16": {str(r["context"]): r["fp4_pallas_speedup_vs_bf16"] for r in rows},
        "guidance_capture_overhead": {
            str(r["context"]): {
                "compact": r["fp4_pallas_compact_overhead"],
                "full": r["fp4_pallas_full_overhead"],
            }
            for r in rows
        },
    }


def notes(config: ConfigDict) -> str:
    return (
        f"Per-step times of {config.steps_per_call} decode steps in one jitted loop, batch "
        f"{config.batch}, {config.recipe} W/A/KV for the FP4 variants; medians over "
        f"{config.rounds} alternating rounds; speedups and overheads: medians of same-round "
        "ratios (every round's times and the wall time of each part are in the JSON)."
        + (harness.SMOKE_NOTE if config.smoke else "")
    )


def run(config: ConfigDict, *, outdir: str, name: str) -> list[dict]:
    """Measures every context and writes `<outdir>/<name>.{json,md}` after each (a command
    stopped by its time limit keeps the contexts it finished); returns the rows."""
    bench = DecodeStepBench(config)
    rows = []
    for ctx in config.contexts:
        rows.append(bench.measure(ctx))
        table = harness.write_table(
            name,
            rows,
            COLUMNS,
            title="FP4 decode step",
            notes=notes(config),
            outdir=outdir,
            extra={"summary": summarize(rows)},
        )
    print(table)
    return rows


if __name__ == "__main__":
    harness.run_app(run, config="bench_decode_step", name="kernels_decode_step")
