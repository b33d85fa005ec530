"""FP8 linear layers: the scheme a checkpoint's `quantization_config` declares, or the one
`engine.quantization: fp8` applies at load time, read into one `QuantScheme`.

Every scheme stores e4m3 weights (symmetric, no zero point) and computes
y = (x_q * x_scale) @ (w_q * w_scale).T with fp32 sums (kernels/reference.py ref_fp8_linear
is the definition). What differs is the scales' granularity:

- weights "channel": one fp32 scale per output row. A per-tensor scale (compressed-tensors
  strategy `tensor`) is stored as that scale repeated over the tensor's rows: the products are
  the same, and a fused q/k/v or gate/up whose slices each have their own scale stays one GEMM.
  Activations are quantized per token at run time ("token", the accurate choice and the
  on-the-fly default), per tensor at run time ("tensor"), or with the checkpoint's input_scale
  ("static"; a fused layer uses the largest of its slices' scales, as vLLM does, since the slices
  share one input).
- weights "block": one scale per [bn, bk] block (HF `fp8` with `weight_block_size`, saved as
  `weight_scale_inv`; compressed-tensors strategy `block`); activations per token and group of
  bk columns at run time ("group"), as Qwen3-FP8 and DeepSeek declare.

lm_head and the embeddings stay in the model dtype: a checkpoint that quantizes lm_head is
refused (both formats' tools leave it unquantized by default).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from batchrun.errors import ModelLoadError

FP8_METHODS = ("compressed-tensors", "fp8")
MOE_FP8 = ("engine.quantization: fp8 and FP8 checkpoints are not supported for mixture-of-experts "
           "models yet (the fused MoE kernel runs experts in bf16/fp16); run the model's bf16 "
           "release without engine.quantization")
ON_THE_FLY = ("fp8",)  # engine.quantization values
# our fused Linear -> the HF modules it holds, in slice order (models/loader.py FUSED)
HF_SLICES = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "self_attn.o_proj": ("self_attn.o_proj",), "mlp.down_proj": ("mlp.down_proj",)}


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "compressed-tensors" | "fp8" (a checkpoint's) | "fp8-on-the-fly"
    weights: str  # "channel" | "block"
    activations: str  # "token" | "tensor" | "static" | "group"
    block: tuple[int, int] | None = None  # (bn, bk) of "block" weights
    ignore: tuple[str, ...] = ()  # HF module names left unquantized ("re:" prefix: a regex)
    substring_ignore: bool = False  # HF fp8's modules_to_not_convert match as substrings

    @property
    def stored(self) -> bool:
        """The checkpoint holds FP8 weights and scales (False: quantized at load time)."""
        return self.method != "fp8-on-the-fly"

    @property
    def name(self) -> str:
        """How plan, logs and the fingerprint name it, e.g. fp8 (compressed-tensors, weights
        per channel, activations per token)."""
        w = {"channel": "per channel", "block": f"in {self.block[0]}x{self.block[1]} blocks"
             if self.block else ""}[self.weights]
        a = {"token": "per token", "tensor": "per tensor", "static": "static scale",
             "group": f"per token and {self.block[1] if self.block else 0} columns"}[self.activations]
        return f"fp8 ({self.method}, weights {w}, activations {a})"

    def quantizes(self, hf_module: str) -> bool:
        """Whether the HF module (e.g. model.layers.0.mlp.down_proj) holds FP8 weights."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], hf_module):
                    return False
            elif (pattern in hf_module) if self.substring_ignore else pattern == hf_module:
                return False
        return True


def on_the_fly_scheme() -> QuantScheme:
    """engine.quantization: fp8 over a bf16/fp16 checkpoint: per-channel weight scales (each
    output row's own range, so one large row costs the others nothing) with per-token dynamic
    activation scales, the most accurate of the FP8 schemes that run as one scaled GEMM."""
    return QuantScheme("fp8-on-the-fly", "channel", "token")


def with_quantization(cfg, quantization: str | None):
    """The ModelConfig the engine builds: engine.quantization fp8 quantizes an unquantized
    checkpoint at load time; an FP8 checkpoint keeps its own scheme (it is FP8 already)."""
    if quantization is None or cfg.quant is not None:
        return cfg
    if quantization != "fp8":
        raise ValueError(f"engine.quantization {quantization!r}: fp8 or null")
    if getattr(cfg, "experts", None) is not None:
        raise ModelLoadError(MOE_FP8)
    return dataclasses.replace(cfg, quant=on_the_fly_scheme())


