"""What one forward pass needs to know about its step, passed down through `model(...)`.

The model runner builds one `Step` per prefill or decode step (its plan: engine/step_plan.py)
and hands it to the model, which hands `step.attn` to attention and the step to every Linear.
`step.lora is None` means no token of the step has an adapter: every Linear then runs its base
matmul only and no LoRA tensor is read, by construction (no flag on a shared object can say
otherwise). `step.gemm` names the GEMM each projection kind runs. All of it is frozen: nothing
a layer does can change what a later layer (or step) sees.

The tensors in a `LoRAStep` are static buffers allocated once (the LoRA manager's kernel
metadata, the model runner's decode slot buffer), because a captured CUDA graph holds their
addresses; a step only says which of them this step's kernels read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from batchrun.kernels.lora_meta import LoRAKernelMeta
from batchrun.engine.layers.attention import AttnMetadata

GEMM_KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


@dataclass(frozen=True)
class GemmPlan:
    """The GEMM of each projection kind (a Linear's `name`): None = cuBLAS (F.linear),
    "skinny" = the weight-streaming Triton GEMM, "skinny_split" = its split-K form
    (layers/gemm.py runs them; engine/step_plan.py chooses). A LoRA step's stacked [W; A]
    takes its W's kernel."""
    qkv_proj: str | None = None
    o_proj: str | None = None
    gate_up_proj: str | None = None
    down_proj: str | None = None
    lm_head: str | None = None

    def of(self, kind: str) -> str | None:
        return getattr(self, kind)

    @property
    def gate_up_silu(self) -> bool:
        """gate_up runs in the fused GEMM + SiLU kernel (kernels/skinny_gate_up_silu.py)."""
        return self.gate_up_proj == "skinny"


@dataclass(frozen=True)
class LoRAStep:
    """The LoRA part of a step that has at least one adapter token."""
    meta: LoRAKernelMeta  # Punica metadata of the unfused shrink + expand (kernels/lora_meta.py)
    # int32 [>= T] slot per token (-1 = no LoRA) that fused consumers read (LoRADelta): the
    # runner's static decode buffer on a fused decode step (no metadata written at all), the
    # metadata's token_lora_slot on a fused prefill step
    token_slots: Tensor
    # True: a projection whose consumer can fuse (defer=True) computes y and the shrink in one
    # GEMM and hands the delta on (LoRADelta); False: shrink + expand into y (lora/layer.py)
    fuse: bool
    # k, the step's slot bound: every token's slot is < k, so a fused GEMM stacks only the A
    # rows of slots 0..k-1 under the base weight (the A matrices are stored slot-major); one of
    # the manager's `slot_bounds`, which is also what the graph sets are keyed by
    num_slots: int


@dataclass(frozen=True)
class Step:
    attn: AttnMetadata
    lora: LoRAStep | None = None
    gemm: GemmPlan = field(default_factory=GemmPlan)  # default: cuBLAS everywhere
