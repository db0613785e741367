"""Verifiers and rewards: exact answers, countdown rules, malformed output, pass@k."""

from __future__ import annotations

import numpy as np
import pytest

from trace_jax import tasks
from trace_jax.tasks import EOS_ID, PAD_ID, TOKENIZER, Problem
from trace_jax.tasks.tokenizer import BOS_ID, pad_batch

ARITH = Problem(
    task="arithmetic", prompt="3+4*2-5=", answer="6", solution="3+8-5=11-5=6>6", difficulty=2
)
PROG = Problem(
    task="program", prompt="a=3;b=a*2;c=b-9;?c", answer="-3", solution="a=3,b=6,c=-3>-3",
    difficulty=1,
)  # fmt: skip
CD = Problem(
    task="countdown",
    prompt="40 from 3,12,7,4:",
    answer="(7+3)*4",
    solution="7+3=10,10*4=40>(7+3)*4",
    difficulty=2,
)
CD_DUP = Problem(task="countdown", prompt="12 from 6,6,5:", answer="6+6", solution="6+6=12>6+6",
                 difficulty=1)  # fmt: skip


def ids(text, eos=True):
    return TOKENIZER.encode(text, eos=eos)


def test_correct_answers():
    for p in (ARITH, PROG, CD, CD_DUP):
        assert tasks.reward(p, ids(p.solution)) == 1.0
        assert tasks.reward(p, ">" + p.answer) == 1.0  # reasoning is optional
    assert tasks.score(ARITH, ids("7>6")) == tasks.Score(answer="6", well_formed=True, correct=True)


def test_wrong_answers_get_zero():
    assert tasks.reward(ARITH, ids("3+8-5=11-5=7>7")) == 0.0
    assert tasks.reward(ARITH, "6>-6") == 0.0
    assert tasks.reward(PROG, ids(">3")) == 0.0
    assert tasks.reward(CD, ids(">7*4+3*4")) == 0.0  # uses 4 twice and misses
    assert tasks.reward(CD, ids(">3*12+7")) == 0.0  # 43


def test_countdown_accepts_any_valid_expression():
    for answer in ("4*(3+7)", "12*3+4", "3*12+4", "7*4+12", "((7+3))*4"):
        assert tasks.reward(CD, ids(">" + answer)) == 1.0, answer
    assert tasks.reward(CD, ids(">(12-7+3)*4+4")) == 0.0  # 4 used twice


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ("3*12+4+4-4", "reuses 4"),
        ("(7+3)*4*1", "1 is not given"),
        ("10*4", "10 is not given"),
        ("(7*12-4)/2", "2 not given"),
        ("(12+7+3)*4/2", "not given"),
        ("4*12-7-3/3", "3 reused"),
        ("(3+12+7)/4*7", "7 reused, 22/4 inexact"),
        ("-3+43", "unary minus"),
        ("40", "40 not given"),
        ("4*(12-7)+3/0", "division by zero"),
    ],
)
def test_countdown_rejects(answer, why):
    assert tasks.reward(CD, ids(">" + answer)) == 0.0, why


def test_countdown_inexact_division_is_rejected():
    p = Problem(task="countdown", prompt="5 from 7,2,3:", answer="7-2", solution="7-2=5>7-2",
                difficulty=1)  # fmt: skip
    assert tasks.reward(p, ">7/2*3-2+2") == 0.0
    assert tasks.reward(p, ">(7+3)/2") == 1.0  # exact
    q = Problem(task="countdown", prompt="3 from 7,2,4:", answer="7-4", solution="7-4=3>7-4",
                difficulty=1)  # fmt: skip
    assert tasks.reward(q, ">7/2*2-4") == 0.0  # 7/2 is not exact, though 3.5*2-4 = 3
    assert tasks.reward(CD_DUP, ">6+6") == 1.0  # a repeated given number may repeat


@pytest.mark.parametrize(
    "response",
    [
        ids("3+8-5=11-5=6"),  # no marker
        ids("6>6", eos=False),  # no EOS: cut off
        ids(">6>6"),  # two markers
        ids("6>"),  # empty answer
        ids(">6 "),  # extra text
        ids(">6;"),
        ids(">06"),
        ids(">+6"),
        np.concatenate([ids(">6", eos=False), [PAD_ID, EOS_ID]]),  # PAD before EOS
        np.concatenate([[BOS_ID], ids(">6")]),
        np.array([3, 70, 9, EOS_ID]),  # out-of-vocabulary id
        np.array([3, -1, 9, EOS_ID]),
        np.array([], np.int32),
        np.array([[3, 9, EOS_ID]]),  # 2-D
        np.array([3.0, 9.0, 2.0]),  # floats
        [3, "9", 2],
        [3, None, 2],
        [3, 2**70, 2],
        None,
        "",
        ">",
        "no marker",
        ">６",  # full-width digit
        ">٣",
    ],
)
def test_malformed_responses_get_zero_without_raising(response):
    for p in (ARITH, PROG, CD):
        assert tasks.reward(p, response) == 0.0
        assert tasks.reward(p, response, format_weight=0.2) in (0.0, 0.2)


