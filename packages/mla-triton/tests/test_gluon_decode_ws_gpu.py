"""The warp-specialized Gluon sm90 decode on a GPU (a GPU suite: skipped without an sm90
GPU, a failure under ``MLA_REQUIRE_GPU=1``).

Against the Gluon split kernel (``decode`` forced to its ``GluonDecodeConfig``) and
``mla_reference.decode`` (float64) with test_gluon_decode_gpu.py's bounds (rows 1.5e-2,
LSE 2e-5) on ragged lengths, empty requests, pages 16/64/128, 1 to 4 splits, H 20 and
128, bf16 and fp16; the TMA and ring variants against the oracle and ``VARIANTS[0]``
(and bit for bit against their ``twin``) at pages 16 to 128; the NaN rule (pages outside
the cache, lengths outside the table, a non-finite latent row; none from a row past the
end) row for row as the Gluon kernel; the shadows' paths against the Gluon split
kernel's. The CPU part (compiles, refusals, launch arguments): test_gluon_decode_ws.py.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch
from calls import decode, decode_shadow  # the public calls, ``impl``/``config`` forced
from test_gluon_decode_gpu import gpu  # sm90 only
from test_gluon_decode_ws import FP8_3, SCALE

import mla_triton.ops.decode.gluon_ws as ws
from mla_formats import AttentionQuant
from mla_triton.ops.decode.gluon import SEPARATE_V_CONFIG
from mla_triton.ops.decode.gluon import VARIANTS as GLUON_VARIANTS
from mla_triton.ops.decode.gluon_ws import (
    NVFP4_CONFIG,
    NVFP4_TMA_CONFIG,
    VARIANTS,
    WsConfig,
)

CASES = [  # batch, heads, page, lengths (0: empty), splits, dtype
    (1, 128, 64, [64], 1, torch.bfloat16),
    (3, 128, 64, [1, 0, 130], 1, torch.bfloat16),
    (4, 20, 16, [300, 0, 77, 1000], 2, torch.bfloat16),
    (2, 128, 64, [4096, 513], 4, torch.bfloat16),
    (5, 128, 16, [0, 0, 65, 191, 2000], 3, torch.float16),
    (3, 64, 128, [129, 1, 700], 2, torch.float16),
    (2, 128, 64, [0, 0], 2, torch.bfloat16),
]


def _inputs(
    batch: int, heads: int, page: int, lens: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(batch * 1000 + heads + page + sum(lens))
    max_blocks = max(1, -(-max(lens) // page))
    blocks = batch * max_blocks + 3
    q = torch.randn(batch, heads, 576, generator=g).to("cuda", dtype)
    cache = torch.randn(blocks, page, 576, generator=g).to("cuda", dtype)
    table = torch.randperm(blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return q, cache, table.to("cuda", torch.int32), lens_t.cuda()


def _row_err(a: torch.Tensor, b: torch.Tensor) -> float:
    den = b.double().abs().amax(-1).clamp_min(1e-3)
    return float(((a.double() - b.double()).abs().amax(-1) / den).max())


def _against(case: tuple[Any, ...], config: WsConfig, other: Any) -> tuple[torch.Tensor, ...]:
    """``decode`` forced to ``config`` on ``case`` against the float64 oracle and to
    ``other`` (rows 1.5e-2, LSE 2e-5; empty requests 0 and ``-inf``): ``(q, cache, table,
    seq, out, lse)``."""
    import mla_reference

    batch, heads, page, lens, splits, dtype = case
    q, cache, table, seq = _inputs(batch, heads, page, lens, dtype)
    o_w, l_w = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                      config=config)  # fmt: skip
    o_g, l_g = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                      config=other)  # fmt: skip
    o_r, l_r = mla_reference.decode(q.double().cpu(), cache.double().cpu(), table.cpu(),
                                    seq.cpu(), softmax_scale=SCALE)  # fmt: skip
    assert o_w.dtype == dtype and bool(torch.isfinite(o_w).all())
    assert _row_err(o_w.cpu(), o_r) < 1.5e-2
    assert _row_err(o_w, o_g) < 1.5e-2
    empty = seq.cpu() == 0
    assert bool((o_w[empty.cuda()] == 0).all()) and bool((l_w.cpu()[empty] == float("-inf")).all())
    fin = torch.isfinite(l_r)
    assert torch.allclose(l_w.double().cpu()[fin], l_r[fin], atol=2e-5, rtol=0)
    assert torch.allclose(l_w[~empty.cuda()], l_g[~empty.cuda()], atol=2e-5, rtol=0)
    return q, cache, table, seq, o_w, l_w


@gpu
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}-H{c[1]}-p{c[2]}-s{c[4]}" for c in CASES])
@pytest.mark.parametrize("config", VARIANTS[:3], ids=[c.name for c in VARIANTS[:3]])
def test_matches_gluon_and_reference(case: tuple[Any, ...], config: WsConfig) -> None:
    """The measured variants (``VARIANTS[:3]``) against the oracle and the Gluon split
    kernel; split invariance (one split against the case's count)."""
    q, cache, table, seq, o_w, _ = _against(case, config, GLUON_VARIANTS[0])
    o_1, _ = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=1, config=config)
    assert _row_err(o_1, o_w) < 1.5e-2


