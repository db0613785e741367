"""Integer expressions: a safe parser, an exact evaluator, a canonical printer and step reduction.

Grammar (no Python `eval` anywhere):

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := NUMBER | "-" NUMBER | "(" expr ")"      # "-" NUMBER only with allow_negative

NUMBER is `0` or digits without a leading zero. Division must be exact (no remainder, divisor not
zero); anything else raises `ExprError`. `to_text` prints with the fewest parentheses that make the
text parse back to the same tree (a right operand of equal precedence keeps its parentheses,
negative literals are parenthesized except at the very start), so `parse(to_text(t)) == t`.
"""

from __future__ import annotations

import dataclasses

OPS = "+-*/"
_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


class ExprError(ValueError):
    """A text is not a valid expression, or it does not evaluate exactly."""


@dataclasses.dataclass(frozen=True, slots=True)
class Num:
    value: int


@dataclasses.dataclass(frozen=True, slots=True)
class BinOp:
    op: str
    left: Node
    right: Node


Node = Num | BinOp


def apply(op: str, a: int, b: int) -> int:
    """`a op b` over the integers; raises ExprError on division that is not exact."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0 or a % b:
            raise ExprError(f"{a}/{b} is not an exact integer division")
        return a // b
    raise ExprError(f"unknown operator {op!r}")


def evaluate(node: Node) -> int:
    """The exact integer value of `node`."""
    if isinstance(node, Num):
        return node.value
    return apply(node.op, evaluate(node.left), evaluate(node.right))


def leaves(node: Node) -> list[int]:
    """The literals of `node`, left to right."""
    if isinstance(node, Num):
        return [node.value]
    return leaves(node.left) + leaves(node.right)


def count_ops(node: Node) -> int:
    return 0 if isinstance(node, Num) else 1 + count_ops(node.left) + count_ops(node.right)


# ------------------------------------------------------------------------------------- parsing


def parse(
    text: str, *, allow_negative: bool = True, max_len: int = 256, max_depth: int = 32
) -> Node:
    """Parses `text` (see the module grammar); raises ExprError on anything else.

    `max_len` and `max_depth` bound the work on untrusted text (model output).
    """
    if not isinstance(text, str):
        raise ExprError(f"expected a str, got {type(text).__name__}")
    if not text:
        raise ExprError("empty expression")
    if len(text) > max_len:
        raise ExprError(f"expression longer than {max_len} characters")
    parser = _Parser(text, allow_negative, max_depth)
    node = parser.expr(0)
    if parser.pos != len(text):
        raise ExprError(f"unexpected {text[parser.pos]!r} at position {parser.pos} of {text!r}")
    return node


class _Parser:
    def __init__(self, text: str, allow_negative: bool, max_depth: int):
        self.text, self.pos = text, 0
        self.allow_negative, self.max_depth = allow_negative, max_depth

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def expr(self, depth: int) -> Node:
        if depth > self.max_depth:
            raise ExprError(f"parentheses nested deeper than {self.max_depth}")
        node = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.text[self.pos]
            self.pos += 1
            node = BinOp(op, node, self.term(depth))
        return node

    def term(self, depth: int) -> Node:
        node = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.text[self.pos]
            self.pos += 1
            node = BinOp(op, node, self.factor(depth))
        return node

    def factor(self, depth: int) -> Node:
        ch = self.peek()
        if ch == "(":
            self.pos += 1
            node = self.expr(depth + 1)
            if self.peek() != ")":
                raise ExprError(f"missing ')' at position {self.pos} of {self.text!r}")
            self.pos += 1
            return node
        if ch == "-" and self.allow_negative:
            self.pos += 1
            return Num(-self.number())
        return Num(self.number())

    def number(self) -> int:
        start = self.pos
        while self.peek() and self.peek() in "0123456789":
            self.pos += 1
        digits = self.text[start : self.pos]
        if not digits:
            found = repr(self.peek()) if self.peek() else "end of text"
            raise ExprError(f"expected a number at position {start} of {self.text!r}, got {found}")
        if len(digits) > 1 and digits[0] == "0":
            raise ExprError(f"number {digits!r} has a leading zero")
        return int(digits)


# ------------------------------------------------------------------------------------ printing


def to_text(node: Node) -> str:
    """Canonical text of `node` (see the module docstring)."""
    return _to_text(node, leftmost=True)


def _to_text(node: Node, leftmost: bool) -> str:
    if isinstance(node, Num):
        return str(node.value) if node.value >= 0 or leftmost else f"({node.value})"
    prec = _PREC[node.op]
    left_paren = isinstance(node.left, BinOp) and _PREC[node.left.op] < prec
    right_paren = isinstance(node.right, BinOp) and _PREC[node.right.op] <= prec
    left = _to_text(node.left, leftmost=leftmost or left_paren)
    right = _to_text(node.right, leftmost=right_paren)
    if left_paren:
        left = f"({left})"
    if right_paren:
        right = f"({right})"
    return f"{left}{node.op}{right}"


# ----------------------------------------------------------------------------------- reduction


@dataclasses.dataclass(frozen=True)
class Step:
    """One reduction `a op b = value`, and the whole tree after it."""

    a: int
    op: str
    b: int
    value: int
    tree: Node


def reduce_once(node: Node) -> Step:
    """Evaluates the first operation (in evaluation order) whose operands are both literals."""
    if isinstance(node, Num):
        raise ExprError("a literal has nothing left to reduce")
    if isinstance(node.left, Num) and isinstance(node.right, Num):
        a, b = node.left.value, node.right.value
        value = apply(node.op, a, b)
        return Step(a, node.op, b, value, Num(value))
    if isinstance(node.left, BinOp):
        step = reduce_once(node.left)
        return dataclasses.replace(step, tree=BinOp(node.op, step.tree, node.right))
    step = reduce_once(node.right)
    return dataclasses.replace(step, tree=BinOp(node.op, node.left, step.tree))


def reduction_steps(node: Node) -> list[Step]:
    """The steps that reduce `node` to a literal, one operation each (empty for a literal)."""
    steps = []
    while isinstance(node, BinOp):
        step = reduce_once(node)
        steps.append(step)
        node = step.tree
    return steps
