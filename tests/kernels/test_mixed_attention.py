"""A mixed step's attention (layers/attention.py): decode rows (the first num_decode sequences,
one query each) through the decode kernel, the rest through the varlen prefill kernel, into one
output; equal to the whole step through the prefill path, on the Triton path (interpreter on
CPU) and the torch path. Pages past each context are poisoned (NaN for the kernels, huge
finite values for the torch reference, which gathers whole pages) to catch reads out of range;
with a sliding window so is every slot before each sequence's first window."""
import pytest
import torch

from batchrun.engine.layers.attention import AttnMetadata, PagedAttention
from batchrun.kernels.reference import ref_prefill_attention
from kernel_testutils import DEVICE, assert_attention_close
from test_prefill_attention import make_inputs, poison_before_window


@pytest.mark.parametrize("force", ["0", "1"], ids=["torch", "triton"])
@pytest.mark.parametrize("seqs", [
    [(40, 1), (3, 1), (16, 1), (0, 37), (20, 11)],   # decode rows + a new prompt + a chunk
    [(9, 1), (63, 1)],                              # only decode rows (the runner never sends it)
    [(0, 5), (30, 1)],                              # a 1-token chunk that is not a decode row
], ids=["mixed", "decode_only", "no_decode_rows"])
@pytest.mark.parametrize("window,softcap", [(None, None), (7, None), (20, 3.0), (None, 50.0)],
                         ids=["plain", "window7", "window20_cap3", "cap50"])
def test_mixed_step_attention_equals_prefill_path(monkeypatch, force, seqs, window, softcap):
    monkeypatch.setenv("BATCHRUN_FORCE_TRITON", force)
    Hq, Hkv, D = 8, 2, 64
    gen = torch.Generator().manual_seed(len(seqs))
    q, kc, vc, tables, qs, ctx, q_lens = make_inputs(seqs, Hq, Hkv, D, 16, torch.float32, gen)
    if window is not None:
        poison_before_window(seqs, kc, vc, tables, 16, window)
    # leading one-query sequences are the decode rows; "no_decode_rows" sends its 1-token
    # chunk through the prefill kernel (num_decode 0), as a step with mixed steps off does
    nd = 0 if seqs[0][1] != 1 else next((i for i, (_, n) in enumerate(seqs) if n != 1), len(seqs))
    if force == "0":  # the torch decode reference gathers whole pages: finite poison there
        kc, vc_used = kc.nan_to_num(nan=1e4), vc.nan_to_num(nan=1e4)
    else:
        vc_used = vc
    layer = PagedAttention(Hq, Hkv, D, sliding_window=window, logit_softcap=softcap)
    layer.k_cache, layer.v_cache = kc.to(DEVICE), vc_used.to(DEVICE)
    ctx_host = ctx.tolist()
    meta = AttnMetadata(True, None, tables, ctx, query_lens=q_lens, context_lens_host=ctx_host,
                        query_start=qs, num_decode=nd)
    out = layer._prefill(q.to(DEVICE), meta)
    ref = ref_prefill_attention(q, kc.nan_to_num(), vc_used.nan_to_num(), tables.cpu(), qs.cpu(),
                                ctx.cpu(), D ** -0.5, window, softcap)
    assert_attention_close(out.cpu(), ref, vc, torch.float32)