RING_CASES = [  # batch, heads, page, lengths, splits, dtype: TMA at pages 64, 128 and 32
    (2, 128, 64, [4096, 513], 4, torch.bfloat16),
    (3, 128, 128, [129, 1, 700], 2, torch.float16),
    (3, 64, 32, [300, 0, 33], 2, torch.bfloat16),
    (4, 20, 16, [300, 0, 77, 1000], 2, torch.bfloat16),  # page 16: cp.async
]


@gpu
@pytest.mark.parametrize("case", RING_CASES, ids=[f"B{c[0]}-p{c[2]}-s{c[4]}" for c in RING_CASES])
@pytest.mark.parametrize("config", VARIANTS[3:], ids=[c.name for c in VARIANTS[3:]])
def test_tma_and_ring_variants(case: tuple[Any, ...], config: WsConfig) -> None:
    """The TMA loads, S issued early and the 4-slot ring of 32-token tiles
    (``VARIANTS[3:]``) against the oracle and ``VARIANTS[0]``; each is its ``twin`` (one
    feature fewer: ``early_s`` off, else ``cp.async``) bit for bit, the same tiles in the
    same order (the tail rows the TMA brings are zeroed or masked)."""
    q, cache, table, seq, o_w, l_w = _against(case, config, VARIANTS[0])
    other = ws.twin(config)
    assert other is not None
    o_t, l_t = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=case[4],
                      config=other)  # fmt: skip
    assert torch.equal(o_w, o_t) and torch.equal(l_w, l_t)


@gpu
@pytest.mark.parametrize("config", [VARIANTS[0], VARIANTS[3], VARIANTS[5]],
                         ids=[VARIANTS[i].name for i in (0, 3, 5)])  # fmt: skip
def test_nan_rule_as_gluon(config: WsConfig) -> None:
    """Pages outside the cache, a length outside the table, a non-finite latent row and
    an accumulator overflowing in one warpgroup's half poison exactly the rows the Gluon
    kernel poisons (one split and several); a non-finite row past a request's end (in
    its last tile: TMA brings it in) poisons nothing."""
    q, cache, table, seq = _inputs(6, 128, 64, [200, 300, 150, 90, 150, 100], torch.bfloat16)
    cache[table[5, 1], 50, :] = float("nan")  # request 5: token 114 (unseen, same tile)
    table[0, 1] = -1  # request 0: a page outside the cache
    table[1, 2] = cache.shape[0]  # request 1: too
    seq[2] = table.shape[1] * 64 + 1  # request 2: beyond the table's capacity
    cache[table[3, 1], 5, 7] = float("inf")  # request 3: token 69 (seen) is not finite
    # request 4: q zero (every score 0, every P 1), V feature 300 of its rows 3e38: the
    # accumulator's feature 300 (warpgroup 1's half) overflows, the whole row is NaN
    q[4] = 0.0
    cache[table[4, :3].long(), :, 300] = 3e38
    for splits in (1, 3):
        o_w, l_w = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                          config=config)  # fmt: skip
        o_g, l_g = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                          config=GLUON_VARIANTS[0])  # fmt: skip
        assert bool(torch.isnan(o_g[:4]).all())  # requests 0 to 3 are poisoned
        assert bool(torch.isfinite(o_w[5]).all()) and bool(torch.isfinite(l_w[5]).all())
        if splits == 1:  # one split: the kernel's rule (several: the merge's)
            assert bool(torch.isnan(o_g[4]).all())
        assert torch.equal(torch.isnan(o_w), torch.isnan(o_g))
        assert torch.equal(torch.isinf(o_w), torch.isinf(o_g))
        assert torch.equal(torch.isnan(l_w), torch.isnan(l_g))


