"""Held-out splits and the training stream: fixed, rising in difficulty, disjoint."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from trace_jax import tasks
from trace_jax.tasks import expr, splits

N_TRAIN = 3000
MATH = ("arith_countdown_l2", "arith_countdown_l3", "arith_countdown_l4")
LOOP = ("loop_l2", "loop_l3", "loop_l4", "loop_l5")


def _fingerprint(problems):
    return [(p.task, p.prompt, p.answer, p.solution, p.difficulty) for p in problems]


def test_names_sizes_and_content():
    assert tasks.SPLIT_NAMES == (*MATH, "program_l2to4", "level1", *LOOP)
    all_splits = tasks.eval_splits()
    for name in tasks.SPLIT_NAMES:
        problems = all_splits[name]
        assert len(problems) == tasks.SPLITS[name].size == 96
        assert 64 <= len(problems) <= 128
    # Each name says what the split holds: its tasks and levels.
    programs = all_splits["program_l2to4"]
    assert {p.task for p in programs} == {tasks.TaskKind.PROGRAM}
    assert {p.difficulty for p in programs} == {2, 3, 4}
    for name, level in zip(MATH, (2, 3, 4), strict=True):
        assert {p.task for p in all_splits[name]} == {
            tasks.TaskKind.ARITHMETIC,
            tasks.TaskKind.COUNTDOWN,
        }
        assert {p.difficulty for p in all_splits[name]} == {level}
    assert {p.difficulty for p in all_splits["level1"]} == {1}
    assert {p.task for p in all_splits["level1"]} == set(tasks.SHORT_TASKS)
    for name, level in zip(LOOP, (2, 3, 4, 5), strict=True):
        assert {(p.task, p.difficulty) for p in all_splits[name]} == {(tasks.TaskKind.LOOP, level)}
    with pytest.raises(ValueError, match="unknown split"):
        tasks.eval_split("gsm8k")


def test_benchmark_names_are_kept_for_what_the_splits_stand_in_for():
    stands_for = {name: spec.stands_for for name, spec in tasks.SPLITS.items()}
    assert stands_for == {
        "arith_countdown_l2": "AIME 2024",
        "arith_countdown_l3": "AIME 2025",
        "arith_countdown_l4": "HMMT February 2025",
        "program_l2to4": "LiveCodeBench",
        "level1": "",
        "loop_l2": "AIME 2024",
        "loop_l3": "AIME 2025",
        "loop_l4": "HMMT February 2025",
        "loop_l5": "LiveCodeBench",
    }
    assert splits.split_legend(["arith_countdown_l2", "level1"]) == (
        "`arith_countdown_l2` (stands in for AIME 2024), `level1` (no paper counterpart)"
    )
    # The names older logs use are refused, with what they are called now.
    assert dict(splits.RENAMED_SPLITS) == {
        "aime24": "arith_countdown_l2",
        "aime25": "arith_countdown_l3",
        "hmmt25": "arith_countdown_l4",
        "livecodebench": "program_l2to4",
    }
    with pytest.raises(ValueError, match="'livecodebench' is now 'program_l2to4'"):
        tasks.eval_split("livecodebench")


def test_log_rows_under_older_split_names_read_under_the_current_ones():
    scores = {"step": 3, "level1": 0.5, "aime24": 0.25, "hmmt25": 0.125, "livecodebench_std": 0.1}
    assert splits.with_current_split_names(scores) == {
        "step": 3,
        "level1": 0.5,
        "arith_countdown_l2": 0.25,
        "arith_countdown_l4": 0.125,
        "program_l2to4_std": 0.1,
    }
    sft_row = {"split": "aime25", "pass@1_bf16": 0.5}
    assert splits.with_current_split_names(sft_row) == {
        "split": "arith_countdown_l3",
        "pass@1_bf16": 0.5,
    }
    current = {"split": "level1", "program_l2to4": 0.5}
    assert splits.with_current_split_names(current) == current


def test_splits_are_deterministic():
    for name in tasks.SPLIT_NAMES:
        a, b = tasks.eval_split(name), tasks.eval_split(name)
        assert _fingerprint(a) == _fingerprint(b)
        a.clear()  # callers get copies
        assert len(tasks.eval_split(name)) == 96
    # and independent of the cache: regenerate from scratch
    before = {n: _fingerprint(v) for n, v in tasks.eval_splits().items()}
    splits._all_splits.cache_clear()
    splits.held_out_prompts.cache_clear()
    assert {n: _fingerprint(v) for n, v in tasks.eval_splits().items()} == before


PINNED = {
    "arith_countdown_l2": ("4-1*7*8=", "-52"),
    "arith_countdown_l3": ("16-(1+10-13)*10=", "36"),
    "arith_countdown_l4": ("10-3*17+8*18-12=", "91"),
    "program_l2to4": ("f=3;e=f+9;d=f-6;b=e+d;?b", "9"),
    "level1": ("4+9*3=", "31"),
    "loop_l2": ("e=45;f=44;do 10:f=e-f;e=e-f;?e", "10"),
    "loop_l3": ("d=52;h=32;do 19:d=h-2;h=d-41;?h", "15"),
    "loop_l4": ("c=76;d=63;do 32:c=c-d;d=c-d;?c", "27"),
    "loop_l5": ("f=37;g=77;h=32;do 51:f=g+81;g=h-90;h=f+50;?f", "83"),
}


def test_pinned_first_problems():
    """Guards against silent changes to the generators (which would change the benchmarks)."""
    firsts = {name: tasks.eval_split(name)[0] for name in tasks.SPLIT_NAMES}
    for p in firsts.values():
        assert tasks.reward(p, tasks.solution_ids(p)) == 1.0
    got = {name: (p.prompt, p.answer) for name, p in firsts.items()}
    assert got == PINNED, got


def _mean_ops(p):
    if p.task == tasks.TaskKind.ARITHMETIC:
        return expr.count_ops(expr.parse(p.prompt.removesuffix("=")))
    return expr.count_ops(expr.parse(p.answer))


def test_rising_difficulty():
    stats = {name: tasks.split_stats(tasks.eval_split(name)) for name in MATH}
    sol = [stats[n]["mean_solution_tokens"] for n in MATH]
    diff = [stats[n]["mean_difficulty"] for n in MATH]
    ops = [np.mean([_mean_ops(p) for p in tasks.eval_split(n)]) for n in MATH]
    assert sol[0] < sol[1] < sol[2], sol
    assert diff[0] < diff[1] < diff[2], diff
    assert ops[0] < ops[1] < ops[2], ops
    for task in (tasks.TaskKind.ARITHMETIC, tasks.TaskKind.COUNTDOWN):  # per task, too
        per = [
            np.mean([p.solution_tokens for p in tasks.eval_split(n) if p.task == task])
            for n in MATH
        ]
        assert per[0] < per[1] < per[2], (task, per)


def test_all_split_solutions_verify_and_wrong_answers_fail():
    for problems in tasks.eval_splits().values():
        rewards = tasks.batch_rewards(problems, [tasks.solution_ids(p) for p in problems])
        assert rewards.tolist() == [1.0] * len(problems)
        wrong = [">" + ("1" if p.answer != "1" else "2") for p in problems]
        assert tasks.batch_rewards(problems, wrong).sum() == 0.0


def test_held_out_prompts_unique_and_disjoint_from_training():
    all_prompts = [p.prompt for v in tasks.eval_splits().values() for p in v]
    assert len(set(all_prompts)) == len(all_prompts) == len(tasks.SPLIT_NAMES) * 96
    assert tasks.held_out_prompts() == frozenset(all_prompts)
    train = [p.prompt for p in itertools.islice(tasks.train_stream(0), N_TRAIN)]
    assert not set(train) & set(all_prompts)


def test_training_stream_skips_held_out_prompts(monkeypatch):
    """Mark every other prompt of a stream as held out: the stream then yields the rest."""
    first = [p.prompt for p in itertools.islice(tasks.train_stream(1), 40)]
    monkeypatch.setattr(splits, "held_out_prompts", lambda: frozenset(first[::2]))
    again = [p.prompt for p in itertools.islice(tasks.train_stream(1), 20)]
    assert again == first[1::2]


def test_training_stream_is_deterministic_and_mixed():
    a = list(itertools.islice(tasks.train_stream(5), 300))
    b = list(itertools.islice(tasks.train_stream(5), 300))
    c = list(itertools.islice(tasks.train_stream(6), 300))
    assert _fingerprint(a) == _fingerprint(b) != _fingerprint(c)
    assert {p.task for p in a} == set(tasks.SHORT_TASKS)  # the default mix
    assert {p.difficulty for p in a} == set(tasks.LEVELS)
    only = list(itertools.islice(tasks.train_stream(0, tasks=["countdown"], levels=[1, 3]), 100))
    assert {p.task for p in only} == {tasks.TaskKind.COUNTDOWN}
    assert {p.difficulty for p in only} == {1, 3}
    weighted = itertools.islice(tasks.train_stream(0, weights=[1, 0, 0]), 100)
    assert {p.task for p in weighted} == {tasks.TaskKind.ARITHMETIC}
    for bad in (dict(weights=[1, 1]), dict(weights=[-1, 1, 1]), dict(levels=[7]), dict(tasks=[])):
        with pytest.raises(ValueError):
            tasks.train_stream(0, **bad)  # checked when called, not when first iterated
    with pytest.raises(ValueError, match="seed"):
        tasks.train_stream(-1)


def test_sft_and_prompt_batches():
    problems = tasks.eval_split("arith_countdown_l2")[:4] + tasks.eval_split("program_l2to4")[:4]
    batch = tasks.encode_sft_batch(problems)
    assert batch.tokens.dtype == batch.lengths.dtype == batch.prompt_lengths.dtype == np.int32
    assert batch.tokens.shape == (8, int(batch.lengths.max()))
    for b, p in enumerate(problems):
        row = batch.tokens[b]
        assert row[0] == tasks.BOS_ID and row[batch.lengths[b] - 1] == tasks.EOS_ID
        assert (row[batch.lengths[b] :] == tasks.PAD_ID).all()
        assert tasks.TOKENIZER.decode(row) == p.prompt + p.solution
        targets = row[batch.target_mask[b]]
        np.testing.assert_array_equal(targets, tasks.solution_ids(p))
    prompts, lengths = tasks.encode_prompts(problems, pad_to=64)
    assert prompts.shape == (8, 64)
    np.testing.assert_array_equal(lengths, batch.prompt_lengths)
