"""Experiment ConfigDicts become `ExperimentConfig`s in one place, with one set of defaults."""

from __future__ import annotations

import dataclasses
import importlib
import math
import pathlib
import re
import typing

import pytest
from ml_collections import config_dict

from configs import small_gpu, tiny_cpu
from trace_jax import tasks
from trace_jax.models import ModelConfig
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.config_dict import ConfigError, from_section
from trace_jax.rl.experiment import (
    SECTIONS,
    EvalConfig,
    ExperimentConfig,
    ModelSpec,
    RLConfig,
    SFTConfig,
    TaskConfig,
    experiment_config_dict,
)
from trace_jax.rl.workers import step_problems

CONFIGS = sorted(
    p.stem
    for p in (pathlib.Path(__file__).parents[2] / "configs").glob("*.py")
    if p.stem != "__init__"
)
# Every config with an `rl` section is an experiment config (the others configure benchmarks).
EXPERIMENT_CONFIGS = [
    name for name in CONFIGS if "rl" in importlib.import_module(f"configs.{name}").get_config()
]


def test_the_experiment_configs_are_found():
    assert {"tiny_cpu", "small_gpu", "table1_nvfp4", "table7_ptq"} <= set(EXPERIMENT_CONFIGS)


@pytest.mark.parametrize("name", EXPERIMENT_CONFIGS)
def test_every_experiment_config_converts(name):
    """Every experiment config converts (the method, recipe, guided layers, splits and task
    levels it names all resolve)."""
    cd = importlib.import_module(f"configs.{name}").get_config()
    config = ExperimentConfig.from_config_dict(cd)
    assert config.rl.method == cd.rl.method and config.rl.grpo.group_size == cd.rl.group_size
    assert config.method_setup().rollout_qcfg is not None


def test_defaults_are_the_dataclasses():
    """An all-default ConfigDict converts to the all-default config, field by field."""
    cd = experiment_config_dict()
    assert ExperimentConfig.from_config_dict(cd) == ExperimentConfig()
    assert cd.sft.to_dict() == dataclasses.asdict(SFTConfig())
    assert cd.eval.splits == EvalConfig().splits and cd.tasks.levels == TaskConfig().levels
    rl = {k: v for k, v in dataclasses.asdict(RLConfig()).items() if k != "grpo"}
    assert cd.rl.to_dict() == {**rl, **dataclasses.asdict(GRPOConfig())}
    assert cd.model.init_std == ModelConfig.tiny().init_std and cd.model.n_layers is None
    # None defaults are typed placeholders: an override of the wrong type is refused.
    cd.rl.dual_clip = 2.0
    with pytest.raises(TypeError):
        cd.model.n_layers = "two"


def test_section_overrides_and_unknown_names():
    cd = experiment_config_dict(seed=3, model={"n_layers": 2}, rl={"steps": 7, "beta": 0.05})
    config = ExperimentConfig.from_config_dict(cd)
    assert (config.seed, config.model.n_layers, config.rl.steps) == (3, 2, 7)
    assert config.rl.grpo.beta == 0.05
    with pytest.raises(ValueError, match=r"unknown config section\(s\) \['rll'\]"):
        experiment_config_dict(rll={"steps": 1})
    stepz = r"config section 'rl': unknown RLConfig \+ GRPOConfig fields \['stepz'\]"
    with pytest.raises(ValueError, match=stepz):
        experiment_config_dict(rl={"stepz": 1})


def test_grpo_hyper_parameters_reach_the_grpo_config():
    cd = tiny_cpu.get_config()
    cd.rl.update(clip_eps_high=0.28, tbpo_band=(0.1, 4.0), is_cap=None, max_staleness=1)
    grpo = ExperimentConfig.from_config_dict(cd).rl.grpo
    assert (grpo.clip_eps_high, grpo.tbpo_band, grpo.is_cap) == (0.28, (0.1, 4.0), None)
    assert (grpo.max_staleness, grpo.group_size, grpo.learning_rate) == (1, 4, 1e-4)


