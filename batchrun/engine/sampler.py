"""Turn fp32 logits into next tokens, the whole batch in tensor ops.

Order (vLLM's): logprobs of the raw logits -> min_tokens mask -> penalties -> greedy argmax, or
temperature -> top-k / top-p -> Gumbel-max draw. Greedy rows are exactly the argmax of the
(penalised) logits.

Sampled rows use the Gumbel-max form (argmax of probs / Exp(1) noise). The noise is counter
based: splitmix64 of (row seed, output position, token id), so a row's tokens depend only on
its seed, its position and its own logits: never on batch-mates, on preemption, or on whether
the run was resumed or split into tasks. No per-row Python loop touches the vocabulary; the
full-vocabulary sort runs only for the rows that set top_p < 1.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from batchrun.engine.config import SamplingParams


@dataclass
class RowState:
    """What the sampler needs of one sequence."""
    params: SamplingParams
    seed: int  # unused by greedy rows
    token_ids: list[int]  # prompt + output so far, as known on the host (read for penalties)
    prompt_len: int
    num_pending: int = 0  # tokens sampled on the device, not yet in token_ids (async steps)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) + self.num_pending - self.prompt_len


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float | None]  # per row; None where the row did not ask for logprobs
    top_logprobs: list[list[tuple[int, float]] | None]


def to_device(values, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the device: torch.tensor(...,
    device=cuda) copies from pageable memory, which synchronises the stream (and so would end
    the overlap of the next step's planning with this one's kernels, steps.py)."""
    t = torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda")
    return t.to(dev, non_blocking=True) if dev.type == "cuda" else t


class PendingSample:
    """A step's sampled tokens (and logprobs) on their way to the host: the device has been
    asked for them and for copies into pinned memory; ``result()`` waits for those copies only,
    not for work queued after them (the next step's kernels)."""

    def __init__(self, tokens: torch.Tensor, want: list[int], ks: list[int],
                 picked: torch.Tensor | None, top_v: torch.Tensor | None, top_i: torch.Tensor | None):
        self.tokens = tokens  # [N] int64 on the device: the next step's input ids of these rows
        self.n, self.want, self.ks = tokens.shape[0], want, ks
        cuda = tokens.device.type == "cuda"
        host = [t if t is None or not cuda else t.to("cpu", non_blocking=True)
                for t in (tokens, picked, top_v, top_i)]
        self._host = host
        self._event = None
        if cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def result(self) -> SampleOutput:
        if self._event is not None:
            self._event.synchronize()
        tokens, picked, top_v, top_i = self._host
        logprobs: list[float | None] = [None] * self.n
        top: list[list[tuple[int, float]] | None] = [None] * self.n
        if self.want:
            picked = picked.tolist()
            if top_v is not None:
                top_v, top_i = top_v.tolist(), top_i.tolist()
            for j, (i, k) in enumerate(zip(self.want, self.ks)):
                logprobs[i] = picked[j]
                top[i] = list(zip(top_i[j][:k], top_v[j][:k])) if k else []
        return SampleOutput(tokens.tolist(), logprobs, top)


def sample(logits: torch.Tensor, rows: list[RowState], eos_ids=()) -> SampleOutput:
    """The rows' next tokens, waiting for them."""
    return sample_async(logits, rows, eos_ids).result()


def sample_async(logits: torch.Tensor, rows: list[RowState], eos_ids=()) -> PendingSample:
    """Queue the sampling of the rows' next tokens on the device; nothing here waits for it."""
    # logits: [N, V] fp32, one row per sequence to sample
    n, vocab = logits.shape
    dev = logits.device
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    want_idx = to_device(want, torch.long, dev) if want else None
    raw_lp = logits[want_idx].float().log_softmax(dim=-1) if want else None

    logits = _mask_min_tokens(logits, rows, eos_ids)
    logits = _apply_penalties(logits, rows)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        idx = to_device(sampled, torch.long, dev)
        params = [rows[i].params for i in sampled]
        probs = _filtered_probs(logits[idx], params)
        seeds = to_device([rows[i].seed for i in sampled], torch.int64, dev)
        steps = to_device([rows[i].num_output for i in sampled], torch.int64, dev)
        noise = exponential_noise(seeds, steps, vocab)
        tokens[idx] = (probs.double() / noise).argmax(dim=-1)

    ks = [rows[i].params.logprobs for i in want]
    picked = top_v = top_i = None
    if want:
        picked = raw_lp.gather(1, tokens[want_idx][:, None])[:, 0]
        if max(ks):
            top_v, top_i = raw_lp.topk(min(max(ks), vocab), dim=-1)
    return PendingSample(tokens, want, ks, picked, top_v, top_i)


