"""Where the engine's requests come from: a source it pulls from as the batch has room.

``Engine.generate_stream`` calls ``take(n, wait)`` whenever fewer than ``max_num_seqs``
sequences are waiting. ``wait=False`` (the engine has work): return what is ready now, up to
``n``, possibly ``[]``. ``wait=True`` (the engine is idle): block until at least one request is
ready. ``None``: the source has ended and will give nothing more. An exception raised by
``take`` (e.g. a background reader's error) stops the engine and reaches its caller.
"""
from __future__ import annotations

from itertools import islice
from typing import Iterable, Iterator, Protocol

from batchrun.engine.request import Request


class RequestSource(Protocol):
    def take(self, n: int, wait: bool) -> list[Request] | None: ...


class ListSource:
    """A list (or any iterable) pulled in order; ends when it is exhausted."""

    def __init__(self, requests: Iterable[Request]):
        self._it: Iterator[Request] = iter(requests)

    def take(self, n: int, wait: bool) -> list[Request] | None:
        got = list(islice(self._it, max(n, 1)))
        return got or None


def as_source(source) -> RequestSource:
    if hasattr(source, "take"):
        return source
    if hasattr(source, "__iter__"):
        return ListSource(source)
    raise TypeError(f"generate_stream needs a RequestSource (take(n, wait)) or an iterable of Requests, "
                    f"got {type(source).__name__}")
