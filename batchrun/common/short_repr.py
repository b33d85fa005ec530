"""A bounded repr of a user value, for error messages: never longer than ~80 characters and
never built whole first (a YAML alias bomb or a 10 MB string must not reach repr())."""
from __future__ import annotations

import datetime
import reprlib
from typing import Any


class _BoundedRepr(reprlib.Repr):
    """reprlib.Repr that never builds a large intermediate: no sorting of whole dicts/sets and no
    decimal conversion of huge integers (both cost time and memory proportional to the value)."""

    def repr_dict(self, x, level):
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = []
        for i, key in enumerate(x):
            if i >= self.maxdict:
                items.append("...")
                break
            items.append(f"{self.repr1(key, level - 1)}: {self.repr1(x[key], level - 1)}")
        return "{" + ", ".join(items) + "}"

    def repr_set(self, x, level):
        return self._repr_iterable(x, level, "{", "}", self.maxset) if x else "set()"

    def repr_frozenset(self, x, level):
        return self._repr_iterable(x, level, "frozenset({", "})", self.maxfrozenset) if x else "frozenset()"

    def repr_int(self, x, level):
        if x.bit_length() > 128:
            return f"<{x.bit_length()}-bit integer>"
        return super().repr_int(x, level)

    def repr_instance(self, x, level):
        if isinstance(x, (bytes, bytearray)):  # YAML !!binary
            return repr(x[:self.maxstring]) + ("..." if len(x) > self.maxstring else "")
        if x is None or isinstance(x, (bool, float, complex, datetime.date, datetime.time)):
            return repr(x)  # small by construction
        return f"<{type(x).__name__}>"  # other objects: their repr may be unbounded


_REPR = _BoundedRepr()
_REPR.maxlevel = 3
_REPR.maxtuple = _REPR.maxlist = _REPR.maxarray = _REPR.maxdeque = 4
_REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlong = 40


def short_repr(value: Any) -> str:
    """A bounded repr of a user value (at most ~80 characters, whatever its size or nesting)."""
    text = _REPR.repr(value)
    if len(text) > 80:  # nested values add up; keep the whole thing short
        text = text[:77] + "..."
    return text


