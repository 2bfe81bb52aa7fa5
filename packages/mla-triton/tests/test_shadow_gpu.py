"""GPU suite of the shadow cache: bf16 caches, compiled kernels, bit-identical to on-read.

Skipped without a CUDA GPU (CI runs on CPUs; results of running it on an H200
are in ``benchmarks/results/shadow-gpu-tests.txt``). The CPU suite (test_shadow.py)
runs the interpreter on fp16 data; here the kernels are compiled, with the GPU's
fast paths (hardware E4M3 conversion, FMA, the multiply-and-round nvfp4 on read),
on bf16 data, whose 8 significant bits make exact E2M1 rounding ties common.

Per recipe and storage, a pool of ragged sequences (lengths across 16-token
blocks, tiles and split bounds, up to 1000) is filled like an engine fills it:
a prefill in three chunks, then decode steps of one token. After the prefill and
after every decode step: the shadow's contents equal ``mla_formats`` bitwise (on
CPU copies), and ``decode_shadow`` equals on-read ``decode`` bitwise with the
same tiles and split count (1, 4 and the default policy). A mismatch message
says which rows, their lengths, and whether on-read decode with the exact
(compare-form) rounding agrees with the shadow instead.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_shadow import NVFP4, RECIPES, SCALE, Pool, check_contents

from mla_formats import AttentionQuant
from mla_triton import decode, decode_shadow
from mla_triton.decode import decode_config, decode_num_splits
from mla_triton.shadow import shadow_decode_config

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels, bf16)"
)

LENS = [1, 9, 15, 16, 17, 31, 33, 35, 63, 64, 65, 121, 128, 129, 200, 255, 256, 302, 511, 1000]
STEPS = 3


def _prefill(pool: Pool) -> None:
    """Each sequence's first ``len - STEPS`` tokens in three chunks, all sequences per chunk."""
    first = [n - STEPS for n in LENS]
    third = [f // 3 for f in first]
    pool.append(third)
    pool.append(third)
    pool.append([f - 2 * t for f, t in zip(first, third, strict=True)])


def _compare(pool: Pool, q: torch.Tensor, splits: int, label: str) -> None:
    """decode_shadow against decode with the shadow's default tiles given to both."""
    heads = q.shape[1]
    cfg = shadow_decode_config(heads, pool.quant, pool.storage)
    seq = pool.seq_lens()
    kw = {"softmax_scale": SCALE, "quant": pool.quant, "num_splits": splits}
    want = decode(q, pool.cache, pool.table, seq, config=cfg, **kw)
    got = decode_shadow(
        q, pool.cache, pool.shadow, pool.table, seq, storage=pool.storage, config=cfg, **kw
    )
    bad_out = (got[0] != want[0]).any(-1)  # [B, H]
    bad_lse = got[1] != want[1]
    bad = bad_out | bad_lse
    if not bool(bad.any()):
        return
    exact = decode(q, pool.cache, pool.table, seq, config=replace(cfg, fast_qdq=False), **kw)
    rows = []
    for b in bad.any(-1).nonzero().flatten().tolist():
        diff = (got[0][b].float() - want[0][b].float()).abs().max().item()
        agrees = torch.equal(got[0][b], exact[0][b])
        rows.append(
            f"seq {b} (len {pool.lens[b]}): {int(bad[b].sum())} of {heads} heads, "
            f"max |Δ| {diff:.3e}, equals exact on-read: {agrees}"
        )
    raise AssertionError(f"{label}, {splits} splits: decode_shadow != decode\n" + "\n".join(rows))


CASES = {
    "nvfp4": (NVFP4, "fp16", 16),
    "nvfp4-packed": (NVFP4, "packed", 64),
    "fp8": (AttentionQuant.uniform("fp8"), "fp16", 16),
    "kdyn-nvfp4-vfp8": (RECIPES["kdyn-nvfp4-vfp8"][0], "packed", 64),
    "calibrated": (RECIPES["calibrated"][0], "fp16", 16),
}


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_shadow_equals_on_read_bf16(case: str, heads: int) -> None:
    quant, storage, page = CASES[case]
    pool = Pool(
        quant,
        storage,
        page=page,
        max_len=max(LENS),
        batch=len(LENS),
        seed=11,
        dtype=torch.bfloat16,
        device="cuda",
    )
    _prefill(pool)
    check_contents(pool)
    gen = torch.Generator().manual_seed(12)
    q = (torch.randn(len(LENS), heads, 576, generator=gen) * 0.5).bfloat16().cuda()
    default = decode_num_splits(len(LENS), heads, max(LENS), device=torch.device("cuda"))
    for step in range(STEPS):
        pool.append([1] * len(LENS), pad=1)
        for splits in sorted({1, 4, default}):
            _compare(pool, q, splits, f"{case} h{heads} step {step}")
    check_contents(pool)
    assert pool.lens == LENS


def test_default_tiles_are_the_same() -> None:
    """vLLM passes no tiles: for nvfp4 the two paths' defaults must agree to be bitwise."""
    for heads in (16, 128):
        assert shadow_decode_config(heads, NVFP4) == decode_config(heads, NVFP4)
