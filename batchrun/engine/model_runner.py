"""Prepare batched inputs, run prefill and decode steps on the model.

Decode reads its inputs from static buffers kept as attributes (token ids, positions, slot
mapping, block tables, context lengths, LoRA token slots), sized for max_num_seqs and written in
place every step, so a captured CUDA graph (graphs.py) can replay the same step. Rows past the
step's batch size are padding: slot -1 (no LoRA), context length 0, and their K/V go to the
scratch block 0, so they do no harmful work.
"""
from __future__ import annotations

import torch

from batchrun.config import EngineConfig
from batchrun.engine.block_manager import SCRATCH_BLOCK, BlockManager
from batchrun.engine.sequence import Sequence
from batchrun.layers.attention import AttnMetadata, query_start_tensor
from batchrun.layers.backend import use_triton


class ModelRunner:
    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 blocks: BlockManager, lora=None):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.blocks, self.lora = blocks, lora
        cfg = model.config
        self.block_size = blocks.block_size
        self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
        # KV cache: [2, layers, num_blocks, block_size, Hkv, D]
        self.kv_cache = torch.zeros(2, cfg.num_hidden_layers, blocks.num_blocks, self.block_size,
                                    cfg.num_key_value_heads, cfg.head_dim, device=device, dtype=dtype)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        n, mb = config.max_num_seqs, self.max_blocks_per_seq
        # Static decode inputs live in two device buffers (int64 and int32) with one pinned host
        # mirror each, so a step's inputs cost two host->device copies. Views:
        self._i64 = torch.zeros(3, n, dtype=torch.long, device=device)
        self._i32 = torch.zeros(n * (2 + mb), dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host_i64 = torch.zeros(self._i64.shape, dtype=torch.long, pin_memory=pin)
        self._host_i32 = torch.zeros(self._i32.shape, dtype=torch.int32, pin_memory=pin)
        self.input_ids, self.positions, self.slot_mapping = self._i64  # [n] each
        self.context_lens, self.token_slots = self._i32[:n], self._i32[n:2 * n]  # [n] each
        self.block_tables = self._i32[2 * n:].view(n, mb)  # [n, max_blocks_per_seq]
        self.logits = torch.empty(n, cfg.vocab_size, dtype=torch.float32, device=device)  # [n, V]
        self.graphs = None  # graphs.GraphRunner, set by the engine when CUDA graphs are on
        if lora is not None:  # fused decode kernels read the slots straight from token_slots
            lora.bind_fused_slots(self.token_slots)

    # ---- decode -------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token per sequence -> fp32 logits [len(seqs), V]."""
        b = len(seqs)
        has_lora = any(s.lora_slot >= 0 for s in seqs)
        key = self.graphs.dispatch(b, has_lora) if self.graphs else None
        rows = key.padded_batch_size if key else b
        self._write_decode_inputs(seqs, rows, has_lora)
        if key is not None:
            return self.graphs.replay(key)[:b]
        return self.decode_forward(rows)[:b]

    def decode_forward(self, rows: int) -> torch.Tensor:
        """The step a graph captures: reads only the static buffers' first `rows` rows."""
        meta = AttnMetadata(False, self.slot_mapping[:rows], self.block_tables[:rows],
                            self.context_lens[:rows])
        hidden = self.model(self.input_ids[:rows], self.positions[:rows], meta)
        # into a static buffer shared by every graph of both sets: captured graphs then keep no
        # per-graph output alive in the pool (a [rows, vocab] fp32 tensor per graph otherwise)
        return self.model.compute_logits(hidden, out=self.logits[:rows])

    def _write_decode_inputs(self, seqs: list[Sequence], rows: int, has_lora: bool) -> None:
        n, mb = self.config.max_num_seqs, self.max_blocks_per_seq
        h64, h32 = self._host_i64.numpy(), self._host_i32.numpy()
        tables = h32[2 * n:].reshape(n, mb)
        lora = []
        for i, s in enumerate(seqs):
            p = s.num_tokens - 1
            h64[0, i], h64[1, i], h64[2, i] = s.token_ids[-1], p, self.blocks.slot(s, p)
            h32[i], h32[n + i] = s.num_tokens, s.lora_slot
            tables[i, :len(s.block_ids)] = s.block_ids
            tables[i, len(s.block_ids):] = 0
            lora.append(s.lora_slot)
            s.num_computed = s.num_tokens
        b = len(seqs)  # rows b..rows are padding: scratch block, no context, no LoRA
        h64[:, b:rows] = 0
        h64[2, b:rows] = SCRATCH_BLOCK * self.block_size
        h32[b:rows], h32[n + b:n + rows] = 0, -1
        tables[b:rows] = SCRATCH_BLOCK
        self._i64.copy_(self._host_i64, non_blocking=True)
        self._i32.copy_(self._host_i32, non_blocking=True)
        # decode on the Triton path: LoRA deltas ride into the kernels after each projection,
        # which read each row's slot from token_slots (written above)
        fuse = use_triton(self._i64)
        self._prepare_lora(lora + [-1] * (rows - b), has_lora, fuse=fuse, slots_bound=fuse)

    # ---- prefill ------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence], counts: list[int]) -> tuple[list[int], torch.Tensor]:
        """Compute `counts[i]` prompt tokens of seqs[i]. Returns the indices of sequences whose
        prompt is now complete and their fp32 logits [len(done), V]."""
        ids, pos, slots, lora, q_lens, ctx_lens, done, last = [], [], [], [], [], [], [], []
        table = torch.zeros(len(seqs), self.max_blocks_per_seq, dtype=torch.int32)
        for i, (s, n) in enumerate(zip(seqs, counts)):
            start, end = s.num_computed, s.num_computed + n
            ids.extend(s.token_ids[start:end]); pos.extend(range(start, end))
            slots.extend(self.blocks.slot(s, p) for p in range(start, end))
            lora.extend([s.lora_slot] * n)
            table[i, :len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
            q_lens.append(n); ctx_lens.append(end)
            s.num_computed = end
            if end == s.num_tokens:
                done.append(i); last.append(len(ids) - 1)
        dev = self.device
        meta = AttnMetadata(True, torch.tensor(slots, dtype=torch.long, device=dev),
                            table.to(dev), torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
                            query_lens=q_lens, context_lens_host=ctx_lens,
                            query_start=query_start_tensor(q_lens, dev))
        # small prefills fuse too (no launches); big ones amortise shrink + expand launches
        fuse = use_triton(self._i64) and len(ids) <= self.config.lora_fused_max_tokens
        self._prepare_lora(lora, any(v >= 0 for v in lora), fuse=fuse)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), meta)
        if not done:
            return done, hidden.new_empty(0)
        return done, self.model.compute_logits(hidden[torch.tensor(last, device=dev)])

    # ---- LoRA ---------------------------------------------------------------------------
    def _prepare_lora(self, token_slots: list[int], has_lora: bool, fuse: bool,
                      slots_bound: bool = False) -> None:
        if self.lora is not None:  # without LoRA rows only the flag is written
            self.lora.prepare_step(token_slots if has_lora else [], has_lora=has_lora, fuse=fuse,
                                   slots_bound=slots_bound)