def test_unknown_fields_raise_naming_them_and_other_sections_are_ignored():
    cd = tiny_cpu.get_config()
    cd.table = config_dict.ConfigDict({"name": "t", "seeds": (0, 1)})  # a table's own section
    ExperimentConfig.from_config_dict(cd)
    cd.rl.clip_eps = 0.3
    cd.sft.epochs = 2
    with pytest.raises(ValueError, match=r"\['sft\.epochs', 'rl\.clip_eps'\]"):
        ExperimentConfig.from_config_dict(cd)


def test_model_n_layers_overrides_the_preset_when_set():
    cd = tiny_cpu.get_config()
    assert ExperimentConfig.from_config_dict(cd).model.n_layers == 4
    cd.model.n_layers = 3
    assert ExperimentConfig.from_config_dict(cd).model.n_layers == 3
    big = small_gpu.get_config()
    big.model.n_layers = 2
    model = ExperimentConfig.from_config_dict(big).model
    assert (model.n_layers, model.d_model, model.grouped_matmul) == (2, 512, "auto")
    cd.model.n_layers = 0
    with pytest.raises(ValueError, match="n_layers"):
        ExperimentConfig.from_config_dict(cd)
    cd.model.n_layers = None
    cd.model.preset = "huge"
    with pytest.raises(ValueError, match=r"model\.preset must be one of \[.*'tiny'\], got 'huge'"):
        ExperimentConfig.from_config_dict(cd)


def test_model_predecode_experts_reaches_the_model_config():
    """`--config.model.predecode_experts=True` (a bool-typed ConfigDict field, None by default)
    sets the built `ModelConfig`'s field; a value that is not a bool is refused."""
    cd = tiny_cpu.get_config()
    assert ExperimentConfig.from_config_dict(cd).model.predecode_experts is None
    cd.model.predecode_experts = True
    assert ExperimentConfig.from_config_dict(cd).model.predecode_experts is True
    with pytest.raises(TypeError):
        cd.model.predecode_experts = "yes"
    with pytest.raises(ValueError, match="predecode_experts must be None, True or False"):
        ModelSpec(predecode_experts="yes")


def test_model_spec_builds_its_preset_with_the_shape_fields_that_are_set():
    """What the benchmarks' `model` sections build: `ModelConfig.<preset>` with `n_layers` and
    `head_dim` replaced where set."""
    assert ModelSpec(preset="small").build() == ModelConfig.small()
    spec = ModelSpec(preset="tiny", n_layers=2, head_dim=32)
    assert spec.build() == ModelConfig.tiny(n_layers=2, head_dim=32)
    section = experiment_config_dict(model={"preset": "small", "head_dim": 32}).model
    assert from_section(ModelSpec, section).build() == ModelConfig.small(head_dim=32)
    with pytest.raises(ValueError, match=r"invalid ModelSpec: preset must be one of .*'huge'"):
        ModelSpec(preset="huge")


def test_model_section_sets_the_prefill_attention():
    """`--config.model.prefill_attention=auto` reaches the model (the rollouts' prefill chunks);
    a setting the model refuses is named under the section's field."""
    cd = tiny_cpu.get_config()
    assert ExperimentConfig.from_config_dict(cd).model.prefill_attention == "xla"
    cd.model.prefill_attention = "auto"
    assert ExperimentConfig.from_config_dict(cd).model.prefill_attention == "auto"
    cd.model.prefill_attention = "flash"
    with pytest.raises(ValueError, match=r"model\.prefill_attention.*gives no model"):
        ExperimentConfig.from_config_dict(cd)


def test_guided_layer_spec_reaches_the_method_setup():
    cd = tiny_cpu.get_config()
    half = ExperimentConfig.from_config_dict(cd).method_setup().capture
    cd.rl.guided_layers = "all"
    every = ExperimentConfig.from_config_dict(cd).method_setup().capture
    assert {k.split("/")[0] for k in half} == {"2", "3"}
    assert {k.split("/")[0] for k in every} == {"0", "1", "2", "3"}
    cd.rl.guided_layers = "0,7"
    with pytest.raises(ValueError, match="7"):
        ExperimentConfig.from_config_dict(cd)


