"""An arithmetic check for worked maths answers, as a reward with a prefix twist.

A worked answer to a word problem writes its steps as equality chains, in plain text or
LaTeX: ``165 \\times 12 = 1980``, ``\\frac{180}{5} = 36``, ``$2 + $3 = $5``. Each ``=`` between
two pieces that are pure arithmetic (numbers, ``+ - * /``, ``\\times``, ``\\cdot``, ``\\div``,
``\\frac``, parentheses, units in ``\\text{...}`` after a number, ``$`` signs and thousands
commas) is an *equation* this module can check exactly. ``R(x)`` is minus the number of false
equations in ``x``: the reward ``exp(beta R)`` divides a particle's weight by ``e^beta`` for
each slip, and as a twist (Naesseth et al. 2019; Lew et al. 2023) it does so on the round the
line holding the slip ends, so resampling can replace that particle while it is still
running. It is the cheap stand-in for a process reward model (Puri et al. 2025,
arXiv:2502.01618): it sees arithmetic slips only, not wrong reasoning.

Conservative by design, since a false alarm pushes a correct answer away: a piece with a
variable (``\\text{Number of boys}``, ``x``), a percent sign, a power or any other symbol is
not arithmetic and its ``=`` is not checked; neither is an ``=`` between pieces with different
units (``4 \\text{ inches} = \\frac{4}{12} \\text{ feet}``), a line with ``<``, ``>``,
``==``, ``\\le`` or ``\\ge`` in it, an ``\\approx`` or ``\\neq`` (the pieces beside it are
not compared), or a line inside a code fence. A written result may round:
``\\frac{10}{3} = 3.33`` holds (within half a unit of its last written decimal).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass

from smcspec.potentials import Reward

__all__ = ["Equation", "arithmetic_reward", "check_arithmetic", "false_equations"]

MAX_PIECE_CHARS = 200
"""Longer pieces are not checked (they are not a step of a word problem)."""

_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_UNIT = re.compile(r"(?<=[\d)}])\s*\\(?:text|mathrm)\s*\{([^{}]*)\}")
_SYMBOLS = (
    ("\\times", "*"), ("\\cdot", "*"), ("\\div", "/"), ("×", "*"), ("÷", "/"),  # noqa: RUF001
    ("\\$", ""), ("$", ""), ("\\left", ""), ("\\right", ""), ("\\,", ""), ("\\!", ""),
    ("\\(", ""), ("\\)", ""), ("\\[", ""), ("\\]", ""), ("\\quad", ""), ("{", "("), ("}", ")"),
)  # fmt: skip
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_ARITHMETIC = re.compile(r"[\d\s.+\-*/()]+")
_NUMBER = re.compile(r"-?\d+(?:\.(\d+))?")
_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
_RELATION = re.compile(r"(\\approx|≈|\\neq|=)")
_NOT_EQUALITY = re.compile(r"==|<|>|!=|\\[lg]eq?(?![a-zA-Z])")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv}  # fmt: skip


@dataclass(frozen=True)
class Equation:
    """One checked ``=``.

    Attributes:
        line: the line it stands in (stripped).
        left, right: the values of the pieces on either side.
        holds: whether they agree (to the written precision of a plain decimal result).
    """

    line: str
    left: float
    right: float
    holds: bool


@dataclass(frozen=True)
class _Piece:
    value: float
    units: frozenset[str]
    decimals: int | None  # digits after the point when the piece is a plain number


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not arithmetic")


def _piece(text: str) -> _Piece | None:
    """The value of one side of an ``=``, or None when it is not pure arithmetic."""
    if len(text) > MAX_PIECE_CHARS or "%" in text:
        return None
    s, before = text, None
    while s != before:  # nested fractions, innermost first
        before, s = s, _FRAC.sub(r"((\1)/(\2))", s)
    units = frozenset(u.strip().rstrip("s") for u in _UNIT.findall(s) if u.strip())
    s = _UNIT.sub(" ", s)
    for old, new in _SYMBOLS:
        s = s.replace(old, new)
    s = _THOUSANDS.sub("", s).strip().rstrip(".,;:").strip()
    if not _ARITHMETIC.fullmatch(s) or not any(c.isdigit() for c in s):
        return None
    if s[0] in "*/+" or s[-1] in "+-*/":  # a fragment ("- 2" once a variable was dropped)
        return None
    try:
        value = _evaluate(ast.parse(s, mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
        return None
    if not math.isfinite(value):
        return None
    plain = _NUMBER.fullmatch(s.replace(" ", ""))
    decimals = len(plain.group(1) or "") if plain else None
    return _Piece(value, units, decimals)


def _holds(left: _Piece, right: _Piece) -> bool:
    written = [p.decimals for p in (left, right) if p.decimals is not None]
    if written:  # a plain number may be rounded to its last written digit
        tol = 0.5 * 10.0 ** -min(written) + 1e-14 * abs(right.value)
    else:
        tol = 1e-14 * max(1.0, abs(right.value))
    return abs(left.value - right.value) <= tol


def check_arithmetic(text: str, complete_lines_only: bool = False) -> list[Equation]:
    """Every checkable ``=`` of ``text``, in order (see the module docstring for which).

    Args:
        text: a worked answer, plain text or LaTeX.
        complete_lines_only: skip the last line unless ``text`` ends with a newline (a prefix
            whose last line is still being written).
    """
    lines = text.split("\n")
    if complete_lines_only:
        lines = lines[:-1]
    found: list[Equation] = []
    fenced = False
    for raw in lines:
        if raw.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or "=" not in raw or _NOT_EQUALITY.search(raw):
            continue
        line = _BULLET.sub("", raw)
        parts = _RELATION.split(line)
        pieces = [_piece(p) for p in parts[0::2]]
        for left, right, relation in zip(pieces, pieces[1:], parts[1::2], strict=False):
            if left is None or right is None or relation != "=":
                continue
            if left.units and right.units and left.units != right.units:
                continue  # a unit conversion
            found.append(Equation(raw.strip(), left.value, right.value, _holds(left, right)))
    return found


def false_equations(text: str, complete_lines_only: bool = False) -> int:
    """How many of ``text``'s checkable equations are false."""
    return sum(not e.holds for e in check_arithmetic(text, complete_lines_only))


def arithmetic_reward(beta: float = 3.0) -> Reward:
    """``exp(beta * R)`` with ``R(x) = -false_equations(x)``, twisted on finished lines.

    The twist ``exp(-beta * false equations on the lines that have ended)`` equals the final
    potential once the answer ends, as a twist must. ``beta = 3`` divides a particle's weight
    by about 20 for each slip. Raises :class:`~smcspec.errors.ConfigError` for a
    non-finite ``beta``.
    """

    def final(texts: list[str]) -> Sequence[float]:
        return [float(-false_equations(t)) for t in texts]

    def prefix(texts: list[str]) -> Sequence[float]:
        return [float(-false_equations(t, complete_lines_only=True)) for t in texts]

    return Reward(final, beta, prefix_fn=prefix)
