"""How close `bench latency`'s decode gets to its physical limit: a decode step must read every
weight it multiplies by (all projections and lm_head; the embedding table only for the step's
rows) and the K/V of every row's context once, so at small batches its floor is those bytes at
the GPU's HBM bandwidth. Peak bandwidths are the vendors' figures for the cards we run on; on
another card (or CPU) the achieved rate is reported without a fraction.
"""
from __future__ import annotations

from batchrun.bench.engine_stats import weight_bytes

# HBM peak, bytes/s, by a substring of torch.cuda.get_device_name() (first match wins)
HBM_PEAK = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12),
            ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12), ("A100", 1.555e12))


# bf16 dense tensor-core peak, FLOP/s (vendors' figures; the H200 has the H100 SXM's compute)
BF16_PEAK = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12),
             ("A100", 312e12))


def hbm_peak(device_name: str) -> float | None:
    for key, peak in HBM_PEAK:
        if key in device_name:
            return peak
    return None


def bf16_peak(device_name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK if key in device_name), None)


def experts_read(cfg, batch_size: int) -> float:
    """How many of a routed layer's experts a decode step of `batch_size` rows reads, expected
    under uniform routing (each row picks top_k of num_experts; random weights route close to
    uniformly): E * (1 - (1 - k/E)^B). 0 for a dense model."""
    e = cfg.experts
    if e is None:
        return 0.0
    return e.num_experts * (1 - (1 - e.top_k / e.num_experts) ** batch_size)


def decode_bytes_per_step(engine, batch_size: int, avg_context: float) -> dict:
    """Bytes one decode step of `batch_size` rows must read: the weights of every projection
    and lm_head (a tied lm_head reads the embedding table), of a mixture-of-experts model only
    the experts its rows route to (`experts_read`), and each row's K/V."""
    model = engine.model
    embed = model.model.embed_tokens.weight
    weights = weight_bytes(model)  # the embedding table once: read by a tied lm_head only
    if model.lm_head.weight.data_ptr() != embed.data_ptr():
        weights -= embed.numel() * embed.element_size()
    cfg = model.config
    out = {}
    if cfg.experts is not None:  # the experts no row routes to are not read
        e, elem = cfg.experts, embed.element_size()
        per_expert = 3 * cfg.hidden_size * e.intermediate_size * elem
        routed = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        read = experts_read(cfg, batch_size)
        weights -= int(routed * (e.num_experts - read) * per_expert)
        out = {"experts_read_per_layer": read, "experts_bytes": int(routed * read * per_expert)}
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * \
        engine.runner.kv_cache.element_size()
    return {"weights_bytes": weights, "kv_bytes": int(batch_size * avg_context * kv_per_token), **out}


def decode_roofline(engine, device_name: str, batch_size: int, input_len: int, output_len: int,
                    decode_ms: float | None) -> dict | None:
    """The decode step's floor and the fraction of it a measured `decode_ms` reaches."""
    if decode_ms is None or decode_ms <= 0:
        return None
    avg_context = input_len + output_len / 2  # contexts grow from input_len to input_len + output_len
    b = decode_bytes_per_step(engine, batch_size, avg_context)
    total = b["weights_bytes"] + b["kv_bytes"]
    rate = total / (decode_ms * 1e-3)
    peak = hbm_peak(device_name)
    return {**b, "bytes_per_step": total, "achieved_bytes_per_s": rate, "hbm_peak_bytes_per_s": peak,
            "floor_ms": None if peak is None else total / peak * 1e3,
            "fraction_of_peak": None if peak is None else rate / peak}


def format_roofline(r: dict | None) -> str:
    if r is None:
        return "roofline: n/a (no decode time)"
    head = (f"decode roofline: {r['bytes_per_step'] / 1e9:.2f} GB a step (weights "
            f"{r['weights_bytes'] / 1e9:.2f}, K/V {r['kv_bytes'] / 1e9:.2f}) at "
            f"{r['achieved_bytes_per_s'] / 1e12:.2f} TB/s")
    if r["hbm_peak_bytes_per_s"] is None:
        return head + " (HBM peak of this device unknown)"
    return (head + f" = {r['fraction_of_peak']:.1%} of the {r['hbm_peak_bytes_per_s'] / 1e12:.2f} "
            f"TB/s HBM peak (floor {r['floor_ms']:.3f} ms a step)")


def offline_floor(cfg, num_prompts: int, prompt_len: int, output_len: int, max_num_seqs: int,
                  device_name: str, fp8_weights: bool = False, fp8_kv: bool = False) -> dict | None:
    """The offline workload's physical limit on this card: prefill at the dense peak (the
    projections' and attention's FLOPs), then waves of max_num_seqs rows decoding, each step
    max(its FLOPs at the dense peak, its weights at HBM peak) + its rows' K/V at HBM peak (the
    step floor benchmarks/offline_step_profile.py measures against). Contexts shorter than
    any sliding window are assumed (the benchmark's 384 tokens). fp8_weights: the decoder's
    projections (experts included) are 1 byte each and multiply at twice the bf16 rate; lm_head
    stays bf16; fp8_kv: K/V 1 byte each."""
    from batchrun.engine.models.size import active_params, expert_params, num_params
    peak, hbm = bf16_peak(device_name), hbm_peak(device_name)
    if peak is None or hbm is None:
        return None
    dtype_bytes = 2
    h, v, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    # matmul parameters a token meets: everything but the embedding lookup (a tied lm_head
    # multiplies by the embedding table, so it counts once either way); of a mixture-of-experts
    # model its top_k experts a layer
    embed = 0 if cfg.tie_word_embeddings else v * h
    head = v * h  # lm_head's weights (the embedding table when tied): bf16 either way
    matmul = active_params(cfg) - embed
    experts = expert_params(cfg)
    per_expert_read = 0 if cfg.experts is None else experts / cfg.experts.num_experts
    w_bytes = 1 if fp8_weights else dtype_bytes

    def weights(rows: int) -> float:  # bytes a step of `rows` rows reads: the experts they reach
        body = num_params(cfg) - embed - head - experts + experts_read(cfg, rows) * per_expert_read
        return body * w_bytes + head * dtype_bytes

    if fp8_weights:  # the projections at twice the FLOP rate, lm_head at bf16's
        peak = peak * matmul / ((matmul - head) / 2 + head)
    attn = 4 * layers * cfg.num_attention_heads * cfg.head_dim  # FLOPs per (query, key) pair
    kv_token = 2 * layers * cfg.num_key_value_heads * cfg.head_dim * (1 if fp8_kv else dtype_bytes)
    prefill_flops = num_prompts * (2 * matmul * prompt_len + attn * prompt_len * (prompt_len + 1) / 2)
    prefill_s = prefill_flops / peak
    decode_s, left = 0.0, num_prompts
    while left > 0:
        rows = min(left, max_num_seqs)
        for i in range(output_len):
            ctx = prompt_len + i + 1
            flops = rows * (2 * matmul + attn * ctx)
            decode_s += max(flops / peak, weights(rows) / hbm) + rows * ctx * kv_token / hbm
        left -= rows
    total = prefill_s + decode_s
    return {"prefill_s": prefill_s, "decode_s": decode_s, "floor_s": total,
            "tok_s": num_prompts * (prompt_len + output_len) / total,
            "bf16_peak_flop_s": peak, "hbm_peak_bytes_per_s": hbm}