def test_batch_splits_staleness_and_values_are_checked():
    cd = tiny_cpu.get_config()  # 8 prompts x 4 samples = 32 rollouts per step
    cd.mesh.data = 3
    with pytest.raises(ValueError, match=r"32 rollouts per step in 1 mini-batches do not split "):
        ExperimentConfig.from_config_dict(cd)
    cd.mesh.data = 1
    cd.rl.update(mini_batches=2, max_staleness=0)
    with pytest.raises(ValueError, match=r"rl\.mini_batches and rl\.max_staleness disagree"):
        ExperimentConfig.from_config_dict(cd)
    cd.rl.max_staleness = 2
    cd.disaggregated.lag = 1  # worst: 1 * 2 + 2 - 1 = 3 versions
    with pytest.raises(ValueError, match="trains guidance 3 versions stale > 2"):
        ExperimentConfig.from_config_dict(cd)
    cd.disaggregated.lag = 0
    ExperimentConfig.from_config_dict(cd)
    cd.rl.mini_batches = 3
    with pytest.raises(ValueError, match="32 rollouts per step do not split into 3 mini-batches"):
        ExperimentConfig.from_config_dict(cd)
    with pytest.raises(ValueError, match=r"splits must be one or more of .*'aime99'"):
        EvalConfig(splits=("arith_countdown_l2", "aime99"))
    with pytest.raises(ValueError, match="'aime24' is now 'arith_countdown_l2'"):
        EvalConfig(splits=("level1", "aime24"))
    with pytest.raises(ValueError, match=r"invalid RLConfig: method must be one of .*'grpo'"):
        RLConfig(method="grpo")
    with pytest.raises(ValueError, match="invalid SFTConfig: steps must be an int >= 1, got 0"):
        SFTConfig(steps=0)


def test_prompts_fit_the_prompt_width():
    """Every step pads its prompts to `tasks.prompt_width`: no training prompt is longer."""
    config = ExperimentConfig.from_config_dict(small_gpu.get_config())
    width = config.tasks.prompt_width
    lengths = [len(tasks.prompt_ids(p)) for s in range(20) for p in step_problems(config, s, 32)]
    assert max(lengths) <= width
    assert config.tasks.sft_row_length > width


def _experts(cd) -> int:
    return ExperimentConfig.from_config_dict(cd).model.n_experts


# Every numeric setting of an experiment config -> values it must refuse; a callable computes one
# from the config's other settings (a size that does not divide, a warmup as long as the run).
BAD_VALUES = {
    "seed": (-1,),
    "model.init_std": (0.0, -0.02, math.nan, math.inf),
    "model.n_layers": (0, -1),
    "model.head_dim": (0, -16, 15),  # RoPE needs an even width
    "tasks.levels": ((), (0,), (99,)),
    "sft.steps": (0, -1),
    "sft.batch_size": (0, -4),
    "sft.learning_rate": (0.0, -1e-3, math.nan),
    "sft.warmup_steps": (-1, lambda cd: cd.sft.steps),
    "sft.weight_decay": (-0.1, math.inf),
    "sft.log_every": (0, -1),
    "eval.problems_per_split": (0, -1),
    "eval.k": (0, -1),
    "eval.temperature": (-0.5, math.nan),
    "eval.max_new_tokens": (0, -1),
    "rl.steps": (0, -1),
    "rl.prompts_per_step": (0, -1),
    "rl.max_new_tokens": (0, -1),
    "rl.temperature": (-1.0, math.inf),
    "rl.mismatch_every": (-1,),
    "rl.eval_every": (-1,),
    "rl.checkpoint_every": (0, -1),
    "rl.group_size": (0, 1, -2),
    "rl.adv_eps": (-1e-6, math.nan),
    "rl.clip_eps_low": (0.0, 1.0, -0.2),
    "rl.clip_eps_high": (0.0, -0.2, math.inf),
    "rl.is_cap": (0.5, -1.0),
    "rl.beta": (-0.1, math.nan),
    "rl.dual_clip": (1.0, 0.5),
    "rl.tbpo_dual_clip": (1.0, 0.0),
    "rl.tbpo_band": ((1.0, 2.0), (0.2, 0.9), (-0.1, 5.0)),
    "rl.learning_rate": (0.0, -1e-4, math.inf),
    "rl.warmup_steps": (-1, lambda cd: cd.rl.steps * cd.rl.mini_batches),
    "rl.min_lr_ratio": (-0.1, 1.5),
    "rl.weight_decay": (-0.01,),
    "rl.adam_b1": (-0.1, 1.0),
    "rl.adam_b2": (1.0,),
    "rl.adam_eps": (0.0, -1e-8),
    "rl.grad_clip_norm": (0.0, -1.0),
    "rl.mini_batches": (0, -1, 3),  # 3 splits no batch of these configs
    "rl.max_staleness": (-1, lambda cd: cd.rl.mini_batches - 2),
    "mesh.data": (0, -1, 3),
    "mesh.expert": (0, -1, lambda cd: _experts(cd) + 1),
    "mesh.fsdp": (0, -1, 3),
    "disaggregated.lag": (-1, lambda cd: cd.rl.max_staleness + 1),
    "disaggregated.timeout_s": (0.0, -1.0, math.nan),
    "disaggregated.heartbeat_timeout_s": (0.0, -1.0),
}


