"""Every comparison of the ``--assert`` grammar on its boundary: equal, just below, just above.

A gate is a CI decision; ``>=`` read as ``>`` fails a run that exactly meets its bar, and a ``!=`` that
is never evaluated could be anything. Values are exact binary fractions so "equal" is really equal.
"""

from __future__ import annotations

import pytest

from bm.compare.expr import evaluate_assertion, parse_assertion

METRICS = {"a": {"x": 2.5}, "b-cb": {"y": 1.25}}

# (comparison, outcome when left < right, left == right, left > right)
TRUTH = {
    ">=": (False, True, True),
    "<=": (True, True, False),
    ">": (False, False, True),
    "<": (True, False, False),
    "==": (False, True, False),
    "!=": (True, False, True),
}


@pytest.mark.parametrize("cmp", sorted(TRUTH))
@pytest.mark.parametrize(("right", "column"), [("2.5625", 0), ("2.5", 1), ("2.4375", 2)])
def test_each_comparison_at_and_around_equality(cmp, right, column):
    outcome = evaluate_assertion(parse_assertion(f"a.x {cmp} {right}"), METRICS)
    assert outcome.passed is TRUTH[cmp][column]
    assert outcome.cmp == cmp and outcome.left == 2.5 and outcome.right == float(right)


@pytest.mark.parametrize("cmp", sorted(TRUTH))
def test_comparisons_parse_without_spaces_and_between_expressions(cmp):
    # 2 * b-cb.y = 2.5 = a.x exactly: the equality column again, through arithmetic and a dashed variant.
    outcome = evaluate_assertion(parse_assertion(f"a.x{cmp}2*b-cb.y"), METRICS)
    assert outcome.passed is TRUTH[cmp][1]
    assert (outcome.left, outcome.right) == (2.5, 2.5)


@pytest.mark.parametrize(
    ("text", "passed"),
    [
        ("a.x >= 250%", True),  # 250% is 2.5
        ("a.x > 250%", False),
        ("a.x - 2.5 == 0", True),
        ("-a.x == -2.5", True),
        ("a.x / 2 == 1.25", True),
        ("1 + 2 * 3 == 7", True),  # * binds tighter than +
        ("(1 + 2) * 3 == 9", True),
        ("8 - 2 - 1 == 5", True),  # left-associative
        ("8 / 4 / 2 == 1", True),
        ("a.x * 2 - b-cb.y * 4 == 0", True),
    ],
)
def test_arithmetic_on_either_side_is_exact(text, passed):
    assert evaluate_assertion(parse_assertion(text), METRICS).passed is passed