@gpu
def test_dispatch_and_warmup_on_gpu() -> None:
    """Unforced, ``decode`` (recipe none, bf16, 128 heads) is ``decode`` forced to
    ``VARIANTS[0]`` bit for bit, one split and several; ``warmup_decode``
    under ``compile_only`` compiles what a serving sweep then launches (nothing new
    compiles), the warp-specialized kernel included."""
    import random

    from test_warmup import make_engine, sweep, warm

    from mla_triton.precompile import compile_only, compiled_variants

    q, cache, table, seq = _inputs(3, 128, 64, [700, 0, 2500], torch.bfloat16)
    for splits in (1, 3):
        o_d, l_d = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits)
        o_w, l_w = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=splits,
                          config=VARIANTS[0])  # fmt: skip
        assert torch.equal(o_d, o_w) and torch.equal(l_d, l_w)
    engine = make_engine(None, False, blocks=301, width=35, max_rows=40, max_seq_len=2176,
                         dtype=torch.bfloat16, device="cuda")  # fmt: skip
    with compile_only():
        warm(engine, prefill_too=False)
    before = compiled_variants()
    assert before.get("mla_triton.ops.decode.gluon_ws_kernels.gluon_decode_ws_kernel", 0) >= 2
    sweep(engine, random.Random(0), prefill_too=False)
    torch.cuda.synchronize()
    after = compiled_variants()
    new = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert not new, f"compiled during the sweep: {new}"


# ------------------------------------------------------- fp8 through the shadow (GPU)

SHADOW_CASES = ["fp8", "fp8-scale-3", "nvfp4"]
"""``test_shadow_gpu.CASES`` with V̂ = K̂: scale 1 at page 16, scale 3 at page 64; and
nvfp4 Q/K/P/V (its V̂ section, the open V block; page 16)."""


def _shadow_config(case: str, config: WsConfig) -> WsConfig:
    """``config`` for a V̂ = K̂ case; for nvfp4 ``NVFP4_CONFIG`` (with ``config``'s
    ``early_s``: its ring and cp.async loads are the only ones a V̂ section takes)."""
    return replace(NVFP4_CONFIG, early_s=config.early_s) if case == "nvfp4" else config


@gpu
@pytest.mark.parametrize("heads", [20, 128])
@pytest.mark.parametrize("case", SHADOW_CASES)
@pytest.mark.parametrize("config", [VARIANTS[0], VARIANTS[4]], ids=[VARIANTS[0].name,
                                                                   VARIANTS[4].name])  # fmt: skip
def test_shadow_matches_gluon_and_reference(case: str, heads: int, config: WsConfig) -> None:
    """``decode_shadow`` forced to ``config`` on a pool an engine filled (ragged lengths up
    to 1000: a prefill in three chunks, then decode steps) against the Gluon split
    kernel's shadow path (``gluon.VARIANTS[0]``, a V̂ section's ``SEPARATE_V_CONFIG``) at
    each step and split count (1, 4, the default;
    ``test_shadow_gpu._agree``'s bounds: the same
    quantized operands, another summation order), split invariance (1 against 4), and the
    float64 oracle at the default count (``test_decode_gpu.check``). ``VARIANTS[4]`` (TMA
    loads, S issued early) reads page 64 by TMA, page 16 by ``cp.async``; nvfp4 runs
    ``NVFP4_CONFIG`` (and with S issued early), its open V block at every step."""
    from test_decode_gpu import check
    from test_shadow_gpu import LENS, STEPS, _agree, _pool, _prefill, _query
    from test_shadow_gpu import SCALE as SH_SCALE

    import mla_reference
    from mla_triton.common.splitk import decode_num_splits

    config = _shadow_config(case, config)
    glu_config = SEPARATE_V_CONFIG if case == "nvfp4" else GLUON_VARIANTS[0]
    pool = _pool(case)
    _prefill(pool)
    q = _query(heads)
    default = decode_num_splits(len(LENS), heads, max(LENS), device=torch.device("cuda"))
    for step in range(STEPS):
        pool.append([1] * len(LENS), pad=1)
        seq = pool.seq_lens()
        args = (q, pool.cache, pool.shadow, pool.table, seq)
        got: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for splits in sorted({1, 4, default}):
            kw: dict[str, Any] = {"softmax_scale": SH_SCALE, "quant": pool.quant,
                                     "num_splits": splits}  # fmt: skip
            got[splits] = decode_shadow(*args, config=config, **kw)
            assert got[splits][0].dtype == torch.bfloat16
            glu = decode_shadow(*args, config=glu_config, **kw)
            label = f"ws {config.name} {case} h{heads} step {step}, {splits} splits"
            _agree(got[splits], glu, pool, heads, label + " vs the Gluon split kernel")
            if splits == default:
                ref = mla_reference.decode(
                    q.cpu(), pool.cache.cpu(), pool.table.cpu(), seq.cpu(),
                    softmax_scale=SH_SCALE, quant=pool.quant,
                )  # fmt: skip
                check(got[splits][0], got[splits][1], ref[0].cuda(), ref[1].cuda(), pool.quant)
        _agree(got[1], got[4], pool, heads, f"ws {case} h{heads} step {step}: 1 vs 4 splits")


