"""Type checks for values from callers (sampling parameters, engine arguments, token ids):
an int is an integer and not a bool, a number is a finite real and not a bool. numpy
scalars pass (they register as numbers.Integral / numbers.Real) and come back as Python
ones."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from typing import Any


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite real number (int or float, not bool, not NaN or infinite)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def describe(value: Any) -> str:
    """`float 1.5`, `str '7'`: what was passed, for error messages."""
    return f"{type(value).__name__} {value!r:.40}"


def int_list(values: Iterable[Any], what: str, error: type[Exception]) -> list[int]:
    """`values` as a list of Python ints; `error` names the first item that is not one."""
    if isinstance(values, (str, bytes)):
        raise error(f"{what} must be a list of integers, not {type(values).__name__}")
    try:
        out = list(values)
    except TypeError:
        raise error(f"{what} must be a list of integers, not {type(values).__name__}") from None
    if not out or set(map(type, out)) == {int}:  # the common case, in C (~5x a genexpr)
        return out
    for i, t in enumerate(out):
        if not is_int(t):
            raise error(f"{what} must be integers; item {i} is {describe(t)}")
    return [int(t) for t in out]