def _numeric_settings() -> set[str]:
    """The dotted names of every int, float or tuple-of-numbers field of the sections."""
    out = {"seed"}
    for section, classes in SECTIONS.items():
        for cls in classes:
            for name, hint in typing.get_type_hints(cls).items():
                args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
                base = typing.get_origin(args[0]) or args[0]
                inner = typing.get_args(args[0])
                numbers = (int, float)
                if base in numbers or (base is tuple and inner and inner[0] in numbers):
                    out.add(f"{section}.{name}")
    return out


def test_the_bad_value_table_covers_every_numeric_setting():
    assert set(BAD_VALUES) == _numeric_settings()


# The experiment configs with distinct experiment sections (the tables share `small_gpu`'s).
DISTINCT_CONFIGS = {
    repr({s: cd[s].to_dict() for s in SECTIONS}): name
    for name in EXPERIMENT_CONFIGS
    for cd in [importlib.import_module(f"configs.{name}").get_config()]
}.values()


@pytest.mark.parametrize("name", sorted(DISTINCT_CONFIGS))
def test_every_bad_numeric_setting_is_refused_naming_it(name):
    """Each shipped experiment config, with each numeric setting set to each bad value in turn,
    is refused by the conversion with a ValueError that names the setting as the ConfigDict
    does (`sft.batch_size`), before anything is built."""
    module = importlib.import_module(f"configs.{name}")
    unrefused, unnamed = [], []
    for setting, values in BAD_VALUES.items():
        for value in values:
            cd = module.get_config()
            value = value(cd) if callable(value) else value
            *section, field = setting.split(".")
            (cd[section[0]] if section else cd)[field] = value
            try:
                ExperimentConfig.from_config_dict(cd)
            except ValueError as e:
                if not re.search(rf"(?<![\w.]){re.escape(setting)}(?!\w)", str(e)):
                    unnamed.append(f"{setting}={value!r}: {e}")
            else:
                unrefused.append(f"{setting}={value!r}")
    assert not unrefused, f"accepted: {unrefused}"
    assert not unnamed, "\n".join(unnamed)


def test_boundary_values_are_accepted_and_all_problems_reported_together():
    cd = tiny_cpu.get_config()
    cd.eval.temperature = 0.0  # greedy
    cd.rl.update(eval_every=0, mismatch_every=0, beta=0.0, adam_b1=0.0, min_lr_ratio=1.0)
    cd.rl.update(warmup_steps=cd.rl.steps - 1, clip_eps_low=0.99, is_cap=1.0)
    ExperimentConfig.from_config_dict(cd)
    cd.sft.batch_size, cd.rl.checkpoint_every, cd.mesh.expert = 0, 0, 0
    want = r"sft\.batch_size .*; rl\.checkpoint_every .*; mesh\.expert must be an int >= 1, got 0"
    with pytest.raises(ConfigError, match=want):
        ExperimentConfig.from_config_dict(cd)
