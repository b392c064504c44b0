"""The ``--assert`` language of ``bm compare``: a tiny arithmetic-and-comparison grammar.

CI gates are written by users and often pasted from pull requests, so they are parsed, never ``eval``-ed:
nothing in an assertion can call, import, index or reach an attribute. The grammar::

    assertion := sum CMP sum                      CMP: >= <= > < == !=
    sum       := product (("+" | "-") product)*
    product   := unary (("*" | "/") unary)*
    unary     := "-" unary | atom
    atom      := NUMBER ["%"] | REF | "(" sum ")"
    REF       := VARIANT "." METRIC               e.g. hf-generate.output_throughput

A variant name may hold letters, digits, ``_``, ``-``, ``+`` and ``:``; a metric name holds letters, digits and
``_``. So ``v1.output_throughput-2`` reads as a subtraction, and ``2 * hf-cb.output_throughput`` names the
variant ``hf-cb``. ``95%`` is 0.95.
"""

from __future__ import annotations

import difflib
import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_LENGTH = 500
MAX_DEPTH = 32


class AssertionSyntaxError(ValueError):
    """The assertion text does not follow the grammar; the message points at the offending character."""


class AssertionEvalError(ValueError):
    """The assertion names a variant or metric the run does not have, or divides by zero."""


_COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
}
_ARITH: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
}

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?%?)
  | (?P<ref>[A-Za-z_][A-Za-z0-9_+:-]*\.[A-Za-z_][A-Za-z0-9_]*)
  | (?P<cmp>>=|<=|==|!=|>|<)
  | (?P<op>[-+*/])
  | (?P<paren>[()])
    """,
    re.VERBOSE,
)


@dataclass(frozen=True)
class _Token:
    kind: str
    text: str
    pos: int


# Nodes of the parsed expression: numbers, references, and binary/unary operations.
@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Ref:
    variant: str
    metric: str

    def __str__(self) -> str:
        return f"{self.variant}.{self.metric}"


@dataclass(frozen=True)
class BinOp:
    op: str
    left: Any
    right: Any


@dataclass(frozen=True)
class Neg:
    operand: Any


@dataclass(frozen=True)
class Assertion:
    """One parsed gate: ``left CMP right``, with the text it came from."""

    text: str
    left: Any
    cmp: str
    right: Any

    def refs(self) -> list[Ref]:
        found: list[Ref] = []
        _collect(self.left, found)
        _collect(self.right, found)
        return found


@dataclass(frozen=True)
class AssertionOutcome:
    text: str
    passed: bool
    left: float
    right: float
    cmp: str

    @property
    def message(self) -> str:
        status = "passed" if self.passed else "FAILED"
        detail = f"{_fmt(self.left)} {self.cmp} {_fmt(self.right)}"
        if not self.passed:
            gap = self.left - self.right
            rel = f" ({abs(gap) / abs(self.right):.1%} of the right side)" if self.right else ""
            detail += f" is false: off by {_fmt(abs(gap))}{rel}"
        return f"{status}: {self.text}  [{detail}]"

    def to_dict(self) -> dict[str, Any]:
        return {
            "assert": self.text,
            "passed": self.passed,
            "left": self.left,
            "right": self.right,
            "message": self.message,
        }


def _fmt(x: float) -> str:
    return f"{x:.4g}" if abs(x) < 1e4 else f"{x:,.0f}"


def _collect(node: Any, found: list[Ref]) -> None:
    if isinstance(node, Ref):
        found.append(node)
    elif isinstance(node, BinOp):
        _collect(node.left, found)
        _collect(node.right, found)
    elif isinstance(node, Neg):
        _collect(node.operand, found)


def _tokenize(text: str) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise AssertionSyntaxError(_point(text, pos, f"unexpected character {text[pos]!r}"))
        kind = m.lastgroup or ""
        if kind != "space":
            tokens.append(_Token(kind, m.group(), pos))
        pos = m.end()
    return tokens


def _point(text: str, pos: int, why: str) -> str:
    return f"{why} at column {pos + 1}\n  {text}\n  {' ' * pos}^"


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> _Token | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> _Token:
        tok = self.peek()
        if tok is None:
            raise AssertionSyntaxError(_point(self.text, len(self.text), "the expression ends too early"))
        self.i += 1
        return tok

    def assertion(self) -> Assertion:
        left = self.sum()
        tok = self.peek()
        if tok is None or tok.kind != "cmp":
            pos = tok.pos if tok else len(self.text)
            raise AssertionSyntaxError(_point(self.text, pos, "expected a comparison (>=, <=, >, <, ==, !=)"))
        self.take()
        right = self.sum()
        extra = self.peek()
        if extra is not None:
            raise AssertionSyntaxError(
                _point(self.text, extra.pos, f"unexpected {extra.text!r} after the comparison")
            )
        return Assertion(self.text, left, tok.text, right)

    def sum(self) -> Any:
        node = self.product()
        while (tok := self.peek()) is not None and tok.kind == "op" and tok.text in "+-":
            self.take()
            node = BinOp(tok.text, node, self.product())
        return node

    def product(self) -> Any:
        node = self.unary()
        while (tok := self.peek()) is not None and tok.kind == "op" and tok.text in "*/":
            self.take()
            node = BinOp(tok.text, node, self.unary())
        return node

    def unary(self) -> Any:
        tok = self.peek()
        if tok is not None and tok.kind == "op" and tok.text == "-":
            self.take()
            return Neg(self._nested(self.unary))
        return self.atom()

    def _nested(self, rule: Callable[[], Any]) -> Any:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise AssertionSyntaxError(f"the expression nests deeper than {MAX_DEPTH} levels")
        try:
            return rule()
        finally:
            self.depth -= 1

    def atom(self) -> Any:
        tok = self.take()
        if tok.kind == "number":
            if tok.text.endswith("%"):
                return Num(float(tok.text[:-1]) / 100)
            return Num(float(tok.text))
        if tok.kind == "ref":
            variant, metric = tok.text.rsplit(".", 1)
            return Ref(variant, metric)
        if tok.kind == "paren" and tok.text == "(":
            node = self._nested(self.sum)
            close = self.take()
            if close.text != ")":
                raise AssertionSyntaxError(_point(self.text, close.pos, "expected ')'"))
            return node
        raise AssertionSyntaxError(
            _point(self.text, tok.pos, f"expected a number or VARIANT.METRIC, found {tok.text!r}")
        )


def parse_assertion(text: str) -> Assertion:
    """Parse one ``--assert`` text; raises AssertionSyntaxError naming the column of the problem."""
    if not text.strip():
        raise AssertionSyntaxError(
            "an empty --assert; write e.g. 'inflight_fused.output_throughput >= 2 * v1.output_throughput'"
        )
    if len(text) > MAX_LENGTH:
        raise AssertionSyntaxError(f"an --assert longer than {MAX_LENGTH} characters; split it into several")
    return _Parser(text).assertion()


Metrics = Mapping[str, Any]  # variant -> {metric: value} (or the set of metric names, for check_refs)


def check_refs(assertion: Assertion, metrics: Metrics) -> None:
    """Fail before any work is done when an assertion names a variant or metric the run will not have."""
    for ref in assertion.refs():
        _lookup(ref, metrics, assertion.text, check_value=False)


def _lookup(ref: Ref, metrics: Metrics, text: str, check_value: bool = True) -> float:
    if ref.variant not in metrics:
        known = ", ".join(sorted(metrics))
        raise AssertionEvalError(
            f"{text!r}: no variant {ref.variant!r} in this comparison (variants: {known})"
        )
    row = metrics[ref.variant]
    if ref.metric not in row:
        close = difflib.get_close_matches(ref.metric, list(row), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise AssertionEvalError(f"{text!r}: variant {ref.variant!r} has no metric {ref.metric!r}{hint}")
    if not check_value:
        return 0.0
    value = row[ref.metric]
    if value is None or isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise AssertionEvalError(f"{text!r}: {ref} has no numeric value in this run ({value!r})")
    return float(value)


def _evaluate(node: Any, metrics: Metrics, text: str) -> float:
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Ref):
        return _lookup(node, metrics, text)
    if isinstance(node, Neg):
        return -_evaluate(node.operand, metrics, text)
    left = _evaluate(node.left, metrics, text)
    right = _evaluate(node.right, metrics, text)
    if node.op == "/" and right == 0:
        raise AssertionEvalError(f"{text!r}: division by zero")
    return _ARITH[node.op](left, right)


def evaluate_assertion(assertion: Assertion, metrics: Metrics) -> AssertionOutcome:
    """Evaluate against ``metrics[variant][metric]``; only numbers and the four operations are involved."""
    left = _evaluate(assertion.left, metrics, assertion.text)
    right = _evaluate(assertion.right, metrics, assertion.text)
    passed = _COMPARISONS[assertion.cmp](left, right)
    return AssertionOutcome(assertion.text, passed, left, right, assertion.cmp)