def _mask_min_tokens(logits: torch.Tensor, rows: list[RowState], eos_ids) -> torch.Tensor:
    """Rows short of min_tokens cannot pick EOS (unless ignore_eos) or a stop_token_id."""
    row_idx, tok_idx = [], []
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and r.num_output < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
            banned = [t for t in banned if 0 <= t < vocab]
            row_idx += [i] * len(banned)
            tok_idx += banned
    if not row_idx:
        return logits
    logits = logits.clone()
    dev = logits.device
    logits[to_device(row_idx, torch.long, dev), to_device(tok_idx, torch.long, dev)] = float("-inf")
    return logits


def _apply_penalties(logits: torch.Tensor, rows: list[RowState]) -> torch.Tensor:
    """vLLM's presence/frequency penalties (output tokens) and repetition penalty (prompt + output)."""
    pen = [i for i, r in enumerate(rows) if r.params.penalized]
    if not pen:
        return logits
    dev, vocab = logits.device, logits.shape[-1]
    out_counts = _counts([rows[i].token_ids[rows[i].prompt_len:] for i in pen], vocab, dev)
    prompt_seen = _counts([rows[i].token_ids[:rows[i].prompt_len] for i in pen], vocab, dev) > 0
    seen = prompt_seen | (out_counts > 0)
    idx = to_device(pen, torch.long, dev)
    sub = logits[idx]
    rep = to_device([rows[i].params.repetition_penalty for i in pen], sub.dtype, dev)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([rows[i].params.frequency_penalty for i in pen], sub.dtype, dev)[:, None]
    pres = to_device([rows[i].params.presence_penalty for i in pen], sub.dtype, dev)[:, None]
    sub = sub - freq * out_counts.to(sub.dtype) - pres * (out_counts > 0).to(sub.dtype)
    logits = logits.clone()
    logits[idx] = sub
    return logits


def _counts(seqs: list[list[int]], vocab: int, dev) -> torch.Tensor:
    """[len(seqs), vocab] int32: how often each token occurs in each list."""
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.int32, device=dev)
    width = max((len(s) for s in seqs), default=0)
    if width:
        pad = torch.full((len(seqs), width), vocab, dtype=torch.int64)  # column `vocab` = padding
        for i, s in enumerate(seqs):
            pad[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
        counts.scatter_add_(1, pad.to(dev), torch.ones_like(pad, dtype=torch.int32, device=dev))
    return counts[:, :vocab]


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    # logits: [M, V] -> probabilities after temperature, top-k and top-p
    dev = logits.device
    vocab = logits.shape[-1]
    temp = to_device([p.temperature for p in params], logits.dtype, dev)
    logits = logits / temp[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1]
    only_k = [i for i, p in enumerate(params) if p.top_p >= 1 and ks[i] < vocab]
    if only_k:  # top-k alone: a threshold from topk, no sort of the whole vocabulary
        idx = to_device(only_k, torch.long, dev)
        sub = logits[idx]
        k = to_device([ks[i] for i in only_k], torch.long, dev)
        top_vals = sub.topk(max(ks[i] for i in only_k), dim=-1).values
        thresh = top_vals.gather(1, (k - 1)[:, None])
        logits[idx] = sub.masked_fill(sub < thresh, float("-inf"))
    if nucleus:
        idx = to_device(nucleus, torch.long, dev)
        top_k = to_device([ks[i] for i in nucleus], torch.long, dev)
        top_p = to_device([params[i].top_p for i in nucleus], logits.dtype, dev)
        logits[idx] = _top_k_top_p_sorted(logits[idx], top_k, top_p)
    return logits.softmax(dim=-1)


def _top_k_top_p_sorted(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= top_k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the top token always stays)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= before >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


# ---- counter-based Exp(1) noise --------------------------------------------------------------

def _u64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch stores."""
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _u64(0x9E3779B97F4A7C15)
_M1 = _u64(0xBF58476D1CE4E5B9)
_M2 = _u64(0x94D049BB133111EB)
_STEP = _u64(0xD1B54A32D192ED03)
_SEED = _u64(0xA24BAED4963EE407)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, vocab] float64 Exp(1) draws, a pure function of (seed, step, token id).

    splitmix64 over a counter; int64 multiplication wraps modulo 2**64 in torch, which is the
    arithmetic splitmix64 needs.
    """
    tok = torch.arange(vocab, device=seeds.device, dtype=torch.int64)[None, :]
    x = seeds[:, None] * _SEED + steps[:, None] * _STEP + tok
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    z = z ^ _shr(z, 31)
    u = (_shr(z, 11).double() + 0.5) * (2.0 ** -53)  # in (0, 1)
    return -torch.log(u)
