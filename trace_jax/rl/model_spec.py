"""The `model` section of an experiment config: a model preset and what an experiment overrides,
or a Hugging Face checkpoint directory (`ModelSpec`, built into a `ModelConfig`)."""

from __future__ import annotations

import dataclasses
import os

from trace_jax.models import ModelConfig, hf_files
from trace_jax.models.hf_checkpoint import read_hf_config
from trace_jax.rl.config_dict import Checks

# qwen3_5_35b_a3b: the paper's model shapes, for benchmarks (cut by `n_layers` to fit a GPU).
MODEL_PRESETS = {
    "tiny": ModelConfig.tiny,
    "small": ModelConfig.small,
    "qwen3_5_35b_a3b": ModelConfig.qwen3_5_35b_a3b,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The `model` section: a `ModelConfig` preset and the fields an experiment overrides.

    preset: a key of `MODEL_PRESETS`. init_std, grouped_matmul, prefill_attention, remat,
      predecode_experts: as `ModelConfig`'s fields (prefill_attention: the rollouts' prefill
      chunks; remat: the training step recomputes each block's activations, for long rows;
      predecode_experts: the FP4 rollouts' prefill-sized expert matmuls on the Pallas kernel).
    n_layers: the preset's decoder-block count unless set (tests cut `tiny` to 2 blocks).
    head_dim: the preset's per-head width unless set (the benchmarks' CPU smoke runs widen it).
    hf_dir: a Hugging Face Qwen3-MoE checkpoint directory (config.json and safetensors weights),
      or "". When set, the model is its config.json's (`ModelConfig.from_hf_config`, this
      spec's kernel settings and remat, the presets' compute and parameter
      dtypes) and the policy starts from its weights (`trace_jax.rl.workers.initial_model`);
      preset and init_std are unused, and n_layers / head_dim are refused (the checkpoint fixes
      the shapes).
    """

    preset: str = "tiny"
    init_std: float = ModelConfig.init_std
    grouped_matmul: str = ModelConfig.grouped_matmul
    prefill_attention: str = ModelConfig.prefill_attention
    remat: bool = False
    predecode_experts: bool | None = None
    n_layers: int | None = None
    head_dim: int | None = None
    hf_dir: str = ""

    def __post_init__(self):
        object.__setattr__(self, "hf_dir", self.hf_dir or "")
        c = Checks("ModelSpec")
        c.one_of(self, "preset", MODEL_PRESETS)
        c.number(self, "init_std", "> 0", lambda x: x > 0)
        c.need(isinstance(self.remat, bool), "remat", f"must be a bool, got {self.remat!r}")
        c.ints(self, ("n_layers",), 1, optional=True)
        c.ints(self, ("head_dim",), 2, optional=True)
        for name in ("n_layers", "head_dim") if self.hf_dir else ():
            v = getattr(self, name)
            c.need(v is None, name, f"must be None with hf_dir (config.json sets it), got {v}")
        if self.hf_dir:
            try:
                check_hf_dir(self.hf_dir)
            except ValueError as e:
                c.need(False, "hf_dir", str(e))
        if not c.problems:
            try:
                self.build()
            except ValueError as e:  # `ModelConfig`'s own checks, e.g. of grouped_matmul
                named = [f for f in _SPEC_FIELDS if f"ModelConfig.{f}" in str(e)]
                where = named[0] if named else ("hf_dir" if self.hf_dir else "preset")
                c.need(False, where, f"gives no model: {e}")
        c.raise_any()

    def build(self) -> ModelConfig:
        """The `ModelConfig` this spec names (its own checks reject bad overrides)."""
        kernels = dict(
            grouped_matmul=self.grouped_matmul,
            prefill_attention=self.prefill_attention,
            remat=self.remat,
            predecode_experts=self.predecode_experts,
        )
        if self.hf_dir:
            return read_hf_config(self.hf_dir, **kernels)
        shape = {"n_layers": self.n_layers, "head_dim": self.head_dim}
        overrides = {k: v for k, v in shape.items() if v is not None}
        return MODEL_PRESETS[self.preset](init_std=self.init_std, **kernels, **overrides)


def check_hf_dir(directory: str) -> None:
    """Raises ValueError unless `directory` holds a Hugging Face checkpoint's config.json and
    weights (`model.safetensors`, or the shards' index)."""
    names = (hf_files.CONFIG_FILE, hf_files.SINGLE_FILE, hf_files.INDEX_FILE)
    have = [n for n in names if os.path.isfile(os.path.join(directory, n))]
    if hf_files.CONFIG_FILE not in have or len(have) < 2:
        raise ValueError(
            f"must be a directory holding {names[0]} and {names[1]} (or {names[2]}), got "
            f"{directory!r} (holding {have})"
        )


_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec))
