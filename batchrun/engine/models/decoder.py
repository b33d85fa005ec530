"""The decoder every supported family runs (Llama 2/3.x, Mistral, Qwen2, Qwen3, Gemma 2/3,
Phi-3/4, Mixtral, Qwen2-MoE, Qwen3-MoE), with fused projections and paged KV; the family is config
(models/config.py).

The block is two lines of math, as in every family:
    h = x + attention(norm(x));  out = h + mlp(norm(h))
In a mixture-of-experts model `mlp` is the routed expert block (`SparseMoE`) on the layers that
have one, the dense MLP on the others.
Gemma adds a norm after each sublayer before its residual add (`sandwich_norms`); Qwen3 and
Gemma 3 normalise each q and k head before the rotary (`qk_norm`). Everything else a family
changes is a constant of a layer (norm offset, activation, attention scale, soft-caps, window,
rope table).

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
from batchrun.engine.layers.moe import fused_moe, lora_delta, moe_with_lora, route
from batchrun.engine.layers.norm import RMSNorm
from batchrun.engine.layers.rotary import RotaryEmbedding
from batchrun.engine.layers.step import Step
from batchrun.engine.lora.experts import DOWN, GATE_UP, ROUTER
from batchrun.engine.models.config import ModelConfig, Rope
from batchrun.kernels.lora_meta import LoRAShrink


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                               bias=cfg.attention_bias, name="qkv_proj")
        self.o_proj = Linear(self.q_size, [cfg.hidden_size], bias=cfg.o_proj_bias, name="o_proj")
        if cfg.qk_norm:  # per head, over head_dim
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.rotary = rotary  # shared by the layers of one rope
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   scale=cfg.attn_scale, sliding_window=cfg.layer_window(layer),
                                   logit_softcap=cfg.attn_logit_softcap)

    def forward(self, positions, x, step: Step):
        # x: [T, H] -> (o_proj output [T, H], its pending LoRA delta or None)
        if self.q_norm is None:
            qkv, delta = self.qkv_proj(x, step, defer=True)  # [T, q + 2*kv]
        else:  # the norms come between the projection and the rotary: no delta rides past them
            qkv, delta = self.qkv_proj(x, step), None
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # on CUDA the rotary kernel also writes k, v into the paged cache (then k = v = None)
        q, k, v = self.rotary(positions, q, k, v, lora=delta, cache=self.attn.kv_write(step.attn))
        o = self.attn(q, k, v, step.attn)  # [T, Hq, D]
        return self.o_proj(o.reshape(-1, self.q_size), step, defer=True)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate: int | None = None):
        super().__init__()
        i = cfg.intermediate_size if intermediate is None else intermediate
        self.activation = cfg.hidden_act
        self.gate_up_proj = Linear(cfg.hidden_size, [i, i], name="gate_up_proj")
        self.down_proj = Linear(i, [cfg.hidden_size], name="down_proj")

    def _fused_gate_up(self, step: Step) -> bool:
        # the plan runs gate_up in the fused GEMM + activation kernel, which takes this layer's
        # LoRA delta only from a fused step (the norm before computes its shrink)
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
            # the activation (and the LoRA delta, from the norm's shrink) in the GEMM's epilogue
            delta = None if shrink is None else gu.lora.delta_from(shrink, step.lora)
            h = gate_up_silu(x, gu.weight, delta, activation=self.activation)
        else:
            gate_up, delta = gu(x, step, defer=True)
            h = act_and_mul(gate_up, self.activation, lora=delta)
        return self.down_proj(h, step, defer=True)


class Router(nn.Module):
    """The router's linear ([num_experts, H], HF's `mlp.gate`)."""
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)


class ExpertWeights(nn.Module):
    """Every expert's gated MLP stacked, in transformers 5's fused layout (HF's `mlp.experts`):
    gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows), down_proj [E, H, I]."""
    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate),
                                      requires_grad=False)


class SparseMoE(nn.Module):
    """A mixture-of-experts block in place of the MLP: each token runs the top-k experts its
    router picks, their outputs summed with the routing weights (layers/moe.py)."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e = cfg.experts
        self.top_k, self.norm_topk_prob, self.round_weights = e.top_k, e.norm_topk_prob, e.round_weights
        self.activation = cfg.hidden_act
        self.gate = Router(cfg.hidden_size, e.num_experts)
        self.experts = ExpertWeights(e.num_experts, cfg.hidden_size, e.intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if e.shared_expert_intermediate_size:  # Qwen2-MoE
            self.shared_expert = MLP(cfg, e.shared_expert_intermediate_size)
            self.shared_expert_gate = Router(cfg.hidden_size, 1)
        # LoRA hooks (lora/expert_layer.py's ExpertLoRA) of the router and expert tensors some
        # adapter targets, set by the LoRA manager; read only on steps with adapter rows
        self.lora: dict = {}

    def lora_shapes(self) -> dict[str, tuple[int, int, int]]:
        """Each LoRA target of the block -> (experts, in_features, out_features)."""
        (n, h), i = self.gate.weight.shape, self.experts.down_proj.shape[2]
        return {ROUTER: (1, h, n), GATE_UP: (n, h, 2 * i), DOWN: (n, i, h)}

    def shrink(self, x, step: Step) -> None:
        return None  # no Linear of this block takes a shrink from the norm before it

    def forward(self, x, step: Step, shrink: None = None):
        # x: [T, H] -> ([T, H], None: no LoRA delta pending)
        lora = self.lora if step.lora is not None else {}
        slots = step.lora.token_slots[:x.shape[0]] if lora else None
        if ROUTER in lora:  # the router's delta added in fp32 before the logits' one rounding
            hook = lora[ROUTER]
            logits = (x.float() @ self.gate.weight.float().t()
                      + lora_delta(x, slots, hook.lora_a, hook.lora_b)).to(x.dtype)
        else:
            logits = linear(x, self.gate.weight, None, None)  # [T, E] in x's dtype, as HF's
        weights, ids = route(logits, self.top_k, self.norm_topk_prob,
                             x.dtype if self.round_weights else None)
        w = self.experts
        if GATE_UP in lora:  # with DOWN: the manager hooks both expert tensors or neither
            out = moe_with_lora(x, w.gate_up_proj, w.down_proj, weights, ids, self.activation,
                                slots, (lora[GATE_UP].lora_a, lora[GATE_UP].lora_b),
                                (lora[DOWN].lora_a, lora[DOWN].lora_b))
        else:
            out = fused_moe(x, w.gate_up_proj, w.down_proj, weights, ids, self.activation)
        if self.shared_expert is not None:  # out + sigmoid(gate(x)) * shared(x), in x's dtype
            shared, delta = self.shared_expert(x, step)
            assert delta is None  # no LoRA hook on the shared expert (adapters.py refuses it)
            gate = torch.sigmoid(linear(x, self.shared_expert_gate.weight, None, None))
            out = out + gate * shared
        return out, None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding):
        super().__init__()
        h, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.self_attn = Attention(cfg, layer, rotary)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.input_layernorm = RMSNorm(h, eps, offset)
        # Llama: the norm before the MLP. Gemma: the norm of the attention output, and two more
        # norms around the MLP (HF's names)
        self.post_attention_layernorm = RMSNorm(h, eps, offset)
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(h, eps, offset)
        else:
            self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None

    def forward(self, positions, x, residual, delta, step: Step):
        # h = x + attention(norm(x)); out = h + mlp(norm(h)), with each residual add fused into
        # the norm after it (vLLM pattern): a layer returns its MLP output and the residual
        # stream separately, (x, residual), both [T, H]; the first layer gets residual=None
        # and DecoderModel fuses the last add into the final norm. A projection's pending LoRA
        # delta (fused steps) rides to the kernel after it: `delta` is the previous layer's
        # down_proj delta, the layer returns its own; on steps whose plan runs gate_up fused,
        # the norm before the MLP also computes gate_up's LoRA shrink (`shrink`). Gemma's
        # sublayer norms take their sublayer's delta, and the residual adds move one norm on.
        x, residual = self.input_layernorm.add_norm(x, residual, lora=delta)
        x, delta = self.self_attn(positions, x, step)
        shrink = self.mlp.shrink(x, step)
        if self.pre_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm.add_norm(x, residual, lora=delta,
                                                                 shrink=shrink)
            x, delta = self.mlp(x, step, shrink)
            return x, residual, delta
        x = self.post_attention_layernorm(x, lora=delta)
        x, residual = self.pre_feedforward_layernorm.add_norm(x, residual, shrink=shrink)
        x, delta = self.mlp(x, step, shrink)
        return self.post_feedforward_layernorm(x, lora=delta), residual, None


