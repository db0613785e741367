r"""Verifiers: math_verify answers (\boxed{}, numbers, fractions, LaTeX) on and off the main thread,
the synthetic checker behind the same interface, and rewards / pass@k of any kind."""

from __future__ import annotations

import concurrent.futures
import itertools

import math_verify
import numpy as np
import pytest

from tests.data import bpe
from trace_jax import data, tasks
from trace_jax.data import HFTokenizer, MathVerifier, Score, SyntheticVerifier, TextExample


def ex(answer: str) -> TextExample:
    return TextExample(question="q", answer=answer, metadata={"source": "test"})


# (reference answer, response, expected score)
MATH_CASES = [
    ("42", "so the answer is \\boxed{42}.", Score("42", True, True)),
    ("42", "The answer is 42", Score("42", True, True)),
    ("\\frac{1}{2}", "I get 0.5", Score("0.5", True, True)),
    ("0.5", "so it is $\\frac{1}{2}$", Score("\\frac{1}{2}", True, True)),
    ("\\frac{3}{4}", "\\boxed{\\frac34}", Score("\\frac{3}{4}", True, True)),
    ("x+1", "\\boxed{1+x}", Score("1+x", True, True)),
    ("2400", "\\boxed{2,400}", Score("2,400", True, True)),
    ("42", "\\boxed{41}", Score("41", True, False)),  # wrong, well formed
    ("\\frac{1}{2}", "I get 0.25", Score("0.25", True, False)),
    ("42", "I do not know.", Score(None, False, False)),  # no answer
    ("42", "", Score(None, False, False)),
    ("42", None, Score(None, False, False)),  # the response never stopped
]


@pytest.mark.parametrize(("answer", "response", "expected"), MATH_CASES)
def test_math_verifier(answer, response, expected):
    assert MathVerifier().score(ex(answer), response) == expected


def test_math_verifier_works_off_the_main_thread(monkeypatch):
    """On the main thread math_verify gets its (SIGALRM) timeout; on a worker thread, where
    SIGALRM cannot be used, none: the same verdicts, no error."""
    timeouts = []
    parse = math_verify.parse

    def spy(text, **kw):
        timeouts.append(kw["parsing_timeout"])
        return parse(text, **kw)

    monkeypatch.setattr(math_verify, "parse", spy)
    verifier = MathVerifier(timeout_s=3)
    cases = [(a, r) for a, r, _ in MATH_CASES]
    on_main = [verifier.score(ex(a), r) for a, r in cases]
    assert set(timeouts) == {3}
    timeouts.clear()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        off_main = list(pool.map(lambda c: verifier.score(ex(c[0]), c[1]), cases))
    assert off_main == on_main == [e for _, _, e in MATH_CASES]
    assert set(timeouts) == {None}
    with pytest.raises(ValueError, match=r"timeout_s must be an int >= 1 .*got 0\.5"):
        MathVerifier(timeout_s=0.5)


def test_synthetic_verifier_is_the_tasks_checker():
    verifier = data.make_verifier("synthetic")
    problems = list(itertools.islice(tasks.train_stream(2), 30))
    for p in problems:
        for response in (p.solution, ">" + p.answer, "1>2", "no marker", ""):
            assert verifier.score(p, response) == tasks.score(p, response)
        assert verifier.score(p, None) == Score(None, False, False)
    with pytest.raises(TypeError, match=r"generated problems only.*tasks\.verifier='math'"):
        verifier.score(ex("1"), ">1")
    assert isinstance(data.make_verifier("math"), MathVerifier)
    with pytest.raises(ValueError, match=r"unknown verifier kind 'llm'; expected one of"):
        data.make_verifier("llm")


def test_char_rewards_are_the_tasks_rewards():
    """The pipeline's reward path on the generated tasks (char tokenizer, synthetic verifier)
    gives exactly the tasks' own rewards, for correct, wrong and garbage responses (ids up to
    the tiny model's 64, beyond the tokenizer's 52)."""
    rng = np.random.default_rng(0)
    problems = list(itertools.islice(tasks.train_stream(0, levels=(1, 2)), 60))
    responses = []
    for i, p in enumerate(problems):
        kind = i % 3
        if kind == 0:
            responses.append(tasks.solution_ids(p))
        elif kind == 1:
            responses.append(tasks.TOKENIZER.encode(">7", eos=True))
        else:
            responses.append(rng.integers(0, 64, size=int(rng.integers(0, 12))).astype(np.int32))
    got = data.compute_rewards(
        problems,
        responses,
        tokenizer=data.load_tokenizer("char"),
        verifier=SyntheticVerifier(),
    )
    want = tasks.batch_rewards(problems, responses)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)
    assert 0 < got.sum() < len(problems)


def test_math_rewards_and_pass_at_k_through_a_hf_tokenizer(tmp_path):
    tok = HFTokenizer.load(bpe.write_tokenizer_dir(tmp_path))
    examples = [ex("17"), ex("\\frac{1}{2}")]

    def response(text, stop=True):
        return np.concatenate([tok.encode(text), [tok.eos_id] if stop else []]).astype(np.int32)

    # Two examples x 3 samples: right, wrong, never stopped.
    rows = [
        (examples[0], response("the answer is \\boxed{17}.")),
        (examples[0], response("the answer is \\boxed{71}.")),
        (examples[0], response("the answer is \\boxed{17}.", stop=False)),
        (examples[1], response("the answer is 0.5")),
        (examples[1], response("the answer is \\boxed{1/2}")),
        (examples[1], response("what is it?")),
    ]
    rewards = data.compute_rewards(
        [e for e, _ in rows], [r for _, r in rows], tokenizer=tok, verifier=MathVerifier()
    )
    np.testing.assert_array_equal(rewards, [1, 0, 0, 1, 1, 0])
    shaped = data.compute_rewards(
        [e for e, _ in rows],
        [r for _, r in rows],
        tokenizer=tok,
        verifier=MathVerifier(),
        format_weight=0.25,
    )
    np.testing.assert_array_equal(shaped, [1, 0.25, 0, 1, 1, 0])
    per_problem = rewards.reshape(2, 3)
    assert data.pass_at_1(per_problem) == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert data.pass_at_k(per_problem, 2) == pytest.approx(((1 - 1 / 3) + 1) / 2)
    with pytest.raises(ValueError, match="2 examples but 1 responses"):
        data.compute_rewards(examples, rows[:1], tokenizer=tok, verifier=MathVerifier())