def test_trailing_pad_after_eos_is_fine():
    response = np.concatenate([ids(">6"), [PAD_ID] * 5, [7, 8]])
    assert tasks.reward(ARITH, response) == 1.0


def test_format_reward():
    fw = 0.25
    assert tasks.reward(ARITH, ids(">6"), format_weight=fw) == 1.0
    assert tasks.reward(ARITH, ids(">6"), format_weight=0.1) == 1.0  # exactly
    assert tasks.reward(ARITH, ids(">7"), format_weight=fw) == fw  # wrong but well formed
    assert tasks.reward(ARITH, ids(">7+"), format_weight=fw) == 0.0  # not an integer
    assert tasks.reward(CD, ids(">3+4"), format_weight=fw) == fw
    assert tasks.reward(CD, ids(">3+"), format_weight=fw) == 0.0
    with pytest.raises(ValueError, match="format_weight"):
        tasks.reward(ARITH, ">6", format_weight=1.5)


def test_a_score_is_its_reward():
    """`Score.reward` (what every verifier's scores become): 1 when correct, the format weight
    when only well formed, else 0; the format weight is checked for any score."""
    assert tasks.Score("6", True, True).reward(0.3) == 1.0
    assert tasks.Score("7", True, False).reward(0.3) == 0.3
    assert tasks.Score("7", True, False).reward() == 0.0
    assert tasks.Score(None, False, False).reward(0.3) == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"format_weight must be in \[0, 1\]"):
            tasks.Score(None, False, False).reward(bad)


def test_fuzz_random_ids_never_raise():
    rng = np.random.default_rng(0)
    marker_rows = 0
    for _ in range(3000):
        n = int(rng.integers(0, 30))
        response = rng.integers(-2, 70, n)
        if rng.random() < 0.5:  # mostly valid ids with a marker and EOS
            response = np.concatenate([rng.integers(3, 52, n), [3], rng.integers(3, 52, 3), [2]])
            marker_rows += 1
        for p in (ARITH, PROG, CD):
            r = tasks.reward(p, response, format_weight=0.5)
            assert 0.0 <= r <= 1.0
    assert marker_rows > 1000


def test_batch_rewards_and_rollout_slicing():
    problems = [ARITH, PROG, CD]
    prompts, prompt_lengths = tasks.encode_prompts(problems)
    answers = [ids(">6"), ids(">4"), ids(">4*(7+3)")]
    rows = [np.concatenate([prompts[b, : prompt_lengths[b]], answers[b]]) for b in range(3)]
    tokens, lengths = pad_batch(rows, pad_to=40)
    responses = tasks.responses_from_rollout(tokens, prompt_lengths, lengths)
    for got, want in zip(responses, answers, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(tasks.batch_rewards(problems, responses), [1.0, 0.0, 1.0])
    assert tasks.batch_rewards(problems, responses).dtype == np.float32
    with pytest.raises(ValueError):
        tasks.batch_rewards(problems, responses[:2])
    with pytest.raises(ValueError):
        tasks.responses_from_rollout(tokens, prompt_lengths[:2], lengths)


def test_pass_at_k():
    rewards = np.array([[1, 1, 1, 1], [0, 1, 0, 1], [0, 0, 0, 0]], np.float32)
    assert tasks.pass_at_1(rewards) == pytest.approx(0.5)
    assert tasks.pass_at_k(rewards, 1) == pytest.approx(0.5)
    assert tasks.pass_at_k(rewards, 4) == pytest.approx(2 / 3)
    assert tasks.pass_at_k(rewards, 2) == pytest.approx((1 + (1 - 1 / 6) + 0) / 3)
    format_only = np.where(rewards > 0, 1.0, 0.1)  # wrong but well formed earns 0.1
    assert tasks.pass_at_k(format_only, 1) == pytest.approx(0.5)
    assert tasks.pass_at_k(rewards.astype(bool), 2) == tasks.pass_at_k(rewards, 2)
    with pytest.raises(ValueError):
        tasks.pass_at_1(np.zeros(3))
    with pytest.raises(ValueError):
        tasks.pass_at_k(rewards, 5)
