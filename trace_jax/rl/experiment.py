r"""An experiment's settings as frozen library configs, and the one conversion from a ConfigDict.

  cd = experiment_config_dict(model={"preset": "tiny"}, rl={"steps": 20, "group_size": 4})
  config = ExperimentConfig.from_config_dict(cd)   # what RLLoop and run_sft take

The ConfigDict (what `configs/*.py` return and `--config.<section>.<field>=...` overrides) has a
top-level `seed` and one section per dataclass below: `model` (`ModelSpec`: a preset and its
overrides), `tasks`, `sft`, `eval`, `rl`, `mesh`, `disaggregated`. The `rl` section holds
`RLConfig`'s loop fields and every `GRPOConfig` field side by side (`rl.steps`, `rl.group_size`,
`rl.clip_eps_high`, ...). Every default is the dataclass field's default: `experiment_config_dict`
reads them from the dataclasses, so no config file restates one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from trace_jax import tasks
from trace_jax.models import ModelConfig
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.config_dict import field_defaults, section_config_dict
from trace_jax.rl.methods import MethodSetup, get_method

MODEL_PRESETS = {"tiny": ModelConfig.tiny, "small": ModelConfig.small}


class _Checks:
    """Collects every violated condition of a config, to raise them together."""

    def __init__(self, name: str):
        self.name, self.errors = name, []

    def need(self, ok: bool, message: str) -> None:
        if not ok:
            self.errors.append(message)

    def raise_any(self) -> None:
        if self.errors:
            raise ValueError(f"invalid {self.name}: " + "; ".join(self.errors))


def _tuple(obj, field: str) -> None:
    """Freezes a sequence field of a frozen dataclass into a tuple (ConfigDicts may hold lists)."""
    object.__setattr__(obj, field, tuple(getattr(obj, field)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The `model` section: a `ModelConfig` preset and the fields an experiment overrides.

    preset: a key of `MODEL_PRESETS`. init_std, grouped_matmul: as `ModelConfig`'s fields.
    n_layers: the preset's decoder-block count unless set (tests cut `tiny` to 2 blocks).
    head_dim: the preset's per-head width unless set (the benchmarks' CPU smoke runs widen it).
    """

    preset: str = "tiny"
    init_std: float = ModelConfig.init_std
    grouped_matmul: str = ModelConfig.grouped_matmul
    n_layers: int | None = None
    head_dim: int | None = None

    def __post_init__(self):
        if self.preset not in MODEL_PRESETS:
            raise ValueError(
                f"unknown model preset {self.preset!r}; expected one of {sorted(MODEL_PRESETS)}"
            )

    def build(self) -> ModelConfig:
        """The `ModelConfig` this spec names (its own checks reject bad overrides)."""
        shape = {"n_layers": self.n_layers, "head_dim": self.head_dim}
        overrides = {k: v for k, v in shape.items() if v is not None}
        return MODEL_PRESETS[self.preset](
            init_std=self.init_std, grouped_matmul=self.grouped_matmul, **overrides
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """Training problems: task kinds (`tasks.TASKS`) at difficulty levels (`tasks.LEVELS`)."""

    kinds: tuple[str, ...] = ("arithmetic", "countdown", "program")
    levels: tuple[int, ...] = (1,)

    def __post_init__(self):
        _tuple(self, "kinds")
        _tuple(self, "levels")
        c = _Checks("TaskConfig")
        c.need(bool(self.kinds), "kinds is empty")
        c.need(bool(self.levels), "levels is empty")
        bad = [k for k in self.kinds if k not in tasks.TASKS]
        c.need(not bad, f"kinds {bad} are not tasks; expected some of {tasks.TASKS}")
        bad = [lv for lv in self.levels if lv not in tasks.LEVELS]
        c.need(not bad, f"levels {bad} are not levels; expected some of {tasks.LEVELS}")
        c.raise_any()

    @property
    def prompt_width(self) -> int:
        """Tokens of the longest prompt (BOS included) of these kinds and levels: every RL step
        pads its prompts to it, so the sampler compiles once."""
        return 1 + max(
            tasks.level_spec(t, lv).max_prompt_tokens for t in self.kinds for lv in self.levels
        )

    @property
    def sft_row_length(self) -> int:
        """Tokens of an SFT row (BOS + prompt + solution + EOS) at these levels, for one compile.
        Taken over every task, not only `kinds`, so that every task mix shares the shape."""
        caps = [
            tasks.level_spec(t, lv).max_prompt_tokens + tasks.level_spec(t, lv).max_solution_tokens
            for t in tasks.TASKS
            for lv in self.levels
        ]
        return max(caps) + 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """The supervised warm start: `steps` AdamW steps of `batch_size` worked solutions, linear
    warmup then cosine decay (`trace_jax.rl.config.make_schedule`); a metrics row every
    `log_every` steps."""

    steps: int = 600
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    log_every: int = 50

    def __post_init__(self):
        c = _Checks("SFTConfig")
        for name in ("steps", "batch_size", "log_every"):
            c.need(getattr(self, name) >= 1, f"{name} must be >= 1; got {getattr(self, name)}")
        c.need(self.learning_rate > 0, f"learning_rate must be > 0; got {self.learning_rate}")
        c.need(
            0 <= self.warmup_steps < self.steps,
            f"warmup_steps must be in [0, steps={self.steps}); got {self.warmup_steps}",
        )
        c.need(self.weight_decay >= 0, f"weight_decay must be >= 0; got {self.weight_decay}")
        c.raise_any()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation: pass@1 over `k` samples of the first `problems_per_split` problems of
    each split (`tasks.SPLIT_NAMES`); temperature 0 is greedy decoding."""

    splits: tuple[str, ...] = ("level1", "aime24", "aime25", "hmmt25", "livecodebench")
    problems_per_split: int = 48
    k: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 64

    def __post_init__(self):
        _tuple(self, "splits")
        c = _Checks("EvalConfig")
        bad = [s for s in self.splits if s not in tasks.SPLIT_NAMES]
        c.need(not bad, f"splits {bad} are not splits; expected some of {tasks.SPLIT_NAMES}")
        for name in ("problems_per_split", "k", "max_new_tokens"):
            c.need(getattr(self, name) >= 1, f"{name} must be >= 1; got {getattr(self, name)}")
        c.need(self.temperature >= 0, f"temperature must be >= 0; got {self.temperature}")
        c.raise_any()


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Devices of a run: `data` splits each rollout batch (rows), `expert` the routed experts
    (along E); 1 x 1 is one device without sharding."""

    data: int = 1
    expert: int = 1

    def __post_init__(self):
        if self.data < 1 or self.expert < 1:
            raise ValueError(f"mesh sizes must be >= 1; got data={self.data}, expert={self.expert}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The GRPO loop.

    method: a registered method (`trace_jax.rl.get_method`). format: its FP4 recipe.
    guided_layers: a guided-layer spec overriding the method's own ("all", "half", "quarter",
      "eighth", "0,3"); "" keeps the method's.
    init_from: the SFT checkpoint the policy starts from ("" = random initialization).
    steps: RL steps; each samples `prompts_per_step` training problems x `grpo.group_size`.
    max_new_tokens, temperature: the rollout's sampling.
    mismatch_every: steps between per-site code-mismatch measurements of FP4 rollouts (0: never).
    eval_every: steps between held-out evaluations (0: never).
    checkpoint_every: steps between checkpoints (the final step is always saved).
    grpo: the update's hyper-parameters (mini-batches and staleness included).
    """

    method: str = "trace"
    format: str = "nvfp4"
    guided_layers: str = ""
    init_from: str = ""
    steps: int = 20
    prompts_per_step: int = 8
    max_new_tokens: int = 48
    temperature: float = 1.0
    mismatch_every: int = 5
    eval_every: int = 10
    checkpoint_every: int = 10
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)

    def __post_init__(self):
        object.__setattr__(self, "guided_layers", self.guided_layers or "")
        object.__setattr__(self, "init_from", self.init_from or "")
        c = _Checks("RLConfig")
        for name in ("steps", "prompts_per_step", "max_new_tokens", "checkpoint_every"):
            c.need(getattr(self, name) >= 1, f"{name} must be >= 1; got {getattr(self, name)}")
        for name in ("mismatch_every", "eval_every"):
            c.need(getattr(self, name) >= 0, f"{name} must be >= 0; got {getattr(self, name)}")
        c.need(self.temperature >= 0, f"temperature must be >= 0; got {self.temperature}")
        c.raise_any()
        get_method(self.method)  # raises naming the registered methods

    @property
    def run_id(self) -> str:
        """The run's name in the guidance store."""
        return f"{self.method}_{self.format}"

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.grpo.group_size


@dataclasses.dataclass(frozen=True, kw_only=True)
class DisaggregatedConfig:
    """Rollout and trainer as two processes (`trace_jax.rl.disaggregated`).

    lag: RL steps the rollout process may run ahead of the trainer (0: lock step).
    timeout_s: how long either process waits for the other's next file.
    """

    lag: int = 0
    timeout_s: float = 600.0

    def __post_init__(self):
        if self.lag < 0 or self.timeout_s <= 0:
            raise ValueError(f"need lag >= 0 and timeout_s > 0; got {self.lag}, {self.timeout_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """Everything an SFT or RL run of the library reads; see the module docstring."""

    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    disaggregated: DisaggregatedConfig = dataclasses.field(default_factory=DisaggregatedConfig)

    def __post_init__(self):
        rl, m, data = self.rl, self.rl.grpo.mini_batches, self.mesh.data
        rows = rl.rollouts_per_step
        if rows % m:
            raise ValueError(f"{rows} rollouts per step do not split into {m} equal mini-batches")
        if rows % (m * data):
            raise ValueError(
                f"{rows} rollouts per step in {m} mini-batches do not split over "
                f"mesh.data={data} devices"
            )
        # The disaggregated trainer's stalest mini-batch: sampled `lag` steps back, then m - 1
        # optimizer steps into its own step.
        worst = self.disaggregated.lag * m + m - 1
        if worst > rl.grpo.max_staleness:
            raise ValueError(
                f"disaggregated.lag={self.disaggregated.lag} with {m} mini-batches trains "
                f"guidance {worst} versions stale; max_staleness is {rl.grpo.max_staleness}"
            )
        self.method_setup()  # the method, recipe and guided layers resolve for this model

    def method_setup(self) -> MethodSetup:
        """The RL method resolved for the recipe, the guided-layer spec and the model depth."""
        return get_method(self.rl.method).setup(
            self.rl.format, self.model.n_layers, guided_layers=self.rl.guided_layers or None
        )

    @classmethod
    def from_config_dict(cls, cd: ml_collections.ConfigDict) -> ExperimentConfig:
        """The library config of an experiment ConfigDict (the layout `experiment_config_dict`
        builds). Missing fields take their defaults; sections other than the known ones (a
        table's `table`) are ignored; an unknown field of a known section is a ValueError."""
        d = cd.to_dict() if isinstance(cd, ml_collections.ConfigDict) else dict(cd)
        sections = {name: dict(d.get(name) or {}) for name in SECTIONS}
        unknown = [
            f"{name}.{field}"
            for name, fields in sections.items()
            for field in sorted(set(fields) - set(section_defaults(name)))
        ]
        if unknown:
            raise ValueError(
                f"unknown field(s) {unknown} in the experiment config (the sections' fields: "
                "`trace_jax.rl.experiment.section_defaults`)"
            )
        rl = sections.pop("rl")
        grpo = {k: rl.pop(k) for k in list(rl) if k in _GRPO_FIELDS}
        return cls(
            seed=int(d.get("seed", 0)),
            model=ModelSpec(**sections.pop("model")).build(),
            tasks=TaskConfig(**sections.pop("tasks")),
            sft=SFTConfig(**sections.pop("sft")),
            eval=EvalConfig(**sections.pop("eval")),
            rl=RLConfig(**rl, grpo=GRPOConfig(**grpo)),
            mesh=MeshConfig(**sections.pop("mesh")),
            disaggregated=DisaggregatedConfig(**sections.pop("disaggregated")),
        )


# ConfigDict section -> the dataclasses whose fields it holds (`rl`: the loop's and GRPO's).
SECTIONS: dict[str, tuple[type, ...]] = {
    "model": (ModelSpec,),
    "tasks": (TaskConfig,),
    "sft": (SFTConfig,),
    "eval": (EvalConfig,),
    "rl": (RLConfig, GRPOConfig),
    "mesh": (MeshConfig,),
    "disaggregated": (DisaggregatedConfig,),
}
_GRPO_FIELDS = frozenset(f.name for f in dataclasses.fields(GRPOConfig))


def section_defaults(name: str) -> dict[str, Any]:
    """Field -> default of the ConfigDict section `name` (`config_dict.field_defaults`)."""
    if name not in SECTIONS:
        raise ValueError(f"unknown config section {name!r}; expected {sorted(SECTIONS)}")
    return field_defaults(*SECTIONS[name])


def experiment_config_dict(
    *, seed: int = 0, **sections: dict[str, Any]
) -> ml_collections.ConfigDict:
    """An experiment ConfigDict: every field of every section at its dataclass default (a None
    default becomes a typed placeholder, so an override is type-checked), then `sections`'
    values, e.g. `experiment_config_dict(rl={"steps": 20, "group_size": 4})`.

    Raises ValueError naming an unknown section or field.
    """
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown config section(s) {unknown}; expected {sorted(SECTIONS)}")
    cd = ml_collections.ConfigDict()
    cd.seed = seed
    for name, classes in SECTIONS.items():
        try:
            cd[name] = section_config_dict(*classes, **(sections.get(name) or {}))
        except ValueError as e:
            raise ValueError(f"config section {name!r}: {e}") from None
    return cd
