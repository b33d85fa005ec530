"""`batchrun plan --estimate-tokens`: prompt-token totals from a sample, error rows still exact.

Exact counting tokenizes every row (about 13 us a row on the demo model's character tokenizer:
13 s for 1M rows on one core), which dominates `plan` on big inputs. The plan needs per-row
counts for two things only: the too-long error rows, and the token totals per shard.

* **Error rows stay exact** through an upper bound: ``tokens(row) <= factor * utf8_bytes(row) +
  per_segment + specials`` (``byte_bound``). A row whose bound plus its max_tokens fits
  ``max_model_len`` cannot be too long, so only the rows the bound does not clear are tokenized.
* **Totals are estimated**: every ``stride``-th row is tokenized exactly; the other rows count
  ``specials + ratio * bytes`` with ``ratio`` = the sampled rows' tokens (without specials) per
  byte over the whole job. `plan` marks such totals with "~".

Why the bound holds (``byte_bound`` accepts only pipelines made of the pieces below, anything
else returns None and every row is tokenized):
* the models (BPE, WordPiece, WordLevel, Unigram) give each token at least one character of the
  text they see, or one byte of it (byte fallback), so tokens <= that text's UTF-8 bytes, and a
  character that is itself in the vocabulary costs one token;
* ByteLevel maps each byte to one character (tokens <= original bytes); the splitting
  pre-tokenizers only split or drop text;
* normalizers: NFC/NFD grow UTF-8 text at most 3x and NFKC/NFKD at most 11x (Unicode UAX #15,
  "maximum expansion factor"); Strip/StripAccents only remove; Replace of a literal string by a
  string grows it by units(content)/bytes(pattern); Prepend, ByteLevel's add_prefix_space and
  Metaspace's prepend add a fixed cost to each segment between added tokens;
* an added token (matched in the text before the pipeline) is one token for >= its length in
  bytes; it starts a new segment, so the bound holds only when 1 + per_segment <= the shortest
  added token's length in bytes (checked).
"""
from __future__ import annotations

import json

import numpy as np

ESTIMATE_SAMPLE_ROWS = 8192  # rows tokenized for the ratio: ~0.1 s on the demo tokenizer
_SPLITTERS = {"Split", "Whitespace", "WhitespaceSplit", "Punctuation", "Digits", "CharDelimiterSplit",
              "BertPreTokenizer", "UnicodeScripts"}
_NF_FACTOR = {"NFC": 3, "NFD": 3, "NFKC": 11, "NFKD": 11}
_MODELS = {"BPE", "WordPiece", "WordLevel", "Unigram"}


class _Unsupported(Exception):
    pass


def _units(text: str, in_vocab) -> int:
    """Most tokens ``text`` can become: 1 for one vocabulary character, else its UTF-8 bytes."""
    return 1 if len(text) == 1 and in_vocab(text) else len(text.encode())


def _normalizer(n, in_vocab) -> tuple[float, float, bool]:
    """(factor, per_segment, discounted) of a normalizer; discounted: some character was counted
    below its byte length, after which a byte-expanding NF form is not bounded by the factor."""
    if n is None:
        return 1.0, 0.0, False
    kind = n.get("type")
    if kind == "Sequence":
        f, a, disc = 1.0, 0.0, False
        for item in n.get("normalizers") or []:
            f2, a2, d2 = _normalizer(item, in_vocab)
            if disc and item.get("type") in _NF_FACTOR:
                raise _Unsupported("an NF form after a replacement")
            f, a, disc = f * f2, a * f2 + a2, disc or d2
        return f, a, disc
    if kind in _NF_FACTOR:
        return float(_NF_FACTOR[kind]), 0.0, False
    if kind in ("Strip", "StripAccents"):
        return 1.0, 0.0, False
    if kind == "Prepend":
        c = n.get("prepend") or ""
        return 1.0, float(_units(c, in_vocab)), _units(c, in_vocab) < len(c.encode())
    if kind == "Replace":
        pat, c = (n.get("pattern") or {}).get("String"), n.get("content") or ""
        if not pat:
            raise _Unsupported("a regex Replace")
        u = _units(c, in_vocab)
        return max(1.0, u / len(pat.encode())), 0.0, u < len(c.encode())
    raise _Unsupported(f"normalizer {kind}")


