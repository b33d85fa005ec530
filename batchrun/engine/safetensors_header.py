"""Read a safetensors file's header (tensor names, dtypes, shapes) without torch.

The format: 8 bytes little-endian header length N, then N bytes of JSON
``{name: {"dtype": ..., "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}}``.
Validation and `plan` use this so they never import torch; the engine loads with safetensors.
"""
from __future__ import annotations

import json
import os
import struct

MAX_HEADER = 100 << 20  # the format's own limit for the JSON header


class HeaderError(ValueError):
    pass


def read_header(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)}; HeaderError for a truncated or corrupt file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HeaderError(f"file is {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise HeaderError(f"header length {n} does not fit the file ({size} bytes): truncated or not safetensors")
        raw = f.read(n)
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise HeaderError(f"header is not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise HeaderError("header is not a JSON object")
    out = {}
    data_size = size - 8 - n
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise HeaderError(f"tensor {name!r} has a malformed header entry") from None
        if not (0 <= begin <= end <= data_size):
            raise HeaderError(f"tensor {name!r} points outside the file (truncated?)")
        out[name] = (str(dtype), shape)
    return out
