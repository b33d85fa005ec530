"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2) with fused projections and paged KV.

Our own module tree (not HF's) so that graph capture, paged KV and LoRA hooks are under our
control. Weight names map from HF checkpoints in loader.py. The layers choose no kernel: the
step's `Step` (its plan, engine/step_plan.py) names each projection's GEMM and whether LoRA
deltas are fused, and the layers follow it.
"""
from __future__ import annotations

import torch
from torch import nn

from batchrun.engine.layers.activation import act_and_mul
from batchrun.engine.layers.attention import PagedAttention
from batchrun.engine.layers.gemm import gate_up_silu, linear
from batchrun.engine.layers.linear import Linear
from batchrun.engine.layers.norm import RMSNorm
from batchrun.engine.layers.rotary import RotaryEmbedding
from batchrun.engine.layers.step import Step
from batchrun.engine.models.config import ModelConfig
from batchrun.kernels.lora_meta import LoRAShrink


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               bias=cfg.attention_bias, name="qkv_proj")
        self.o_proj = Linear(self.q_size, [cfg.hidden_size], name="o_proj")
        self.rotary = rotary  # shared by all layers
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions, x, step: Step):
        # x: [T, H] -> (o_proj output [T, H], its pending LoRA delta or None)
        qkv, delta = self.qkv_proj(x, step, defer=True)  # [T, q + 2*kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        # on CUDA the rotary kernel also writes k, v into the paged cache (then k = v = None)
        q, k, v = self.rotary(positions, q, k, v, lora=delta, cache=self.attn.kv_write(step.attn))
        o = self.attn(q, k, v, step.attn)  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.q_size), step, defer=True)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [i, i], name="gate_up_proj")
        self.down_proj = Linear(i, [cfg.hidden_size], name="down_proj")

    def _fused_gate_up(self, step: Step) -> bool:
        # the plan runs gate_up in the fused GEMM + SiLU kernel, which takes this layer's LoRA
        # delta only from a fused step (the norm before computes its shrink)
        lora, hook = step.lora, self.gate_up_proj.lora
        return step.gemm.gate_up_silu and (lora is None or hook is None or lora.fuse)

    def shrink(self, x, step: Step) -> LoRAShrink | None:
        # x: the input of the norm before this MLP. When gate_up runs fused with its LoRA, the
        # gate_up shrink x . A for that norm to compute beside its output (RMSNorm's shrink=);
        # else None.
        hook = self.gate_up_proj.lora
        if step.lora is None or hook is None or not self._fused_gate_up(step):
            return None
        return hook.shrink_for(x, step.lora)

    def forward(self, x, step: Step, shrink: LoRAShrink | None = None):
        # x: [T, H] -> (down_proj output [T, H], its pending LoRA delta or None); shrink: what
        # self.shrink returned, filled in by the norm
        gu = self.gate_up_proj
        if self._fused_gate_up(step):
            # SiLU (and the LoRA delta, from the norm's shrink) in the GEMM's epilogue
            delta = None if shrink is None else gu.lora.delta_from(shrink, step.lora)
            h = gate_up_silu(x, gu.weight, delta)
        else:
            gate_up, delta = gu(x, step, defer=True)
            h = act_and_mul(gate_up, lora=delta)
        return self.down_proj(h, step, defer=True)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = Attention(cfg, rotary)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, delta, step: Step):
        # h = x + attention(norm(x)); out = h + mlp(norm(h)), with each residual add fused into
        # the norm after it (vLLM pattern): a layer returns its MLP output and the residual
        # stream separately, (x, residual), both [T, H]; the first layer gets residual=None
        # and LlamaModel fuses the last add into the final norm. A projection's pending LoRA
        # delta (fused steps) rides to the kernel after it: `delta` is the previous layer's
        # down_proj delta, the layer returns its own; on steps whose plan runs gate_up fused,
        # the norm before the MLP also computes gate_up's LoRA shrink (`shrink`).
        x, residual = self.input_layernorm.add_norm(x, residual, lora=delta)
        x, delta = self.self_attn(positions, x, step)
        shrink = self.mlp.shrink(x, step)
        x, residual = self.post_attention_layernorm.add_norm(x, residual, lora=delta, shrink=shrink)
        x, delta = self.mlp(x, step, shrink)
        return x, residual, delta


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        # _weight: no random init (the loader fills it); on the meta device nn.Embedding's own
        # init imports torch._dynamo, ~1.3 s of every job's start-up
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, step: Step):
        x = self.embed_tokens(input_ids)  # [T, H]
        residual, delta = None, None
        for layer in self.layers:
            x, residual, delta = layer(positions, x, residual, delta, step)
        return self.norm.add_norm(x, residual, lora=delta)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_position)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                step: Step) -> torch.Tensor:
        # input_ids, positions: [T] -> hidden states [T, H]. step: the step's attention
        # metadata and LoRA part (None: no adapter token, so no LoRA op runs anywhere)
        return self.model(input_ids, positions, step)

    def compute_logits(self, hidden: torch.Tensor, kernel: str | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden: [N, H] -> fp32 logits [N, V] (written into `out` when given); kernel: the
        # step plan's lm_head GEMM for N rows (None: cuBLAS)
        logits = linear(hidden, self.lm_head.weight, None, kernel)
        if out is None:
            return logits.float()
        return out.copy_(logits)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
