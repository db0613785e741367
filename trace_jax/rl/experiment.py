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

from trace_jax import data, tasks
from trace_jax.models import IMPLEMENTATION_SETTINGS, ModelConfig
from trace_jax.quant import QUANT_RECIPES, parse_layer_spec
from trace_jax.rl.config import GRPOConfig
from trace_jax.rl.config_dict import Checks, ConfigError, field_defaults, section_config_dict
from trace_jax.rl.exchange import location_config
from trace_jax.rl.methods import METHODS, MethodSetup, get_method
from trace_jax.rl.model_spec import MODEL_PRESETS as MODEL_PRESETS
from trace_jax.rl.model_spec import ModelSpec
from trace_jax.rl.model_spec import check_hf_dir as check_hf_dir
from trace_jax.tasks.splits import renamed_split_note


def _tuple(obj, field: str) -> None:
    """Freezes a sequence field of a frozen dataclass into a tuple (ConfigDicts may hold lists)."""
    object.__setattr__(obj, field, tuple(getattr(obj, field)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The training prompts, their tokenizer and their verifier (`trace_jax.data`'s kinds).

    dataset: "synthetic" (the generated tasks `kinds`, `tasks.TASKS`, at difficulty `levels`,
      `tasks.LEVELS`) or "file" (the JSONL / Parquet `train_file`).
    question_field, answer_field, solution_field, answer_extractor: where a file's records keep
      an example (`trace_jax.data.FileLayout`; solution_field "" = none, which rules out SFT).
    tokenizer: "char" (the generated tasks' 52 ids) or "hf" (the directory `tokenizer_dir`).
    verifier: "synthetic" (the tasks' exact checker) or "math" (math_verify).
    """

    dataset: str = "synthetic"
    kinds: tuple[str, ...] = ("arithmetic", "countdown", "program")
    levels: tuple[int, ...] = (1,)
    train_file: str = ""
    question_field: str = "question"
    answer_field: str = "answer"
    solution_field: str = ""
    answer_extractor: str = "none"
    tokenizer: str = "char"
    tokenizer_dir: str = ""
    verifier: str = "synthetic"

    def __post_init__(self):
        _tuple(self, "kinds")
        _tuple(self, "levels")
        c = Checks("TaskConfig")
        c.one_of(self, "dataset", data.DATASET_KINDS)
        c.one_of(self, "tokenizer", data.TOKENIZER_KINDS)
        c.one_of(self, "verifier", data.VERIFIER_KINDS)
        c.one_of(self, "answer_extractor", data.ANSWER_EXTRACTORS)
        for name, known in (("kinds", tasks.TASKS), ("levels", tasks.LEVELS)):
            value = getattr(self, name)
            ok = bool(value) and all(v in known for v in value)
            c.need(ok, name, f"must be one or more of {tuple(known)}, got {value}")
        if self.dataset == "file":
            _check_path(c, "train_file", data.check_examples_path, self.train_file)
            for name in ("question_field", "answer_field"):
                c.need(bool(getattr(self, name)), name, "must name a field, got ''")
            c.need(
                self.verifier != "synthetic",
                "verifier",
                "must be 'math' for dataset 'file' (the synthetic verifier checks generated "
                "problems only)",
            )
        if self.tokenizer == "hf":
            _check_path(c, "tokenizer_dir", data.check_tokenizer_dir, self.tokenizer_dir)
        c.raise_any()

    def layout(self) -> data.FileLayout:
        """Where this config's example files keep questions, answers and solutions."""
        return data.FileLayout(
            question_field=self.question_field,
            answer_field=self.answer_field,
            solution_field=self.solution_field,
            answer_extractor=self.answer_extractor,
        )

    def make_tokenizer(self) -> data.Tokenizer:
        return data.load_tokenizer(self.tokenizer, self.tokenizer_dir)

    def make_dataset(self) -> data.PromptDataset:
        kw = dict(kinds=self.kinds, levels=self.levels, path=self.train_file)
        return data.make_dataset(self.dataset, layout=self.layout(), **kw)

    def make_verifier(self) -> data.Verifier:
        return data.make_verifier(self.verifier)

    @property
    def prompt_width(self) -> int:
        """Tokens of the longest training prompt (BOS or chat template included): every RL step
        pads its prompts to it, so the sampler compiles once."""
        return self.make_dataset().prompt_width(self.make_tokenizer())

    @property
    def sft_row_length(self) -> int:
        """Tokens of the longest SFT row (prompt + solution + EOS), for one compile (for the
        generated tasks, over the short-response tasks plus the run's own kinds at these levels:
        every mix of short tasks shares the shape, a long-response task widens it)."""
        return self.make_dataset().sft_row_length(self.make_tokenizer())


def _check_path(c: Checks, setting: str, check, path: str) -> None:
    """Records `check(path)`'s ValueError as a problem of `setting`."""
    try:
        check(path)
    except ValueError as e:
        c.need(False, setting, str(e))


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
        c = Checks("SFTConfig")
        c.ints(self, ("steps", "batch_size", "log_every"), 1)
        c.ints(self, ("warmup_steps",), 0)
        c.number(self, "learning_rate", "> 0", lambda x: x > 0)
        c.number(self, "weight_decay", ">= 0", lambda x: x >= 0)
        if not c.problems:
            c.need(
                self.warmup_steps < self.steps,
                "warmup_steps",
                f"must be < steps={self.steps}, got {self.warmup_steps}",
            )
        c.raise_any()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """Held-out evaluation: pass@1 over `k` samples of the first `problems_per_split` problems of
    each set, the generated splits `splits` (`tasks.SPLIT_NAMES`) and the example files `files`
    (JSONL / Parquet in the `tasks` section's layout, each named by its file name without the
    suffix); temperature 0 is greedy decoding.

    `in_bf16_too`: the RL loop's evaluations of an FP4 method score its policy run in bf16 as
    well, beside its own FP4 execution (`<set>@bf16` in `rl_eval.jsonl`): what training did to
    the policy, apart from what FP4 execution costs it."""

    splits: tuple[str, ...] = (
        "level1",
        "arith_countdown_l2",
        "arith_countdown_l3",
        "arith_countdown_l4",
        "program_l2to4",
    )
    files: tuple[str, ...] = ()
    problems_per_split: int = 48
    k: int = 1
    temperature: float = 0.0
    max_new_tokens: int = 64
    in_bf16_too: bool = False

    def __post_init__(self):
        _tuple(self, "splits")
        _tuple(self, "files")
        c = Checks("EvalConfig")
        ok = all(s in tasks.SPLIT_NAMES for s in self.splits)
        c.need(
            ok,
            "splits",
            f"must be one or more of {tasks.SPLIT_NAMES}, got {self.splits}"
            + renamed_split_note(self.splits),
        )
        for path in self.files:
            _check_path(c, "files", data.check_examples_path, path)
        names = self.set_names
        c.need(bool(names), ("splits", "files"), "name no held-out set")
        c.need(
            len(set(names)) == len(names),
            ("splits", "files"),
            f"must name distinct sets (a file is named by its file name), got {names}",
        )
        c.ints(self, ("problems_per_split", "k", "max_new_tokens"), 1)
        c.number(self, "temperature", ">= 0", lambda x: x >= 0)
        c.need(
            isinstance(self.in_bf16_too, bool),
            "in_bf16_too",
            f"must be a bool, got {self.in_bf16_too!r}",
        )
        c.raise_any()

    @property
    def set_names(self) -> tuple[str, ...]:
        """The held-out sets' names: `splits`, then each file's name without its suffix."""
        return (*self.splits, *map(data.held_out_name, self.files))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Devices of a run, a (data, fsdp, expert) mesh (`trace_jax.rl.sharding`): `data` and
    `fsdp` split each rollout batch (rows), `fsdp` also every parameter matrix and its optimizer
    state (FSDP), `expert` the routed experts (along E); 1 x 1 x 1 is one device without
    sharding."""

    data: int = 1
    expert: int = 1
    fsdp: int = 1

    def __post_init__(self):
        c = Checks("MeshConfig")
        c.ints(self, ("data", "expert", "fsdp"), 1)
        c.raise_any()


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig:
    """The GRPO loop.

    method: a registered method (`trace_jax.rl.get_method`). format: its FP4 recipe.
    guided_layers: a guided-layer spec overriding the method's own ("all", "half", "quarter",
      "eighth", "0,3"); "" keeps the method's.
    init_from: the SFT checkpoint the policy starts from ("" = random initialization).
    steps: RL steps; each samples `prompts_per_step` training problems x `grpo.group_size`.
    max_new_tokens, temperature: the rollout's sampling.
    rollout_implementation: the rollout's and evaluation's kernels, "auto" (the Pallas FP4 kernels
      on a GPU or a TPU, XLA elsewhere: `trace_jax.models.resolve_implementation`), "pallas" or
      "xla".
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
    rollout_implementation: str = "auto"
    mismatch_every: int = 5
    eval_every: int = 10
    checkpoint_every: int = 10
    grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)

    def __post_init__(self):
        object.__setattr__(self, "guided_layers", self.guided_layers or "")
        object.__setattr__(self, "init_from", self.init_from or "")
        c = Checks("RLConfig")
        c.one_of(self, "method", METHODS)
        c.one_of(self, "format", QUANT_RECIPES)
        c.one_of(self, "rollout_implementation", IMPLEMENTATION_SETTINGS)
        try:
            parse_layer_spec(self.guided_layers or "all")  # "" keeps the method's own
        except ValueError as e:
            c.need(False, "guided_layers", f"is not a layer spec: {e}")
        c.ints(self, ("steps", "prompts_per_step", "max_new_tokens", "checkpoint_every"), 1)
        c.ints(self, ("mismatch_every", "eval_every"), 0)
        c.number(self, "temperature", ">= 0", lambda x: x >= 0)
        c.raise_any()

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
    timeout_s: how long either process waits for the other's next object.
    heartbeat_timeout_s: how long the other's heartbeat may stay unchanged before it counts as
      dead (the waiting process then exits).
    exchange: where the two pass everything (`trace_jax.rl.exchange`): a kvstore URL
      ("s3://bucket/prefix/", "gs://bucket/prefix/") or a directory; "": the workdir.
    exchange_s3_endpoint, exchange_s3_region, exchange_s3_credentials: `S3Options` of an
      "s3://" exchange ("": unset).
    """

    lag: int = 0
    timeout_s: float = 600.0
    heartbeat_timeout_s: float = 10.0
    exchange: str = ""
    exchange_s3_endpoint: str = ""
    exchange_s3_region: str = ""
    exchange_s3_credentials: str = "default"

    def __post_init__(self):
        c = Checks("DisaggregatedConfig")
        c.ints(self, ("lag",), 0)
        c.number(self, "timeout_s", "> 0", lambda x: x > 0)
        c.number(self, "heartbeat_timeout_s", "> 0", lambda x: x > 0)
        s3 = ("exchange_s3_endpoint", "exchange_s3_region", "exchange_s3_credentials")
        settings = {n.removeprefix("exchange_"): getattr(self, n) for n in s3}
        try:
            location_config(self.exchange, **settings)
        except ValueError as e:
            c.need(False, ("exchange", *s3), str(e))
        c.raise_any()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExperimentConfig:
    """Everything an SFT or RL run of the library reads; see the module docstring.
    model_hf_dir: the `model.hf_dir` setting (`ModelSpec`), the checkpoint `model` comes from."""

    seed: int = 0
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig.tiny)
    model_hf_dir: str = ""
    tasks: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    disaggregated: DisaggregatedConfig = dataclasses.field(default_factory=DisaggregatedConfig)

    def __post_init__(self):
        """Checks what no one section can: the settings named as in the ConfigDict."""
        rl, grpo, lag = self.rl, self.rl.grpo, self.disaggregated.lag
        data = self.mesh.data * self.mesh.fsdp  # the batch splits over both
        m, rows = grpo.mini_batches, rl.rollouts_per_step
        batch = ("rl.prompts_per_step", "rl.group_size", "rl.mini_batches")
        per_step = f"{rl.prompts_per_step} x {grpo.group_size} = {rows} rollouts per step"
        c = Checks("ExperimentConfig")
        c.ints(self, ("seed",), 0)
        c.need(rows % m == 0, batch, f"disagree: {per_step} do not split into {m} mini-batches")
        c.need(
            rows % m != 0 or rows % (m * data) == 0,
            (*batch, "mesh.data", "mesh.fsdp"),
            f"disagree: {per_step} in {m} mini-batches do not split over {data} devices",
        )
        # The disaggregated trainer's stalest mini-batch: sampled `lag` steps back, then m - 1
        # optimizer steps into its own step.
        worst = lag * m + m - 1
        c.need(
            worst <= grpo.max_staleness,
            ("disaggregated.lag", "rl.mini_batches", "rl.max_staleness"),
            f"disagree: lag {lag} with {m} mini-batches trains guidance {worst} versions stale "
            f"> {grpo.max_staleness}",
        )
        c.need(
            grpo.warmup_steps < rl.steps * m,
            ("rl.warmup_steps", "rl.steps", "rl.mini_batches"),
            f"disagree: a warmup of {grpo.warmup_steps} optimizer steps must end before the "
            f"run's {rl.steps} x {m} = {rl.steps * m}",
        )
        c.need(
            self.model.n_experts % self.mesh.expert == 0,
            ("mesh.expert", "model.n_experts"),
            f"disagree: {self.mesh.expert} devices must split {self.model.n_experts} experts",
        )
        try:  # the method, recipe and guided layers resolve for this model
            self.method_setup()
        except ValueError as e:
            c.need(False, "rl.guided_layers", f"must resolve for this model and method: {e}")
        c.raise_any()

    def method_setup(self) -> MethodSetup:
        """The RL method resolved for the recipe, the guided-layer spec and the model depth."""
        return get_method(self.rl.method).setup(
            self.rl.format, self.model.n_layers, guided_layers=self.rl.guided_layers or None
        )

    @classmethod
    def from_config_dict(cls, cd: ml_collections.ConfigDict) -> ExperimentConfig:
        """The library config of an experiment ConfigDict (the layout `experiment_config_dict`
        builds). Missing fields take their defaults; sections other than the known ones (a
        table's `table`) are ignored; an unknown field of a known section is a ValueError.

        Raises `ConfigError` (a ValueError) naming every bad setting as the ConfigDict does
        (`sft.batch_size must be an int >= 1, got 0`): nothing is built from a bad config.
        """
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
        rl = sections["rl"]
        grpo_fields = {k: rl.pop(k) for k in list(rl) if k in _GRPO_FIELDS}
        problems = []

        def build(section: str, make):
            try:
                return make()
            except ConfigError as e:
                problems.extend(e.within(section))
                return None

        built = {}
        for name in SECTIONS:  # problems in the sections' order
            if name == "model":
                spec = build(name, lambda: ModelSpec(**sections["model"]))
                built[name] = spec and spec.build()
                built["model_hf_dir"] = spec.hf_dir if spec else ""
            elif name == "rl":
                loop = build(name, lambda: RLConfig(**rl))
                grpo = build(name, lambda: GRPOConfig(**grpo_fields))
                built[name] = loop and grpo and dataclasses.replace(loop, grpo=grpo)
            else:
                built[name] = build(name, lambda c=_PLAIN_SECTIONS[name], n=name: c(**sections[n]))
        seed = d.get("seed", 0)
        if problems:
            raise ConfigError("experiment config", problems)
        try:
            return cls(seed=seed, **built)
        except ConfigError as e:
            raise ConfigError("experiment config", e.problems) from None


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
# The sections whose dataclass is the ExperimentConfig field itself.
_PLAIN_SECTIONS = {
    "tasks": TaskConfig,
    "sft": SFTConfig,
    "eval": EvalConfig,
    "mesh": MeshConfig,
    "disaggregated": DisaggregatedConfig,
}


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
