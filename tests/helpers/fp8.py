"""FP8 checkpoints of tiny random HF models, and the reference they must match.

`save_fp8_checkpoint` writes a model the way the published tools do: compressed-tensors
`float-quantized` (weights per tensor, per channel or in blocks; activations dynamic per token
or tensor, or static with an input_scale) or HF `fp8` with `weight_block_size` and
`weight_scale_inv`. `fp8_reference` is the HF model running the declared quantized math in
fp32: each quantized Linear's weight replaced by its dequantized FP8 weight, and its input
quantized by a forward pre-hook as the scheme says (static: the largest input_scale of the
modules that share the input, which is what one fused projection can apply).
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchrun.kernels.reference import FP8_MAX, FP8_MIN_SCALE, ref_dequant_fp8, ref_quant_fp8

PROJ = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$")
SHARED_INPUT = {"self_attn.q_proj": "qkv", "self_attn.k_proj": "qkv", "self_attn.v_proj": "qkv",
                "mlp.gate_proj": "gate_up", "mlp.up_proj": "gate_up"}

# name -> (format, weights, activations, block)
SCHEMES = {
    "ct_channel_token": ("compressed-tensors", "channel", "token", None),
    "ct_tensor_tensor": ("compressed-tensors", "tensor", "tensor", None),
    "ct_tensor_static": ("compressed-tensors", "tensor", "static", None),
    "ct_channel_static": ("compressed-tensors", "channel", "static", None),
    "ct_block": ("compressed-tensors", "block", "group", (32, 32)),
    "hf_block": ("fp8", "block", "group", (32, 32)),
}


def quantization_config(scheme: str, ignore: list[str]) -> dict:
    fmt, weights, acts, block = SCHEMES[scheme]
    if fmt == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic",
                "weight_block_size": list(block), "modules_to_not_convert": ignore}
    w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
         "strategy": weights}
    if block:
        w["block_structure"] = list(block)
    a = {"num_bits": 8, "type": "float", "symmetric": True,
         "dynamic": acts != "static", "strategy": "tensor" if acts == "static" else acts}
    if acts == "group":
        a["group_size"] = block[1]
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": a}},
            "ignore": ["lm_head", *ignore]}


def quantize_weight(w: torch.Tensor, weights: str, block) -> tuple[torch.Tensor, torch.Tensor]:
    wf = w.float()
    if weights == "block":
        bn, bk = block
        N, K = wf.shape
        pad = torch.nn.functional.pad(wf.abs(), (0, -K % bk, 0, -N % bn))
        amax = pad.view(pad.shape[0] // bn, bn, pad.shape[1] // bk, bk).amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        full = scale.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    elif weights == "tensor":
        scale = (wf.abs().amax() / FP8_MAX).clamp(min=FP8_MIN_SCALE).reshape(1)
        full = scale
    else:
        scale = (wf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=FP8_MIN_SCALE)
        full = scale
    return (wf / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def save_fp8_checkpoint(hf, path: Path, scheme: str, ignore: list[str] = (),
                        input_scales: dict | None = None, tokenizer=None) -> dict:
    """Save HF model `hf` as an FP8 checkpoint of `scheme` (SCHEMES) under `path`; modules
    named in `ignore` stay unquantized. Returns {module: (w_q, w_scale, input_scale)}."""
    fmt, weights, acts, block = SCHEMES[scheme]
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(path))
    for f in path.glob("*.safetensors"):
        f.unlink()
    state, quantized = {}, {}
    g = torch.Generator().manual_seed(7)
    for name, t in hf.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and PROJ.match(module) and module not in ignore:
            q, s = quantize_weight(t, weights, block)
            state[name] = q
            state[f"{module}.{'weight_scale_inv' if fmt == 'fp8' else 'weight_scale'}"] = s
            inp = None
            if acts == "static":
                inp = (input_scales or {}).get(module)
                if inp is None:  # a calibrated-looking scale: around the inputs' amax / 448
                    inp = torch.rand(1, generator=g) * 0.01 + 0.005
                state[f"{module}.input_scale"] = inp
            quantized[module] = (q, s, inp)
        else:
            state[name] = t.contiguous()
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(scheme, list(ignore))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return quantized


def fp8_reference(hf, quantized: dict, scheme: str):
    """A copy of `hf` computing the declared FP8 math in fp32 (see the module docstring)."""
    _, weights, acts, block = SCHEMES[scheme]
    ref = copy.deepcopy(hf).float().eval()
    shared = {}
    for module, (_, _, inp) in quantized.items():
        if inp is not None:
            layer, kind = module.split(".", 3)[:3], module.split(".", 3)[3]
            key = (".".join(layer), SHARED_INPUT.get(kind, kind))
            shared[key] = max(shared.get(key, 0.0), float(inp))
    for module, (q, s, inp) in quantized.items():
        lin = ref.get_submodule(module)
        with torch.no_grad():
            lin.weight.copy_(ref_dequant_fp8(q, s.reshape(-1) if s.numel() > 1 and block is None
                                             else s, block))
        if acts == "static":
            layer, kind = module.split(".", 3)[:3], module.split(".", 3)[3]
            static = torch.tensor([shared[(".".join(layer), SHARED_INPUT.get(kind, kind))]])
        else:
            static = None
        lin.register_forward_pre_hook(_quant_input(acts, block, static))
    return ref


def _quant_input(acts: str, block, static):
    def hook(_, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1]).float()
        if acts == "token":
            xq, xs = ref_quant_fp8(flat)
            xd = xq.float() * xs
        elif acts == "tensor":
            amax = flat.abs().amax().reshape(1)
            xq, xs = ref_quant_fp8(flat, scale=(amax / FP8_MAX).clamp(min=FP8_MIN_SCALE))
            xd = xq.float() * xs
        elif acts == "static":
            xq, xs = ref_quant_fp8(flat, scale=static)
            xd = xq.float() * xs
        else:
            xq, xs = ref_quant_fp8(flat, group=block[1])
            xd = ref_dequant_fp8(xq, xs, (1, block[1]))
        return (xd.reshape(x.shape).to(x.dtype),) + tuple(args[1:])
    return hook


def fp8_kv_attention(hf, scales: dict | None = None):
    """Make `hf` (a Llama-family model, eager attention) attend over K and V rounded to e4m3 as
    an FP8 KV cache stores them: K / k_scale and V / v_scale saturated at +-448, times the scale
    again. scales: {layer: (k_scale, v_scale)}; 1.0 where missing."""
    import importlib
    from transformers import AttentionInterface
    module = importlib.import_module(type(hf).__module__)
    eager = module.eager_attention_forward

    def attention(mod, query, key, value, attention_mask, **kw):
        k_scale, v_scale = (scales or {}).get(mod.layer_idx, (1.0, 1.0))
        rt = lambda x, s: ((x.float() / s).clamp(-FP8_MAX, FP8_MAX)  # noqa: E731
                           .to(torch.float8_e4m3fn).float() * s).to(x.dtype)
        return eager(mod, query, rt(key, k_scale), rt(value, v_scale), attention_mask, **kw)

    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register("batchrun_fp8_kv", attention)
    AttentionMaskInterface.register("batchrun_fp8_kv", eager_mask)  # the causal mask eager gets
    hf.set_attn_implementation("batchrun_fp8_kv")
    return hf