@gpu
@pytest.mark.parametrize(
    ("config", "nvfp4"),
    [(VARIANTS[0], False), (VARIANTS[3], False), (NVFP4_CONFIG, True), (NVFP4_TMA_CONFIG, True)],
    ids=[VARIANTS[0].name, VARIANTS[3].name, "nvfp4", "nvfp4-tma"],
)  # fmt: skip
def test_shadow_nan_rule_as_gluon(config: WsConfig, nvfp4: bool) -> None:
    """Through the fp8 shadow (V̂ = K̂, scale 3), or nvfp4's (its V̂ section; the lengths'
    open V blocks from the raw rows): pages outside the cache, a length outside the table
    and a non-finite latent element seen (its K̂ is NaN) poison exactly the rows
    the Gluon split kernel's shadow path poisons (one split and several); a non-finite row
    past a request's end (in its last tile: TMA brings it in) poisons nothing. Unforced,
    ``decode_shadow`` is the call forced to the dispatch's configuration bit for bit."""
    from mla_triton import allocate_shadow, update_cache

    quant = AttentionQuant.uniform("nvfp4") if nvfp4 else FP8_3
    glu_config = SEPARATE_V_CONFIG if nvfp4 else GLUON_VARIANTS[0]

    q, cache, table, seq = _inputs(6, 128, 64, [200, 300, 150, 90, 150, 100], torch.bfloat16)
    cache[table[5, 1], 50, :] = float("nan")  # request 5: token 114 (unseen, same tile)
    cache[table[3, 1], 5, 7] = float("inf")  # request 3: token 69 (seen) is not finite
    shadow = allocate_shadow(cache.shape[0], 64, quant, device="cuda")
    flat = cache.reshape(-1, 576).clone()
    slots = torch.arange(flat.shape[0], device="cuda", dtype=torch.int64)
    update_cache(flat[:, :512], flat[:, 512:], cache, slots, shadow, quant=quant)
    table[0, 1] = -1  # request 0: a page outside the cache
    table[1, 2] = cache.shape[0]  # request 1: too
    seq[2] = table.shape[1] * 64 + 1  # request 2: beyond the table's capacity
    kw: dict[str, Any] = {"softmax_scale": SCALE, "quant": quant}
    for splits in (1, 3):
        o_w, l_w = decode_shadow(q, cache, shadow, table, seq, num_splits=splits, config=config,
                                 **kw)  # fmt: skip
        o_g, l_g = decode_shadow(q, cache, shadow, table, seq, num_splits=splits,
                                 config=glu_config, **kw)  # fmt: skip
        assert bool(torch.isnan(o_g[:4]).all())  # requests 0 to 3 are poisoned
        assert bool(torch.isfinite(o_w[4:]).all()) and bool(torch.isfinite(l_w[4:]).all())
        assert torch.equal(torch.isnan(o_w), torch.isnan(o_g))
        assert torch.equal(torch.isnan(l_w), torch.isnan(l_g))
        # the finite rows: P̂ codes may differ where a score is one ulp off (test_shadow_gpu)
        den = o_g[4:].double().abs().amax(-1).clamp_min(1e-3)
        err = ((o_w[4:].double() - o_g[4:].double()).abs().amax(-1) / den).flatten()
        assert int((err > 4e-3).sum()) <= max(1, math.ceil(0.02 * err.numel())), err.max()
        assert float(err.max()) <= 0.5
    for splits in (1, 3):
        auto = decode_shadow(q, cache, shadow, table, seq, num_splits=splits, **kw)
        direct = decode_shadow(q, cache, shadow, table, seq, num_splits=splits,
                               config=NVFP4_CONFIG if nvfp4 else VARIANTS[0], **kw)  # fmt: skip
        assert torch.equal(auto[0].nan_to_num(7.0), direct[0].nan_to_num(7.0))
        assert torch.equal(auto[1].nan_to_num(7.0), direct[1].nan_to_num(7.0))
