"""The safe expression parser, evaluator, printer and step reduction."""

from __future__ import annotations

import numpy as np
import pytest

from trace_jax.tasks import expr
from trace_jax.tasks.expr import BinOp, ExprError, Num


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("3+4*2-5", 6),
        ("2*3-4*5", -14),
        ("(3+4)*2", 14),
        ("12/4/3", 1),
        ("8-3-2", 3),
        ("8-(3-2)", 7),
        ("-5+2", -3),
        ("2*(-3)", -6),
        ("0", 0),
        ("((7))", 7),
    ],
)
def test_parse_and_evaluate(text, value):
    assert expr.evaluate(expr.parse(text)) == value


@pytest.mark.parametrize(
    "text",
    ["", "1+", "+1", "1++2", "(1+2", "1+2)", "01", "1 +2", "1.5", "a+1", "1>2", "--1", "-(1)", "٣"],
)
def test_parse_rejects(text):
    with pytest.raises(ExprError):
        expr.parse(text)


def test_parse_limits_and_negative_flag():
    with pytest.raises(ExprError, match="nested"):
        expr.parse("(" * 40 + "1" + ")" * 40)
    with pytest.raises(ExprError, match="longer"):
        expr.parse("1+" * 200 + "1")
    with pytest.raises(ExprError):
        expr.parse("-3+5", allow_negative=False)


def test_division_must_be_exact():
    assert expr.evaluate(expr.parse("12/4")) == 3
    for text in ("7/2", "5/0", "0/0"):
        with pytest.raises(ExprError, match="exact"):
            expr.evaluate(expr.parse(text))


def _random_tree(rng, n_ops):
    nodes = [Num(int(v)) for v in rng.integers(-9, 30, n_ops + 1)]
    while len(nodes) > 1:
        i = int(rng.integers(len(nodes) - 1))
        nodes[i : i + 2] = [BinOp(str(rng.choice(list("+-*"))), nodes[i], nodes[i + 1])]
    return nodes[0]


def test_canonical_text_parses_back_to_the_same_tree():
    rng = np.random.default_rng(0)
    for _ in range(500):
        tree = _random_tree(rng, int(rng.integers(0, 6)))
        text = expr.to_text(tree)
        assert expr.parse(text) == tree, text


def test_reduction_steps():
    steps = expr.reduction_steps(expr.parse("3+4*2-5"))
    assert [expr.to_text(s.tree) for s in steps] == ["3+8-5", "11-5", "6"]
    assert [(s.a, s.op, s.b, s.value) for s in steps] == [
        (4, "*", 2, 8),
        (3, "+", 8, 11),
        (11, "-", 5, 6),
    ]
    steps = expr.reduction_steps(expr.parse("2*(3-5)"))
    assert [expr.to_text(s.tree) for s in steps] == ["2*(-2)", "-4"]
    assert expr.reduction_steps(Num(3)) == []
    rng = np.random.default_rng(1)
    for _ in range(200):
        tree = _random_tree(rng, 4)
        steps = expr.reduction_steps(tree)
        assert len(steps) == expr.count_ops(tree) == 4
        assert all(expr.evaluate(s.tree) == expr.evaluate(tree) for s in steps)
