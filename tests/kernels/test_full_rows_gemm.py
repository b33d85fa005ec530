"""kernels/full_rows_gemm.py (all rows of a throughput decode step in one M tile, split-K for
narrow weights) against the torch reference, with fresh random inputs: odd M, N and K off the
tiles, several M tiles, K split in uneven shares, strided rows and outputs. Under the Triton
interpreter on CPU (fp16, small tiles) and in bf16 on a GPU at the Llama-2-7b shapes."""
import pytest
import torch

from batchrun.kernels import full_rows_gemm as frg
from batchrun.kernels.full_rows_gemm import CONFIG, config_for, full_rows_gemm, set_tuned
from kernel_testutils import DEVICE, POISON, assert_gemm_close, randn

SMALL = (32, 16, 16, 1, 1, 4)  # interpreter-sized tiles: (BM, BN, BK, SPLIT_K, stages, warps)
# (M, N, K, BLOCK_M): one row, M off the tile, several M tiles, K off BLOCK_K
SHAPES = [(1, 16, 32, 32), (17, 40, 70, 32), (70, 33, 130, 32), (130, 24, 96, 64)]


def _operands(M, N, K, dtype, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    x = randn(M, K + pad, dtype=dtype, gen=g)[:, :K]           # pad > 0: strided rows
    w = randn(N, K, dtype=dtype, gen=g, scale=K ** -0.5)
    return x, w


@pytest.mark.parametrize("M,N,K,bm", SHAPES)
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_full_rows_gemm(M, N, K, bm, split_k, bias):
    x, w = _operands(M, N, K, torch.float16, seed=M * 1000 + N + K + split_k)
    b = randn(N, dtype=torch.float16, gen=torch.Generator().manual_seed(N)) if bias else None
    out = torch.full((M, N), POISON, dtype=torch.float16, device=DEVICE)
    cfg = (bm,) + SMALL[1:3] + (split_k,) + SMALL[4:]
    assert full_rows_gemm(x, w, b, out=out, config=cfg) is out
    assert_gemm_close(out, x, w, b)


def test_strided_rows_and_out_default_config():
    x, w = _operands(20, 32, 64, torch.float16, seed=7, pad=5)
    big = torch.full((20, 40), POISON, dtype=torch.float16, device=DEVICE)
    full_rows_gemm(x, w, out=big[:, 3:35])  # CONFIG's tiles, BLOCK_M shrunk to 32
    assert_gemm_close(big[:, 3:35], x, w)
    assert (big[:, :3] == POISON).all() and (big[:, 35:] == POISON).all()


def test_split_k_is_deterministic_and_rejects_bad_inputs():
    x, w = _operands(9, 24, 100, torch.float16, seed=11)
    cfg = SMALL[:3] + (4,) + SMALL[4:]
    assert torch.equal(full_rows_gemm(x, w, config=cfg), full_rows_gemm(x, w, config=cfg))
    with pytest.raises(ValueError, match=r"needs x \[M, K\] and w \[N, K\]"):
        full_rows_gemm(x, w[:, :50])
    with pytest.raises(ValueError, match="needs fp16/bf16 x and w"):
        full_rows_gemm(x.float(), w.float())
    with pytest.raises(ValueError, match="bias must be"):
        full_rows_gemm(x, w, torch.zeros(23, dtype=torch.float16, device=DEVICE))
    assert full_rows_gemm(x[:0], w).shape == (0, 24)


def test_tuned_configs_pick_the_nearest_weight_of_the_same_k(monkeypatch):
    monkeypatch.setattr(frg, "TUNED", {})
    assert config_for(4096, 4096) == CONFIG  # nothing tuned
    a, b, c = SMALL, SMALL[:3] + (3,) + SMALL[4:], (16, 16, 32, 1, 1, 4)
    set_tuned({(4096, 4096): a, (12288, 4096): b, (4096, 11008): c})
    assert config_for(4096, 4096) == a
    assert config_for(4096 + 48, 4096) == a      # a LoRA step's stacked [W; A]
    assert config_for(12288 + 48, 4096) == b
    assert config_for(9000, 4096) == b           # nearer 12288 than 4096
    assert config_for(4096, 11008) == c
    assert config_for(4096, 5120) == CONFIG      # no entry of its K
    with pytest.raises(ValueError, match="bad tuned entry"):
        set_tuned({(4096, 4096): (256, 128)})
    x, w = _operands(9, 24, 100, torch.float16, seed=13)
    set_tuned({(24, 100): b})                    # split-K, taken without a config argument
    assert torch.equal(full_rows_gemm(x, w), full_rows_gemm(x, w, config=b))
    assert_gemm_close(full_rows_gemm(x, w), x, w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M", [128, 200, 256])
def test_bf16_gpu_7b_shapes(M):
    for N, K in [(12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (32000, 4096)]:
        x, w = _operands(M, N, K, torch.bfloat16, seed=M + N + K)
        assert_gemm_close(full_rows_gemm(x, w), x, w)
        assert_gemm_close(full_rows_gemm(x, w, config=CONFIG[:3] + (4,) + CONFIG[4:]), x, w)
