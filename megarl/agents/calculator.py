"""The calculator tool: arithmetic on numbers, evaluated from the syntax tree (never `eval`).

Allowed: int and float literals, + - * / // % **, unary + and -, parentheses. Anything else (names, calls,
attributes, strings, comparisons) is refused naming what was found. Bounds keep a hostile expression cheap: at most
`MAX_CHARS` characters, exponents up to `MAX_EXPONENT`, integers (literals, every intermediate value and the
result) up to `MAX_DIGITS` digits; nothing an expression holds makes it raise anything but CalculatorError.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

MAX_CHARS = 200
MAX_EXPONENT = 100
MAX_DIGITS = 100

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


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; the message is what the model reads."""


def calculate(expression: str) -> str:
    """The value of `expression` as text (integers exact; floats as Python prints them, integral ones without
    a fraction); raises CalculatorError with the reason."""
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text.replace("^", "**").replace("\u00d7", "*").replace("\u00f7", "/"), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: a NUL character, which the parser refuses
        raise CalculatorError(f"cannot read {text!r} as arithmetic") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("the expression is nested too deeply") from None
    value = _evaluate(tree.body)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value, "a number")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        if isinstance(value, complex):
            raise CalculatorError("the result is not a real number")
        return _bounded(value, "the result")
    raise CalculatorError(f"{type(node).__name__.lower()} is not arithmetic: use numbers and + - * / // % **")


def _bounded(value: int | float, what: str) -> int | float:
    if isinstance(value, int) and abs(value) >= 10**MAX_DIGITS:
        raise CalculatorError(f"{what} has more than {MAX_DIGITS} digits")
    return value
