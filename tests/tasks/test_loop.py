"""Loop programs, the long-response task: traces checked step by step against an interpreter,
answers verified, lengths in each level's band, held-out splits, and the long-regime config."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from configs import small_gpu, table1_long
from trace_jax import tasks
from trace_jax.rl.experiment import ExperimentConfig
from trace_jax.tables.grid import Table, benchmark_splits
from trace_jax.tasks import loop
from trace_jax.tasks.tokenizer import ANSWER_MARKER

N_PER_LEVEL = 60
BANDS = {1: (96, 128), 2: (192, 256), 3: (384, 512), 4: (768, 1024), 5: (1536, 2048)}
LOOP_SPLITS = ("loop_l2", "loop_l3", "loop_l4", "loop_l5")
_ENTRY = re.compile(r"([a-z])=(\d+)([-+])(\d+)=(\d+)")


@pytest.fixture(scope="module")
def problems() -> dict[int, list[tasks.Problem]]:
    out = {}
    for level in tasks.LEVELS:
        rng = np.random.default_rng([11, level])
        out[level] = [tasks.generate("loop", rng, level) for _ in range(N_PER_LEVEL)]
    return out


def _program(prompt: str):
    """(initial values, body statements as (target, source, op, operand)) read off a prompt."""
    head, rest = prompt.split("do ")
    init = {s[0]: int(s[2:]) for s in head.rstrip(";").split(";")}
    body = rest.split(":", 1)[1].rsplit(";?", 1)[0].split(";")
    return init, [(s[0], s[2], s[3], s[4:]) for s in body]


def _check_trace(p: tasks.Problem) -> None:
    """Every written step reads the current values, computes mod 100 and writes what the
    interpreter (`loop.run`) has after that iteration; the answer is the queried final value."""
    query, states = loop.run(p.prompt)
    env, body = _program(p.prompt)
    assert sorted(s[0] for s in body) == sorted(env)  # each variable assigned once an iteration
    feeds = {(read, s[0]) for s in body for read in (s[1], s[3]) if read.isalpha()}
    for _ in env:  # transitive closure: every variable's value reaches every other's
        feeds |= {(a, d) for a, b in feeds for c, d in feeds if b == c}
    assert {(a, b) for a in env for b in env} <= feeds, p.prompt
    work, answer = p.solution.split(ANSWER_MARKER)
    iterations = work.split(";")
    assert len(iterations) == len(states) == int(p.prompt.split("do ")[1].split(":")[0])
    for i, (iteration, state) in enumerate(zip(iterations, states, strict=True), start=1):
        head, entries = iteration.split(":")
        assert head == str(i)
        for entry, (target, source, op, operand) in zip(entries.split(","), body, strict=True):
            x, a, written_op, b, value = _ENTRY.fullmatch(entry).groups()
            assert (x, written_op) == (target, op)
            assert int(a) == env[source]
            assert int(b) == (env[operand] if operand.isalpha() else int(operand))
            assert int(value) == (int(a) + int(b) if op == "+" else int(a) - int(b)) % 100
            env[target] = int(value)
        assert env == state
    assert answer == p.answer == str(states[-1][query])


def test_traces_match_the_interpreter_and_earn_full_reward(problems):
    for level, ps in problems.items():
        for p in ps:
            assert (p.task, p.difficulty) == (tasks.TaskKind.LOOP, level)
            _check_trace(p)
            assert tasks.reward(p, tasks.solution_ids(p)) == 1.0, p


def test_wrong_or_malformed_answers_fail(problems):
    for p in problems[2][:20]:
        work = p.solution.split(ANSWER_MARKER)[0]
        off_by_one = str((int(p.answer) + 1) % 100)
        assert tasks.reward(p, work + ANSWER_MARKER + off_by_one) == 0.0
        assert tasks.score(p, work + ANSWER_MARKER + off_by_one).well_formed
        assert tasks.reward(p, work + ANSWER_MARKER + "0" + p.answer) == 0.0  # not canonical
        assert tasks.reward(p, work) == 0.0  # no answer marker
        assert tasks.reward(p, tasks.solution_ids(p)[:-1]) == 0.0  # cut off before EOS
        assert tasks.reward(p, ANSWER_MARKER + p.answer) == 1.0  # only the answer is checked


def test_solution_lengths_fall_in_each_level_band(problems):
    """Levels give about 128, 256, 512, 1024 and 2048 tokens of solution (EOS included);
    prompts stay short."""
    means = []
    for level, ps in problems.items():
        low, high = BANDS[level]
        stats = tasks.split_stats(ps)
        lengths = [len(tasks.solution_ids(p)) for p in ps]
        assert (stats["min_solution_tokens"], stats["max_solution_tokens"]) == (
            min(lengths),
            max(lengths),
        )
        assert low <= min(lengths) and max(lengths) <= high, (level, stats)
        assert 0.8 * high <= stats["mean_solution_tokens"] <= 0.95 * high, (level, stats)
        spec = tasks.level_spec("loop", level)
        assert (spec.min_solution_tokens, spec.max_solution_tokens) == (low, high)
        assert stats["max_prompt_tokens"] <= spec.max_prompt_tokens < 128
        means.append(stats["mean_solution_tokens"])
    assert means == sorted(means)


def test_generation_is_a_pure_function_of_the_seed():
    for level in (1, 5):
        assert tasks.generate("loop", 7, level) == tasks.generate("loop", 7, level)
        a, b = (tasks.generate("loop", np.random.default_rng(3), level) for _ in range(2))
        assert a == b
    rng = np.random.default_rng(5)
    prompts = {tasks.generate("loop", rng, 3).prompt for _ in range(40)}
    assert len(prompts) == 40


def test_interpreter_rejects_malformed_programs():
    assert loop.run("a=1;b=2;do 2:a=a+b;b=a-1;?b") == ("b", [{"a": 3, "b": 2}, {"a": 5, "b": 4}])
    assert loop.run("a=5;b=0;do 1:a=b-7;b=a+a;?a") == ("a", [{"a": 93, "b": 86}])
    for bad in (
        "a=1;do 2:a=a+1",  # no query
        "a=1;do 2:a=c+1;?a",  # reads an undefined variable
        "a=1;do 2:a=a*2;?a",  # no multiplication
        "a=01;do 2:a=a+1;?a",  # leading zero
        "a=1;do 0:a=a+1;?a",  # no iterations
        "a=1;do 2:a=a+1;?b",  # queries an undefined variable
    ):
        with pytest.raises(ValueError):
            loop.run(bad)


def test_held_out_splits_rise_in_length_and_are_disjoint_from_training():
    splits = {name: tasks.eval_split(name) for name in LOOP_SPLITS}
    means = []
    for ps, level in zip(splits.values(), (2, 3, 4, 5), strict=True):
        low, high = BANDS[level]
        stats = tasks.split_stats(ps)
        assert low <= stats["min_solution_tokens"] <= stats["max_solution_tokens"] <= high
        means.append(stats["mean_solution_tokens"])
    assert means == sorted(means) and means[-1] > 1536, means
    held_out = {p.prompt for ps in splits.values() for p in ps}
    assert len(held_out) == 4 * 96 and held_out <= tasks.held_out_prompts()
    train = tasks.train_stream(0, tasks=["loop"], levels=tasks.LEVELS)
    trained = [p.prompt for p in itertools.islice(train, 1000)]
    assert not held_out & set(trained)


@pytest.mark.parametrize("variant", [None, "full_length", *table1_long.PILOTS])
def test_long_config_validates_and_fits_the_tasks(variant):
    cd = table1_long.get_config(variant)
    config = ExperimentConfig.from_config_dict(cd)
    table = Table.from_config_dict(cd)
    full = variant == "full_length"
    splits = LOOP_SPLITS if full else LOOP_SPLITS[:3]  # the pilots' regime stops at 1024
    assert config.tasks.kinds == ("loop",) and config.eval.splits == splits
    assert benchmark_splits(config.eval.splits) == list(splits)  # the table averages them
    longest = max(tasks.level_spec("loop", lv).max_solution_tokens for lv in config.tasks.levels)
    assert config.rl.max_new_tokens >= longest and config.eval.max_new_tokens >= longest
    held_out = [p for s in splits for p in tasks.eval_split(s)]
    assert config.eval.max_new_tokens >= max(len(tasks.solution_ids(p)) for p in held_out)
    prompt_cap = max(tasks.level_spec("loop", lv).max_prompt_tokens for lv in config.tasks.levels)
    assert config.tasks.prompt_width >= prompt_cap
    assert config.tasks.sft_row_length >= prompt_cap + longest
    pilot = table1_long.PILOTS.get(variant, table1_long.TABLE)
    assert tuple(table.seeds) == ((0, 1, 2) if full else pilot["seeds"])
    assert config.model.remat  # long rows: each block recomputed in the backward
    assert config.eval.in_bf16_too  # FP4 policies scored in bf16 as well
    if not full:
        assert (config.rl.grpo.learning_rate, config.sft.steps) == (
            pilot["learning_rate"],
            pilot["sft_steps"],
        )
        assert (config.rl.steps, config.rl.prompts_per_step) == (
            pilot["rl_steps"],
            pilot["prompts_per_step"],
        )
        assert config.eval.problems_per_split == pilot["eval_problems"]
        assert config.rl.eval_every == config.rl.steps // 2  # mid-run and final evaluations
        assert tuple(table.labels) == pilot["methods"]
        more = pilot.get("overrides", {})
        for label in table.labels:  # a pilot's overrides reach every run
            rl = table.run_config(label, 0).rl
            assert rl.grpo.is_cap == more.get("rl.is_cap", 5.0)
            assert rl.format == more.get("rl.format", "nvfp4")
    assert "fp4_qat" in table.labels and "bf16" in table.labels
    if variant is None:  # the table: Table 1's methods, TRACE on the deeper half and on all
        assert table.labels[:5] == ["bf16", "fp4_qat", "qarl", "quads", "trace"]
        assert table.labels[5] == "trace all" and len(table.labels) == 6
        all_layers = table.run_config("trace all", 0).rl
        assert (all_layers.method, all_layers.guided_layers) == ("trace", "all")
        assert table.run_config("trace", 0).rl.guided_layers in ("", None, "half")
        assert table.run_config("qarl", 0).rl.format == "nvfp4"


def test_a_long_task_does_not_widen_the_short_tasks_sft_rows():
    """SFT rows are as wide as the short tasks need unless a run trains a long one."""
    config = ExperimentConfig.from_config_dict(small_gpu.get_config())
    caps = [
        tasks.level_spec(t, lv).max_prompt_tokens + tasks.level_spec(t, lv).max_solution_tokens
        for t in tasks.SHORT_TASKS
        for lv in config.tasks.levels
    ]
    assert config.tasks.sft_row_length == max(caps) + 2  # BOS and EOS