def _rotary(rope: Rope, max_position: int) -> RotaryEmbedding:
    return RotaryEmbedding(rope.rotary_dim, max_position, rope.theta, rope.scaling)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        # _weight: no random init (the loader fills it); on the meta device nn.Embedding's own
        # init imports torch._dynamo, ~1.3 s of every job's start-up
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_scale = cfg.embed_scale
        self.rotary = _rotary(cfg.rope, max_position)
        # Gemma 3's sliding layers rotate with their own base
        self.local_rotary = None if cfg.local_rope is None else _rotary(cfg.local_rope, max_position)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary if cfg.layer_rope(i) is not cfg.local_rope
                         else self.local_rotary)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def rotaries(self) -> list[RotaryEmbedding]:
        return [self.rotary] + ([] if self.local_rotary is None else [self.local_rotary])

    def forward(self, input_ids, positions, step: Step):
        x = self.embed_tokens(input_ids)  # [T, H]
        if self.embed_scale is not None:
            # HF multiplies by the scale as a tensor of the weights' dtype: the rounded value
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype).item()
        residual, delta = None, None
        for layer in self.layers:
            x, residual, delta = layer(positions, x, residual, delta, step)
        return self.norm.add_norm(x, residual, lora=delta)[0]


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_position: int):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_position)
        self.final_logit_softcap = cfg.final_logit_softcap
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
        out = logits.float() if out is None else out.copy_(logits)
        cap = self.final_logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap), in fp32
            out.div_(cap).tanh_().mul_(cap)
        return out

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]