def _pre_tokenizer(p, in_vocab) -> tuple[float, float]:
    if p is None:
        return 1.0, 0.0
    kind = p.get("type")
    if kind == "Sequence":
        f, a = 1.0, 0.0
        for item in p.get("pretokenizers") or []:
            f2, a2 = _pre_tokenizer(item, in_vocab)
            f, a = f * f2, a * f2 + a2
        return f, a
    if kind in _SPLITTERS:
        return 1.0, 0.0
    if kind == "ByteLevel":
        return 1.0, 1.0 if p.get("add_prefix_space") else 0.0
    if kind == "Metaspace":
        u = float(_units(p.get("replacement") or "\u2581", in_vocab))
        prepend = p.get("prepend_scheme", "always" if p.get("add_prefix_space", True) else "never")
        return max(1.0, u), u if prepend != "never" else 0.0
    raise _Unsupported(f"pre-tokenizer {kind}")


def byte_bound(backend) -> tuple[float, float] | None:
    """(factor, per_segment) with tokens <= factor * bytes + per_segment (post-processor specials
    not included) for every text, or None when the pipeline has a piece this bound is not proven
    for (module docstring)."""
    spec = json.loads(backend.to_str())
    in_vocab = lambda ch: backend.token_to_id(ch) is not None
    try:
        if (spec.get("model") or {}).get("type") not in _MODELS:
            raise _Unsupported("model")
        f1, a1, _ = _normalizer(spec.get("normalizer"), in_vocab)
        f2, a2 = _pre_tokenizer(spec.get("pre_tokenizer"), in_vocab)
    except _Unsupported:
        return None
    factor, per_segment = f1 * f2, a1 * f2 + a2
    added = [len(t["content"].encode()) for t in spec.get("added_tokens") or [] if t.get("content")]
    if per_segment and added and 1 + per_segment > min(added):
        return None
    return factor, per_segment


class Estimate:
    """Per-shard totals for one job: exact counts of sampled rows, bytes of the others."""

    def __init__(self, counter, add_special_tokens: bool, total_rows: int, shards: int):
        backend = counter.backend
        self.bound = byte_bound(backend) if backend is not None else None
        self.specials = backend.num_special_tokens_to_add(False) if backend is not None and add_special_tokens else 0
        self.stride = max(1, total_rows // ESTIMATE_SAMPLE_ROWS)
        self.exact = np.zeros(shards, dtype=np.int64)  # tokens of the rows counted exactly
        self.rest_bytes = np.zeros(shards, dtype=np.int64)  # bytes / rows of the rows not counted
        self.rest_rows = np.zeros(shards, dtype=np.int64)
        self.sample_tokens = self.sample_bytes = self.sampled = 0

    def must_count(self, nbytes: np.ndarray, first_row: int, room: np.ndarray) -> np.ndarray:
        """Rows to tokenize: the sample (every stride-th row of the job) and, for the error-row
        check, every row whose bound exceeds ``room`` (max_model_len - its max_tokens); all
        rows when the tokenizer has no proven bound."""
        idx = np.arange(first_row, first_row + len(nbytes))
        sample = idx % self.stride == 0
        if self.bound is None:
            return np.ones(len(nbytes), dtype=bool)
        f, a = self.bound
        return sample | (f * nbytes + a + self.specials > room)

    def add(self, codes, nbytes, keep, counted, lens, first_row: int) -> None:
        """One batch: ``counted`` rows have exact ``lens``; the other kept rows are estimated."""
        sample = (np.arange(first_row, first_row + len(codes)) % self.stride == 0) & keep & counted
        self.sample_tokens += int((lens[sample] - self.specials).sum())
        self.sample_bytes += int(nbytes[sample].sum())
        self.sampled += int(sample.sum())
        n = len(self.exact)
        exact = keep & counted
        self.exact += np.bincount(codes[exact], weights=lens[exact], minlength=n).astype(np.int64)
        rest = keep & ~counted
        self.rest_bytes += np.bincount(codes[rest], weights=nbytes[rest], minlength=n).astype(np.int64)
        self.rest_rows += np.bincount(codes[rest], minlength=n).astype(np.int64)

    def totals(self) -> np.ndarray:
        ratio = self.sample_tokens / self.sample_bytes if self.sample_bytes else 1.0
        return self.exact + np.rint(self.rest_rows * self.specials + self.rest_bytes * ratio).astype(np.int64)

    @property
    def estimated(self) -> bool:
        return bool(self.rest_rows.any())

    def note(self) -> str:
        if self.bound is None:
            return ("(prompt tokens exact: this tokenizer's pipeline has no proven byte bound "
                    "(batchrun/job/inputs/token_estimate.py), so every row was tokenized)")
        if not self.estimated:
            return "(prompt tokens exact: every row needed its exact count)"
        return (f"~ estimated: {self.sampled} sampled rows (every {self.stride}th) give "
                f"{self.sample_tokens / max(self.sample_bytes, 1):.3f} tokens per byte; error rows are exact")
