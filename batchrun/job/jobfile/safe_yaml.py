"""yaml.safe_load with a size bound: a job file that expands (aliases counted at every use) past
MAX_YAML_NODES values, or that is recursive or nests too deeply, is refused with a ConfigError
before any Python object is constructed."""
from __future__ import annotations

from typing import Any

import yaml

from batchrun.errors import ConfigError

MAX_YAML_NODES = 100_000


def load_yaml(text: str) -> Any:
    """yaml.safe_load, but refuses documents that expand past MAX_YAML_NODES values (aliases
    counted at every use) or that are recursive, before any Python object is constructed."""
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError("job file nests too deeply; a job file is a small mapping") from None
        if node is None:  # empty document: parse_job reports the missing fields
            return None
        _check_size(node, MAX_YAML_NODES)
        try:
            return loader.construct_document(node)
        except RecursionError:
            raise ConfigError("job file nests too deeply; a job file is a small mapping") from None
        except (ValueError, OverflowError) as e:  # e.g. an integer over Python's digit limit
            msg = str(e)
            raise ConfigError(f"not valid YAML: {msg if len(msg) <= 300 else msg[:297] + '...'}") from None
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_size(root: yaml.Node, limit: int) -> None:
    """Raise ConfigError if the composed node graph expands to more than ``limit`` values.

    An alias is the same node object used again, so the expanded size is a tree count over a DAG;
    memoising by node identity keeps this O(nodes), and an iterative walk keeps deep documents
    from overflowing the stack. A node reached again while still open is a recursive alias.
    """
    size: dict[int, int] = {}  # id(node) -> expanded size (capped at limit + 1)
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        nid = id(node)
        if done:
            open_.discard(nid)
            size[nid] = min(limit + 1, 1 + sum(size[id(c)] for c in _children(node)))
            continue
        if nid in size:
            continue
        if nid in open_:
            raise ConfigError("job file has a recursive YAML alias (an anchor used inside itself); "
                              "a job file is a small mapping")
        open_.add(nid)
        stack.append((node, True))
        for child in _children(node):
            cid = id(child)
            if cid in open_:
                raise ConfigError("job file has a recursive YAML alias (an anchor used inside "
                                  "itself); a job file is a small mapping")
            if cid not in size:
                stack.append((child, False))
    if size[id(root)] > limit:
        raise ConfigError(f"job file expands to more than {limit} values (YAML aliases/anchors?); "
                          "a job file is a small mapping")