def scheme_from_config(q, where: str) -> QuantScheme:
    """config.json's quantization_config -> QuantScheme; any other method or an FP8 variant
    batchrun does not run is refused naming the field."""
    if not isinstance(q, dict):
        raise ModelLoadError(f"{where}: quantization_config must be an object, got {q!r}")
    method = q.get("quant_method", "unnamed")
    if method == "compressed-tensors":
        return _compressed_tensors(q, where)
    if method == "fp8":
        return _hf_fp8(q, where)
    raise ModelLoadError(
        f"{where}: quantization_config.quant_method {method!r} is not supported; batchrun runs "
        f"FP8 checkpoints ({', '.join(FP8_METHODS)}) and unquantized ones (for those, "
        f"engine.quantization: fp8 quantizes at load time)")


def _bad(where: str, field: str, value, want: str) -> ModelLoadError:
    return ModelLoadError(f"{where}: quantization_config.{field} is {value!r}; batchrun runs {want}")


def _compressed_tensors(q: dict, where: str) -> QuantScheme:
    fmt = q.get("format")
    if fmt != "float-quantized":
        raise _bad(where, "format", fmt, "compressed-tensors 'float-quantized' (FP8) checkpoints")
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise _bad(where, "config_groups", sorted(groups), "exactly one config group (one FP8 "
                   "scheme for every quantized Linear)")
    (gname, group), = groups.items()
    field = f"config_groups.{gname}"
    targets = group.get("targets")
    if targets != ["Linear"]:
        raise _bad(where, f"{field}.targets", targets, "targets ['Linear'] (modules left out go "
                   "in 'ignore')")
    w = group.get("weights") or {}
    _check_fp8_args(w, where, f"{field}.weights")
    if w.get("dynamic"):
        raise _bad(where, f"{field}.weights.dynamic", True, "stored (dynamic: false) weights")
    strategy = w.get("strategy")
    block = None
    if strategy in ("tensor", "channel"):
        weights = "channel"
    elif strategy == "block":
        weights, block = "block", _block(w.get("block_structure"), where,
                                         f"{field}.weights.block_structure")
    else:
        raise _bad(where, f"{field}.weights.strategy", strategy, "tensor, channel or block")
    a = group.get("input_activations")
    if a is None:
        raise _bad(where, f"{field}.input_activations", None, "FP8 activations too (W8A8); "
                   "weight-only FP8 is not supported")
    _check_fp8_args(a, where, f"{field}.input_activations")
    astrat, dynamic = a.get("strategy"), a.get("dynamic")
    if weights == "block":
        if not (dynamic is True and astrat == "group" and a.get("group_size") == block[1]):
            raise _bad(where, f"{field}.input_activations", {k: a.get(k) for k in
                       ("strategy", "dynamic", "group_size")},
                       f"block weights with dynamic per-group activations (group_size {block[1]})")
        acts = "group"
    elif dynamic is True and astrat in ("token", "tensor"):
        acts = astrat
    elif dynamic is False and astrat == "tensor":
        acts = "static"
    else:
        raise _bad(where, f"{field}.input_activations", {"strategy": astrat, "dynamic": dynamic},
                   "dynamic token or tensor, or static tensor activations")
    ignore = q.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise _bad(where, "ignore", ignore, "a list of module names or 're:' patterns")
    return QuantScheme("compressed-tensors", weights, acts, block, tuple(ignore))


def _check_fp8_args(args: dict, where: str, field: str) -> None:
    if args.get("type") != "float" or args.get("num_bits") != 8:
        raise _bad(where, field, {k: args.get(k) for k in ("type", "num_bits")},
                   "type float, num_bits 8 (FP8 e4m3)")
    if args.get("symmetric") is False:
        raise _bad(where, f"{field}.symmetric", False, "symmetric FP8 (no zero point)")


