"""Symbolic equality of two math answers through sympy, bounded in time and safe to run on model output.

Model output is untrusted and sympy's parser ends in `eval`, so a small converter here first turns the LaTeX into
an expression over a whitelist (digits, one- or two-letter symbols, `+ - * / **`, parentheses, a few named functions
and constants) that is parsed with no builtins. Huge powers are refused before evaluation: a big-integer power runs
in C, where no time limit can interrupt it. The time limit uses SIGALRM, so it holds in a process's main thread
(reward workers, an in-process runner on the driver); elsewhere only the runner's per-call limit applies.
"""

from __future__ import annotations

import keyword
import math
import re
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

from megarl.rewards.math_answer import braced_content

MAX_EXPRESSION_CHARS = 256
"""Longer answers are not compared symbolically (no real answer is this long; a runaway response may be)."""
MAX_POWER_DIGITS = 10_000
"""Largest number of digits a numeric power may produce before sympy is allowed to compute it."""

_COMMANDS = {
    "cdot": "*",
    "times": "*",
    "div": "/",
    "pi": " pi ",
    "infty": " oo ",
    "ln": " log ",
    "log": " log ",
    "exp": " exp ",
    **{name: f" {name} " for name in ("sin", "cos", "tan", "cot", "sec", "csc")},
    **{f"arc{name}": f" a{name} " for name in ("sin", "cos", "tan")},
}
_FUNCTION_NAMES = ("sqrt", "sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "log", "exp")
_ALLOWED_RE = re.compile(r"^[0-9A-Za-z+\-*/().\s]+$")


class UnsupportedExpression(ValueError):
    """The text is not an expression this module compares (unknown LaTeX, words, unsafe or huge numbers)."""


class _SympyTimeout(BaseException):
    """Raised by the alarm; a BaseException so that sympy's internal `except Exception` cannot swallow it."""


@contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `_SympyTimeout` in the block after `seconds` (main thread only; elsewhere no limit)."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _SympyTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def latex_to_expression(text: str) -> str:
    """Translate answer LaTeX (`\\frac`, `\\sqrt[n]{}`, `^{}`, `\\cdot`, `\\pi`, trig, logs) into sympy syntax over
    the whitelist; raise UnsupportedExpression for anything else."""
    if len(text) > MAX_EXPRESSION_CHARS:
        raise UnsupportedExpression(f"longer than {MAX_EXPRESSION_CHARS} characters")
    expression = _convert(text)
    if not _ALLOWED_RE.match(expression) or re.search(r"\.\s*[A-Za-z]|\d{51,}", expression):
        raise UnsupportedExpression(f"characters or numbers outside the whitelist in {expression!r:.80}")
    for word in re.findall(r"[A-Za-z]+", expression):
        if word not in _FUNCTION_NAMES and word not in ("pi", "oo") and (len(word) > 2 or keyword.iskeyword(word)):
            # Words are not math: as products of symbols, anagrams would compare equal ("dog" == "god").
            raise UnsupportedExpression(f"word {word!r}")
    return expression


def _convert(text: str) -> str:
    out: list[str] = []
    index = 0
    while index < len(text):
        char = text[index]
        if char == "\\":
            name, index = _command(text, index)
            if name == "frac":
                numerator, index = _argument(text, index)
                denominator, index = _argument(text, index)
                out.append(f"(({_convert(numerator)})/({_convert(denominator)}))")
            elif name == "sqrt":
                root = None
                if text.startswith("[", index):
                    close = text.find("]", index)
                    if close < 0:
                        raise UnsupportedExpression("unclosed \\sqrt[")
                    root, index = text[index + 1 : close], close + 1
                radicand, index = _argument(text, index)
                inner = _convert(radicand)
                out.append(f"sqrt({inner})" if root is None else f"(({inner})**(1/({_convert(root)})))")
            elif name in _COMMANDS:
                out.append(_COMMANDS[name])
            else:
                raise UnsupportedExpression(f"LaTeX command \\{name}")
        elif char == "^":
            exponent, index = _argument(text, index + 1)
            out.append(f"**({_convert(exponent)})")
        else:
            out.append({"{": "(", "}": ")"}.get(char, char))
            index += 1
    return "".join(out)


def _command(text: str, index: int) -> tuple[str, int]:
    """The name of the command whose backslash is at `index`, and the index after it."""
    end = index + 1
    while end < len(text) and text[end].isalpha():
        end += 1
    if end == index + 1:
        raise UnsupportedExpression(f"LaTeX symbol {text[index : index + 2]!r}")
    return text[index + 1 : end], end


def _argument(text: str, index: int) -> tuple[str, int]:
    """One macro argument starting at `index`: a brace group, a command (`\\pi`) or a single character."""
    while index < len(text) and text[index] == " ":
        index += 1
    if index >= len(text):
        raise UnsupportedExpression("missing argument")
    if text[index] == "{":
        content = braced_content(text, index)
        if content is None:
            raise UnsupportedExpression("unbalanced braces")
        return content, index + len(content) + 2
    if text[index] == "\\":
        _, end = _command(text, index)
        return text[index:end], end
    return text[index], index + 1


@cache
def _namespaces() -> tuple[dict[str, Any], dict[str, Any], tuple]:
    import sympy
    from sympy.parsing import sympy_parser as parser

    names = {name: getattr(sympy, name) for name in ("Integer", "Float", "Rational", "Symbol", "Add", "Mul", "Pow")}
    names.update({name: getattr(sympy, name) for name in _FUNCTION_NAMES})
    global_dict = {"__builtins__": {}, **names, "pi": sympy.pi, "oo": sympy.oo}
    local_dict = {"e": sympy.E, "i": sympy.I}
    transformations = (
        parser.auto_symbol,
        parser.auto_number,
        parser.split_symbols,
        parser.implicit_multiplication,
        parser.implicit_application,
        parser.function_exponentiation,
    )
    return global_dict, local_dict, transformations


def parse_answer(text: str, evaluate: bool = True) -> Any:
    """The sympy expression of an answer (see `latex_to_expression`); numeric powers checked before evaluation."""
    expression = latex_to_expression(text)  # before importing sympy: most refusals need no sympy at all
    from sympy.parsing.sympy_parser import parse_expr

    global_dict, local_dict, transformations = _namespaces()
    kwargs = dict(local_dict=dict(local_dict), global_dict=dict(global_dict), transformations=transformations)
    _check_powers(parse_expr(expression, evaluate=False, **kwargs))
    return parse_expr(expression, evaluate=evaluate, **kwargs)


def _check_powers(tree: Any) -> None:
    """Refuse numeric powers that would make huge integers (towers, 10^(10^6)) before anything evaluates them."""
    from sympy import Pow, postorder_traversal

    for node in postorder_traversal(tree):
        if not isinstance(node, Pow) or node.exp.free_symbols:
            continue
        try:  # evalf works in floating point with an unbounded exponent range: cheap even for huge values
            exponent = abs(complex(node.exp.evalf(15)))
            base = abs(complex(node.base.evalf(15))) if not node.base.free_symbols else 10.0
        except (TypeError, ValueError, OverflowError) as error:
            raise UnsupportedExpression(f"cannot bound the power {node}") from error
        if not math.isfinite(exponent) or exponent > 1000 or exponent * math.log10(max(base, 1.0)) > MAX_POWER_DIGITS:
            raise UnsupportedExpression(f"power too large: {node}")


def symbolic_equal(prediction: str, answer: str, timeout_s: float | None = 2.0) -> bool:
    """Whether two answers are equal as sympy expressions (False when either is unsupported or time runs out)."""
    try:
        with time_limit(timeout_s):
            return _symbolic_equal(prediction, answer)
    except (_SympyTimeout, UnsupportedExpression, RecursionError):
        return False
    except Exception:  # sympy raises many types on odd input (SyntaxError, TypeError, PolynomialError, ...)
        return False


def _symbolic_equal(prediction: str, answer: str) -> bool:
    import sympy

    a, b = parse_answer(prediction), parse_answer(answer)
    if a == b:
        return True
    if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr):
        return False
    difference = a - b
    expanded = sympy.expand(difference)
    if expanded == 0:
        return True
    if expanded.free_symbols and expanded.is_polynomial() and all(c.is_Rational for c in sympy.Poly(expanded).coeffs()):
        return False  # the expansion of a polynomial with rational coefficients is canonical: nonzero is final
    if sympy.simplify(difference) == 0:
        return True
    if difference.free_symbols:
        return False
    # Constants that simplify cannot reduce (nested radicals, ...): compare numerically at high precision.
    value, scale = abs(complex(difference.evalf(30))), abs(complex(b.evalf(30)))
    return math.isfinite(value) and math.isfinite(scale) and value <= 1e-12 * max(1.0, scale)
