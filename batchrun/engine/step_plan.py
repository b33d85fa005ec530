"""The step plan: every kernel choice of a step, made once by the model runner and carried to
the layers in the step's `Step` (layers/step.py). Layers read it; none decides a kernel.

What a plan fixes, besides the graphs the step replays (cudagraph_dispatcher.dispatch) and its
LoRA part (`Step.lora`: None when no token has an adapter; its slot bound `num_slots` and
whether deltas ride into the next kernel, `fuse`):

- the GEMM each projection kind runs (`GemmPlan`): cuBLAS, or, on steps of at most MAX_ROWS
  rows (decode at latency batch sizes: what a graph of batch <= 16 replays), batchrun's
  Triton GEMM that only streams the weight (kernels/skinny_gemm.py), when all of these hold:
  the experiment switch `triton_decode_gemm` is on, Triton runs (CUDA, or
  BATCHRUN_FORCE_TRITON on CPU for tests), the dtype is fp16 / bf16, and the weight has at
  least MIN_WEIGHT_ELEMENTS elements. Narrower weights give too few programs (N / 32) too
  little of W each, and cuBLAS (with split-K) keeps up or wins (docs/benchmarks.md). Steps of more rows
  (a throughput batch's decode, prefill) stay on cuBLAS;
- whether gate_up runs in the fused GEMM + SiLU kernel (`gate_up_silu`: when it takes the
  skinny GEMM), with its LoRA shrink computed by the norm before it on fused LoRA steps.

The choice depends only on the step's row count, the model's dtype and weight shapes and the
device, so a given step shape always takes the same kernels: graph replay equals eager, and a
no-LoRA step of a LoRA engine launches exactly the LoRA-disabled engine's kernels.
"""
from __future__ import annotations

import torch

from batchrun.engine.layers.backend import use_triton
from batchrun.engine.layers.fp8 import scaled_mm_takes
from batchrun.engine.layers.step import GEMM_KINDS, GemmPlan

MAX_ROWS = 16  # kernels/skinny_gemm.py's MAX_ROWS
MIN_WEIGHT_ELEMENTS = 12288 * 4096  # 48M: Llama-2-7b's qkv_proj takes it, down_proj (45M) not
_HALF = (torch.float16, torch.bfloat16)


def gemm_kernel(enabled: bool, rows: int, probe: torch.Tensor, shape: tuple[int, int]) -> str | None:
    """The GEMM a [rows, K] input @ [N, K].T weight runs in: "skinny" or None (cuBLAS).
    probe: a tensor of the step's device and the model's dtype."""
    if not (enabled and rows <= MAX_ROWS and probe.dtype in _HALF and use_triton(probe)):
        return None
    n, k = shape
    return "skinny" if n * k >= MIN_WEIGHT_ELEMENTS else None


def fp8_kernel(enabled: bool, rows: int, probe: torch.Tensor, shape: tuple[int, int],
               block) -> str | None:
    """An FP8 projection's GEMM (layers/fp8.py): "fp8", batchrun's Triton scaled GEMM, at
    decode's few rows (with the experiment switch on: it streams the e4m3 weight once) and
    wherever torch._scaled_mm cannot run the layer (block scales, a non-bf16 model, dimensions
    not multiples of 16); None: torch._scaled_mm. CPU runs the reference math either way."""
    if not use_triton(probe):
        return None
    if (enabled and rows <= MAX_ROWS) or not scaled_mm_takes(probe.dtype, *shape, block):
        return "fp8"
    return None


def plan_gemms(enabled: bool, rows: int, probe: torch.Tensor,
               shapes: dict[str, tuple[int, int]], fp8: dict | None = None) -> GemmPlan:
    """The GemmPlan of a forward over `rows` rows; shapes: each projection kind's weight shape
    [N, K] (every layer's projection of one kind has the same shape); fp8: the FP8 kinds and
    their weight blocks (None for per-row scales)."""
    fp8 = fp8 or {}
    return GemmPlan(**{kind: fp8_kernel(enabled, rows, probe, shapes[kind], fp8[kind])
                       if kind in fp8 else gemm_kernel(enabled, rows, probe, shapes[kind])
                       for kind in GEMM_KINDS})


def _linears(model) -> dict:
    """Each projection kind's Linear: layer 0's attention, the first dense MLP's (a
    mixture-of-experts model whose every layer routes has no gate_up/down Linear)."""
    layers = model.model.layers
    attn = layers[0].self_attn
    dense = next((layer.mlp for layer in layers if hasattr(layer.mlp, "gate_up_proj")), None)
    linears = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
    if dense is not None:
        linears.update({"gate_up_proj": dense.gate_up_proj, "down_proj": dense.down_proj})
    return linears


def weight_shapes(model) -> dict[str, tuple[int, int]]:
    """Each projection kind's weight shape [N, K] (layer 0's; the layers are alike). A
    mixture-of-experts model's dense MLP shapes are those of its first layer with a dense MLP;
    with none (every layer routed: no gate_up/down Linear runs), (0, 0), which takes cuBLAS."""
    shapes = {kind: (m.out_features, m.in_features) for kind, m in _linears(model).items()}
    shapes.setdefault("gate_up_proj", (0, 0))
    shapes.setdefault("down_proj", (0, 0))
    shapes["lm_head"] = tuple(model.lm_head.weight.shape)
    return shapes


def fp8_kinds(model) -> dict:
    """The FP8 projection kinds (layer 0's; a scheme quantizes a kind in every layer or
    models/loader.py refuses) -> their weight block, None for per-row scales."""
    return {kind: m.quant.block for kind, m in _linears(model).items() if m.quant is not None}
