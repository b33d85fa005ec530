"""The LoRA hook attached to a fused Linear (`Linear.lora`).

The hook takes over the Linear's storage: weight and the A matrices of every slot live in one
tensor `weight_full` [N + L*S*R, K], slot-major (rows N + (l*S + s)*R + r hold A[slice s, slot l,
rank r]), and `linear.weight` becomes the view of its first N rows. Slot-major, the A rows of
slots 0..k-1 are one contiguous block right under the weight, so a fused step whose tokens use
only slots below k (`LoRAStep.num_slots`) streams k slots' A rows, not all L.

A step without LoRA tokens (`Step.lora is None`) never reaches the hook: `Linear.forward`
runs its GEMM on `linear.weight`, the same call (and kernel) as without LoRA. The hook gets
the step's `LoRAStep` and the GEMM kernel the step plan names for this projection
(engine/step_plan.py; W's kernel, so W's columns come out as in a no-LoRA step) and has two
cases:

- a fused step (`LoRAStep.fuse`, set on the Triton path for decode steps and for prefill steps
  of up to `lora_fused_max_tokens` tokens) and a caller that can fuse (`defer`): one GEMM with
  the first N + k*S*R rows of `weight_full` computes y and the shrink of slots < k together,
  and the delta (shrunk . B) is returned as a LoRADelta for the next kernel to add: no LoRA
  launch of its own;
- a fused step and a caller whose next op takes no delta (Qwen3's and Gemma 3's q/k norms
  come between qkv_proj and the rotary): the same GEMM, then the delta is added to y at once
  (`add_delta`: the norms' delta kernel, one launch per slice);
- otherwise (larger prefills, CPU): y = x W.T, then the Punica shrink + expand add the delta
  in place (kernels on CUDA, torch references on CPU).

An FP8 projection (layers/fp8.py) cannot share a GEMM with bf16 A rows: its fused step runs
the FP8 GEMM, then the shrink over the A rows of slots < k, and hands the delta on the same way.

gate_up on a fused step whose plan runs it in the fused GEMM + SiLU kernel
(`GemmPlan.gate_up_silu`) does not call the hook: that kernel streams only W, the norm before
it computes the shrink (`shrink_for`, kernels/rms_norm_shrink.py) and the kernel's epilogue
adds the delta (`delta_from`) before the SiLU (models/decoder.py's MLP).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from batchrun.kernels.lora_meta import LoRADelta, LoRAShrink
from batchrun.engine.layers import gemm
from batchrun.engine.layers.backend import use_triton
from batchrun.engine.layers.step import LoRAStep
from batchrun.engine.lora import punica


class LoRALinear:
    def __init__(self, manager, linear, max_loras: int, max_rank: int):
        self.manager = manager  # owns the scratch shared by all hooks (shrink_buffer)
        self.output_sizes = list(linear.output_sizes)
        S, N, K = len(self.output_sizes), linear.out_features, linear.in_features
        offs = [0]
        for n in self.output_sizes:
            offs.append(offs[-1] + n)
        self.slice_offsets = tuple(offs)
        w, dtype = linear.weight, manager.dtype
        # Allocated once, written in place when a slot is loaded (captured graphs hold the
        # pointers). A and B are zero beyond an adapter's rank and for slices or layers it does
        # not target, so those contribute nothing.
        # An FP8 projection keeps its e4m3 weight and scales; the adapters stay in the model
        # dtype, their A rows in a tensor of their own (`weight_full` holds only them), and
        # a fused step runs the FP8 GEMM and the shrink GEMM one after the other.
        self.fp8 = linear.quant is not None
        rows = S * max_loras * max_rank
        self.weight_full = torch.zeros(rows if self.fp8 else N + rows, K, device=w.device,
                                       dtype=dtype)
        self.bias_full = None
        if not self.fp8:
            self.weight_full[:N].copy_(w)
            linear.weight = nn.Parameter(self.weight_full[:N], requires_grad=False)
            if linear.bias is not None:
                self.bias_full = torch.zeros(self.weight_full.shape[0], device=w.device, dtype=dtype)
                self.bias_full[:N].copy_(linear.bias)
                linear.bias = nn.Parameter(self.bias_full[:N], requires_grad=False)
        # [S, L, R, K] view of the slot-major rows (strided over S and L)
        a_rows = self.weight_full if self.fp8 else self.weight_full[N:]
        self.lora_a = a_rows.view(max_loras, S, max_rank, K).transpose(0, 1)
        self.lora_b = torch.zeros(max_loras, N, max_rank, device=w.device, dtype=dtype)

    @property
    def num_slices(self) -> int:
        return len(self.output_sizes)

    def set_slot(self, slot: int, slices: dict[int, tuple[Tensor, Tensor]]) -> None:
        """Write one adapter into `slot`: slices maps slice index -> (A [r, in], B [out_s, r])."""
        self.clear_slot(slot)
        for s, (a, b) in slices.items():
            r = a.shape[0]
            lo, hi = self.slice_offsets[s], self.slice_offsets[s + 1]
            assert a.shape[1] == self.lora_a.shape[3] and b.shape == (hi - lo, r), "bad LoRA shape"
            self.lora_a[s, slot, :r].copy_(a)
            self.lora_b[slot, lo:hi, :r].copy_(b)

    def swap_slots(self, i: int, j: int) -> None:
        """Exchange the A and B matrices of slots i and j (in place: graphs hold the buffers)."""
        if i == j:
            return
        a_i, b_i = self.lora_a[:, i].clone(), self.lora_b[i].clone()
        self.lora_a[:, i].copy_(self.lora_a[:, j])
        self.lora_b[i].copy_(self.lora_b[j])
        self.lora_a[:, j].copy_(a_i)
        self.lora_b[j].copy_(b_i)

    def clear_slot(self, slot: int) -> None:
        self.lora_a[:, slot].zero_()
        self.lora_b[slot].zero_()

    def _shrunk_cols(self, step: LoRAStep) -> int:
        # k*S*R: the shrink columns of the step's slots 0..k-1 (the A rows a fused GEMM stacks)
        return step.num_slots * self.num_slices * self.lora_b.shape[2]

    def shrink_for(self, x: Tensor, step: LoRAStep) -> LoRAShrink:
        """What the norm before this projection computes on a fused step whose GEMM streams
        only W (gate_up's fused GEMM + SiLU, models/decoder.py): x . A of each row's own slot,
        into a new [T, k*S*R] buffer laid out as the stacked GEMM's extra columns (x: the
        norm's input, for its row count and dtype)."""
        out = torch.empty(x.shape[0], self._shrunk_cols(step), dtype=x.dtype, device=x.device)
        return LoRAShrink(self.lora_a, step.token_slots, out)

    def delta_from(self, shrink: LoRAShrink, step: LoRAStep) -> LoRADelta:
        """The LoRADelta for this projection's consumer once the norm has filled shrink.out."""
        return LoRADelta(shrink.out, self.lora_b, step.token_slots, self.slice_offsets)

    def forward(self, linear, x: Tensor, step: LoRAStep, kernel: str | None,
                defer: bool) -> tuple[Tensor, LoRADelta | None]:
        # x: [T, in] -> (y [T, out], pending delta or None); step: this step's LoRA part;
        # kernel: the GEMM the step plan names for this projection
        m = self.manager
        if step.fuse and self.fp8:
            y = gemm.project(linear, x, kernel)
            shrunk = gemm.linear(x, self.weight_full[:self._shrunk_cols(step)], None, None)
            delta = LoRADelta(shrunk, self.lora_b, step.token_slots, self.slice_offsets)
            return (y, delta) if defer else (add_delta(y, delta), None)
        if step.fuse:
            N = linear.out_features
            rows = N + self._shrunk_cols(step)
            bias = None if self.bias_full is None else self.bias_full[:rows]
            # the kernel is chosen by W alone, so W's columns come out as in a no-LoRA step
            full = gemm.linear(x, self.weight_full[:rows], bias, kernel)  # [T, N + k*S*R]
            delta = LoRADelta(full[:, N:], self.lora_b, step.token_slots, self.slice_offsets)
            if defer:
                return full[:, :N], delta
            return add_delta(full[:, :N], delta), None
        y = gemm.project(linear, x, kernel)
        # m.shrink_buffer: flat fp32 scratch shared by all layers; add_lora views its split-K
        # partials [splits, S, T, R] out of it.
        punica.add_lora(x, y, self.lora_a, self.lora_b, m.shrink_buffer, self.slice_offsets,
                        step.meta)
        return y, None


def add_delta(y: Tensor, delta: LoRADelta) -> Tensor:
    """y [T, N] + its LoRA delta, for a fused step's projection whose next op cannot add it:
    on the Triton path in place, one launch per slice (kernels/add_lora_delta.py, the kernel
    the norms add their deltas with); else the torch reference (fp32 math, one rounding)."""
    if use_triton(y):
        from batchrun.kernels.add_lora_delta import add_lora_delta
        return add_lora_delta(y, delta)
    return delta.apply_reference(y)