def _block(value, where: str, field: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise _bad(where, field, value, "[rows, columns] of positive integers")
    return value[0], value[1]


def _hf_fp8(q: dict, where: str) -> QuantScheme:
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _bad(where, "activation_scheme", scheme, "dynamic activations with FP8 block weights")
    if q.get("weight_block_size") is None:
        raise _bad(where, "weight_block_size", None, "block-scaled FP8 (e.g. [128, 128], as "
                   "Qwen3-FP8 and DeepSeek ship)")
    block = _block(q["weight_block_size"], where, "weight_block_size")
    ignore = q.get("modules_to_not_convert") or []
    if not isinstance(ignore, list) or not all(isinstance(x, str) for x in ignore):
        raise _bad(where, "modules_to_not_convert", ignore, "a list of module names")
    return QuantScheme("fp8", "block", "group", block, tuple(ignore), substring_ignore=True)


_KV_SCALE = re.compile(r"^model\.layers\.\d+\.self_attn\.[kv]_scale$")
FP8_DTYPE = "F8_E4M3"  # the safetensors dtype of e4m3 weights


def scale_names(scheme: QuantScheme) -> tuple[str, ...]:
    """The tensor names beside a quantized module's `weight` in the checkpoint."""
    if scheme.method == "fp8":
        return ("weight_scale_inv",)
    return ("weight_scale", "input_scale") if scheme.activations == "static" else ("weight_scale",)


def scale_shapes(scheme: QuantScheme, name: str, out_features: int,
                 in_features: int) -> tuple[tuple[int, ...], ...]:
    """The shapes a checkpoint may store scale `name` of a [out, in] weight in."""
    if name == "input_scale":
        return ((1,), ())
    if scheme.weights == "block":
        bn, bk = scheme.block
        return ((-(-out_features // bn), -(-in_features // bk)),)
    return ((out_features, 1), (out_features,), (1,), ())


def check_quantized_tensors(scheme: QuantScheme | None, want: dict, found: dict,
                            where: str) -> dict:
    """Check an FP8 checkpoint's weights and scales against the scheme, headers only.
    want: canonical name -> shape (unquantized layout); found: canonical name -> (file, shape,
    stored name, dtype). Returns `want` plus each expected scale (name -> allowed shapes)."""
    want = dict(want)
    for name, (f, _, _, dtype) in found.items():
        module = name.rsplit(".", 1)[0]
        fp8 = dtype == FP8_DTYPE
        if fp8 and not (scheme is not None and scheme.stored and name.endswith(".weight")
                        and module != "lm_head" and _linear(module, want)
                        and scheme.quantizes(module)):
            why = ("batchrun keeps lm_head in the model dtype" if module == "lm_head" else
                   "quantization_config leaves it unquantized" if scheme is not None and
                   scheme.stored else "config.json has no FP8 quantization_config")
            raise ModelLoadError(f"{f}: tensor {name!r} is FP8 ({dtype}) but {why}; the "
                                 f"checkpoint and config.json disagree")
    for name in found:  # an FP8 KV cache's scales, one per layer (kv_cache_scheme)
        if _KV_SCALE.match(name):
            want[name] = ((), (1,))
    if scheme is None or not scheme.stored:
        return want
    for name, shape in list(want.items()):
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and _linear(module, want) and module != "lm_head"
                and scheme.quantizes(module)):
            continue
        if name in found and found[name][3] != FP8_DTYPE:
            raise ModelLoadError(f"{found[name][0]}: tensor {name!r} is {found[name][3]}, but "
                                 f"quantization_config quantizes {module} (FP8 weights, "
                                 f"{FP8_DTYPE}); the checkpoint and config.json disagree")
        for scale in scale_names(scheme):
            want[f"{module}.{scale}"] = scale_shapes(scheme, scale, *shape)
    return want


def _linear(module: str, want: dict) -> bool:
    """A 2-D weight that is a projection (not the embeddings, not a norm)."""
    shape = want.get(f"{module}.weight")
    return shape is not None and len(shape) == 2 and not module.endswith("embed_tokens")


def check_fused_blocks(scheme: QuantScheme, sizes: list[int], module: str, where: str) -> None:
    """Block scales of a fused layer's slices stack only when each slice is whole blocks."""
    if scheme.weights == "block" and len(sizes) > 1:
        bn = scheme.block[0]
        if any(s % bn for s in sizes):
            raise ModelLoadError(
                f"{where}: {module} fuses slices of {sizes} rows, not whole {bn}-row weight "
                f"blocks, so their block scales cannot be stacked; batchrun runs block-scaled "
                f"FP8 where q/k/v and gate/up are multiples of the block rows")
