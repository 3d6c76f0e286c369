"""The built-in ``calculator`` tool: arithmetic parsed with ``ast`` and evaluated node by node.

Never ``eval``: only number literals, ``+ - * / // % **``, unary signs and parentheses are accepted,
and operands are bounded so that ``9**9**9`` or a 10^6-digit product is refused instead of eating
the CPU of the driver that steps the episodes.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

_BINARY: dict[type, Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[float], float]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_DIGITS = 100  # operands and results beyond this many digits are refused
MAX_EXPONENT = 1000
MAX_LENGTH = 500  # characters of expression


class CalculatorError(ValueError):
    """The expression is not arithmetic this calculator evaluates (the message says why)."""


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression such as ``"123*456"`` or ``"(2+3)**2/7"``."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"not an arithmetic expression: {exc.msg}") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and abs(left) > 1 and abs(right) * math.log10(abs(left)) > MAX_DIGITS:
            raise CalculatorError(f"result has more than {MAX_DIGITS} digits")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result overflows") from None
    raise CalculatorError(
        f"unsupported element {type(node).__name__}: only numbers, + - * / // % ** and parentheses"
    )


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("the result is a complex number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"a number has more than {MAX_DIGITS} digits")
    return value


def format_number(value: int | float) -> str:
    """``56088`` not ``56088.0``; floats that are whole print as integers, others round-trip."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: arithmetic with numbers, + - * / // % ** and parentheses, e.g. "123*456"
    """
    return format_number(evaluate(expression))
