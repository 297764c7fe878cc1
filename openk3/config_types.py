"""Type checks of config values read from JSON against the annotations of the config dataclasses.

`type_problem` says what a value should be ("an integer or null") when it does not fit the field's
annotation (`K3Config`, `LinearAttnConfig`; `openk3.plan` checks raw dicts with it too). JSON booleans
are not numbers. `parse_bytes` reads sizes such as "22GB" (the loader's `expert_cache`, the planner's `--ram`).
Stdlib only, like `openk3.config`.
"""

from __future__ import annotations

import functools
import re
import types
import typing
from typing import Any

_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KI": 2**10, "KIB": 2**10, "MI": 2**20, "MIB": 2**20, "GI": 2**30, "GIB": 2**30,
          "TI": 2**40, "TIB": 2**40}


def parse_bytes(value: int | str, what: str = "size", bare_unit: int = 1) -> int:
    """"22GB", "1.5 GiB", "500MB", "4096" or an int -> bytes (decimal units unless they say i/iB; a bare number is
    in `bare_unit` bytes). ValueError naming `what` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value * bare_unit
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        unit = m[2].upper() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: cannot read {value!r} as a size (e.g. 22GB, 1.5GiB, 500MB)")
        n = int(float(m[1]) * (_UNITS[unit] if unit else bare_unit))
    if n <= 0:
        raise ValueError(f"{what} must be positive, got {value!r}")
    return n


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolving the string annotations is slow: once per class


def type_problem(cls: type, name: str, value: Any) -> str | None:
    """None if `value` fits the annotation of field `name` of dataclass `cls` (K3Config or
    LinearAttnConfig), else what it should be, e.g. "an integer or null". JSON booleans are not numbers."""
    hint = _type_hints(cls)[name]
    kinds = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if any(_fits(k, value) for k in kinds):
        return None
    return " or ".join(_describe(k) for k in kinds)


def _fits(kind, value) -> bool:
    if kind is type(None):
        return value is None
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_fits(typing.get_args(kind)[0], v) for v in value)
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind) if kind in _TYPE_NAMES else True


def _describe(kind) -> str:
    if kind is type(None):
        return "null"
    if typing.get_origin(kind) is list:
        return "a list of " + {int: "integers", str: "strings"}.get(typing.get_args(kind)[0], "values")
    return _TYPE_NAMES.get(kind, getattr(kind, "__name__", str(kind)))
