"""GPU suite of the shadow cache: bf16 caches, compiled kernels, against on-read decode.

Skipped without a CUDA GPU (CI runs on CPUs; ``nox -s gpu`` runs it on one). The CPU
suite (test_shadow.py) runs the interpreter on fp16 data; here the kernels are
compiled, with the GPU's fast paths (hardware E4M3 conversion, FMA, the
multiply-and-round nvfp4 on read), on bf16 data, whose 8 significant bits make exact
E2M1 rounding ties common.

Per recipe and storage, a pool of ragged sequences (lengths across 16-token
blocks, tiles and split bounds, up to 1000) is filled like an engine fills it:
a prefill in three chunks, then decode steps of one token. After the prefill and
the decode steps, the shadow's contents equal ``mla_formats`` bitwise (on CPU
copies); after every decode step ``decode_shadow`` equals on-read ``decode`` with the
same tiles and split count (1, 4 and the default policy) within the bounds of
compiled float32 arithmetic (``_compare``); the share of bit-identical rows is
printed.

Forced to ``"gluon"`` (sm90 only; the shadows ``gluon_shadow_taken`` takes: fp16
storage with V̂ = K̂, or a V̂ section: nvfp4 with its open block quantized in the kernel,
dynamic K, K and V of different recipes) and to ``"gluon_ws"`` (the shadows the
warp-specialized kernel reads, the packed nvfp4 one among them): ``decode_shadow``
through the Gluon kernels against the Triton shadow kernel and on-read decode with the
same split count (``_agree``'s bounds: the quantized operands are the same bits, the
summation order differs), and against
``mla_reference.decode`` (float64, CPU) with test_decode_gpu's bounds, after each step.
The packed nvfp4 shadow's decode equals, bit for bit, the fp16 storage of the same cache.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from calls import decode, decode_shadow  # the public calls, ``impl``/``config`` forced
from test_shadow import NVFP4, RECIPES, SCALE, Pool, check_contents, row_errors

import mla_reference
from mla_formats import AttentionQuant, OperandQuant
from mla_triton.common.splitk import decode_num_splits
from mla_triton.ops.decode.gluon import GluonRecipe, gluon_facts
from mla_triton.ops.decode.gluon_ws import ws_shadow_dispatched
from mla_triton.ops.decode.triton import default_config as decode_config
from mla_triton.ops.shadow import (
    _gluon_tiles,
    gluon_shadow_recipe,
    gluon_shadow_taken,
    shadow_decode_config,
    shadow_layout,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels, bf16)"
)

TOL_ROW = 4e-3
LSE_TOL = 2e-5
LOOSE = 0.5
LENS = [4, 9, 15, 16, 17, 31, 33, 35, 63, 64, 65, 121, 128, 129, 200, 255, 256, 302, 511, 1000]
STEPS = 3


def _prefill(pool: Pool) -> None:
    """Each sequence's first ``len - STEPS`` tokens in three chunks, all sequences per chunk."""
    first = [n - STEPS for n in LENS]
    third = [f // 3 for f in first]
    pool.append(third)
    pool.append(third)
    pool.append([f - 2 * t for f, t in zip(first, third, strict=True)])


def _compare(pool: Pool, q: torch.Tensor, splits: int, label: str) -> tuple[int, int]:
    """decode_shadow against decode, the shadow's default tiles given to both.

    Returns (rows bit-identical, rows). The quantized operands are the same bits
    (``check_contents``; on-read QDQ matches mla_formats too), but the two kernels
    are compiled separately: the dots' accumulation and the softmax arithmetic
    may round differently in the last bit (the interpreter, which runs both in
    the same numpy order, gives equal bits), and a score one ulp off can move P
    across a rounding midpoint: one P code, a change of up to a third of its
    block's maximum. So, as in test_decode_gpu: LSE within 2e-5, rows within 4e-3
    but for at most 2% of them, every row within ``LOOSE``.
    """
    heads = q.shape[1]
    cfg = shadow_decode_config(heads, pool.quant, pool.storage)
    seq = pool.seq_lens()
    kw = {"softmax_scale": SCALE, "quant": pool.quant, "num_splits": splits}
    want = decode(q, pool.cache, pool.table, seq, config=cfg, **kw)
    got = decode_shadow(
        q, pool.cache, pool.shadow, pool.table, seq, storage=pool.storage, config=cfg, **kw
    )
    return _agree(got, want, pool, heads, f"{label}, {splits} splits")


def _agree(
    got: tuple[torch.Tensor, torch.Tensor],
    want: tuple[torch.Tensor, torch.Tensor],
    pool: Pool,
    heads: int,
    label: str,
) -> tuple[int, int]:
    """``_compare``'s bounds on two ``(out, lse)`` results; (rows bit-identical, rows)."""
    out, ref = got[0].flatten(0, 1), want[0].flatten(0, 1)
    same = int(((out == ref).all(-1) & (got[1] == want[1]).flatten()).sum())
    lse_err = (got[1].double() - want[1].double()).abs().max().item()
    err = row_errors(out, ref)
    far = int((err > TOL_ROW).sum())
    where = ", ".join(
        f"seq {i // heads} (len {pool.lens[i // heads]}) {err[i].item():.2e}"
        for i in (err > TOL_ROW).nonzero().flatten().tolist()[:8]
    )
    message = (
        f"{label}: {same} of {err.numel()} rows bit-identical, "
        f"{far} beyond {TOL_ROW} ({where}), max {err.max().item():.2e}, LSE {lse_err:.1e}"
    )
    assert lse_err <= LSE_TOL, message
    assert far <= max(1, math.ceil(0.02 * err.numel())), message
    assert err.max().item() <= LOOSE, message
    return same, err.numel()


CASES = {
    "nvfp4": (NVFP4, "fp16", 16),
    "nvfp4-packed": (NVFP4, "packed", 64),
    "fp8": (AttentionQuant.uniform("fp8"), "fp16", 16),
    "kdyn-nvfp4-vfp8": (RECIPES["kdyn-nvfp4-vfp8"][0], "packed", 64),
    "calibrated": (RECIPES["calibrated"][0], "fp16", 16),
    # fp8 K and V under one static scale that is not a power of two (V̂ = K̂, fp16)
    "fp8-scale-3": (
        AttentionQuant(q="fp8", k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0), p="fp8"),
        "fp16",
        64,
    ),
}
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
GLUON_ONLY = {
    # a V̂ section, each token's dynamic K scale from the shadow (rows of 2192 bytes)
    "kdyn-nvfp4-vfp8-fp16": (RECIPES["kdyn-nvfp4-vfp8"][0], "fp16", 64),
    # K not quantized (raw K tiles), nvfp4 V̂ and its open block
    "v-only": (RECIPES["v-only"][0], "fp16", 64),
}
GLUON_CASES = [
    c
    for c, (quant, storage, _) in (CASES | GLUON_ONLY).items()
    if isinstance(
        gluon_shadow_recipe(quant, shadow_layout(quant, storage=storage), torch.bfloat16),
        GluonRecipe,
    )
]
"""The cases the Gluon kernels take: fp16 storage with V̂ = K̂ (fp8, fp8-scale-3) or a V̂
section (nvfp4, calibrated, and the two of ``GLUON_ONLY``), and the packed nvfp4 shadow
(nvfp4-packed: the warp-specialized kernel's decoding producer)."""


def _gluon_recipe(case: str) -> GluonRecipe | str:
    quant, storage, _ = (CASES | GLUON_ONLY)[case]
    return gluon_shadow_recipe(quant, shadow_layout(quant, storage=storage), torch.bfloat16)


def _takes(impl: str, case: str) -> bool:
    r = _gluon_recipe(case)
    if not isinstance(r, GluonRecipe):
        return False
    # the split kernel does not read the packed shadow
    return ws_shadow_dispatched(r) if impl == "gluon_ws" else not r.packed


GLUON_IMPL_CASES = [(c, i) for c in GLUON_CASES for i in ("gluon", "gluon_ws") if _takes(i, c)]
"""``(case, impl)``: the Gluon split kernel on every fp16 case, the warp-specialized one
on the shadows it reads."""


def _pool(case: str) -> Pool:
    quant, storage, page = (CASES | GLUON_ONLY)[case]
    return Pool(
        quant,
        storage,
        page=page,
        max_len=max(LENS),
        batch=len(LENS),
        seed=11,
        dtype=torch.bfloat16,
        device="cuda",
    )


def _query(heads: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(12)
    return (torch.randn(len(LENS), heads, 576, generator=gen) * 0.5).bfloat16().cuda()


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("case", list(CASES))
def test_shadow_equals_on_read_bf16(case: str, heads: int) -> None:
    pool = _pool(case)
    _prefill(pool)
    check_contents(pool)
    q = _query(heads)
    default = decode_num_splits(len(LENS), heads, max(LENS), device=torch.device("cuda"))
    same = rows = 0
    for step in range(STEPS):
        pool.append([1] * len(LENS), pad=1)
        for splits in sorted({1, 4, default}):
            s, n = _compare(pool, q, splits, f"{case} h{heads} step {step}")
            same, rows = same + s, rows + n
    check_contents(pool)
    assert pool.lens == LENS
    print(f"\n{case} h{heads}: {same} of {rows} rows bit-identical to on-read decode")


def test_default_tiles_are_the_same() -> None:
    """vLLM passes no tiles: for nvfp4 the two paths' defaults must agree to be bitwise."""
    for heads in (16, 128):
        assert shadow_decode_config(heads, NVFP4) == decode_config(heads, NVFP4)


@pytest.mark.skipif(not SM90, reason="the Gluon kernel needs an sm90 CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("case", "impl"), GLUON_IMPL_CASES)
def test_gluon_shadow_bf16(case: str, impl: str, heads: int) -> None:
    """``decode_shadow`` forced to a Gluon kernel against the Triton shadow kernel and
    on-read decode (same split counts: 1, 4, the default) and against the float64 oracle,
    each step."""
    from test_decode_gpu import check

    pool = _pool(case)
    _prefill(pool)
    q = _query(heads)
    lay = shadow_layout(pool.quant, storage=pool.storage)
    # the facts' tensor, as decode_shadow takes it: K̂, or the raw rows (K none, packed)
    rec = gluon_shadow_recipe(pool.quant, lay, q.dtype)
    tiles = _gluon_tiles(rec, lay, pool.cache, lay.views(pool.shadow), None)[0]
    facts = gluon_facts(q[..., :512], tiles, pool.quant, 512)
    assert isinstance(gluon_shadow_taken(facts, layout=lay), GluonRecipe)
    default = decode_num_splits(len(LENS), heads, max(LENS), device=torch.device("cuda"))
    same = rows = 0
    for step in range(STEPS):
        pool.append([1] * len(LENS), pad=1)
        seq = pool.seq_lens()
        for splits in sorted({1, 4, default}):
            kw: dict[str, Any] = {"softmax_scale": SCALE, "quant": pool.quant,
                                     "num_splits": splits}  # fmt: skip
            args = (q, pool.cache, pool.shadow, pool.table, seq)
            got = decode_shadow(*args, storage=pool.storage, impl=impl, **kw)
            tri = decode_shadow(*args, storage=pool.storage, impl="triton", **kw)
            label = f"{impl} {case} h{heads} step {step}, {splits} splits"
            s, n = _agree(got, tri, pool, heads, label + " vs Triton shadow")
            on_read = decode(q, pool.cache, pool.table, seq, impl="triton", **kw)
            _agree(got, on_read, pool, heads, label + " vs on-read")
            same, rows = same + s, rows + n
            if splits == default:
                ref = mla_reference.decode(
                    q.cpu(), pool.cache.cpu(), pool.table.cpu(), seq.cpu(), softmax_scale=SCALE,
                    quant=pool.quant,
                )  # fmt: skip
                check(got[0], got[1], ref[0].cuda(), ref[1].cuda(), pool.quant)
    check_contents(pool)
    print(f"\n{impl} {case} h{heads}: {same} of {rows} rows bit-identical to the Triton shadow")


@pytest.mark.skipif(not SM90, reason="the Gluon kernel needs an sm90 CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_packed_equals_fp16_storage_bf16(heads: int) -> None:
    """The packed nvfp4 shadow as dispatched (``gluon_ws.NVFP4_PACKED_CONFIG``, its
    producer decoding 16-row units staged ahead by ``cp.async``): each step and split count
    (1, 4, the default), bit for bit the ``fp16`` shadow of the same cache through
    ``NVFP4_CONFIG`` (the same values, tiles and order); against the float64 oracle at the
    default count."""
    from test_decode_gpu import check

    from mla_triton.ops.decode.gluon_ws import NVFP4_CONFIG

    pool = _pool("nvfp4-packed")
    twin = Pool(NVFP4, "fp16", page=pool.page, max_len=max(LENS), batch=len(LENS), seed=11,
                dtype=torch.bfloat16, device="cuda")  # fmt: skip
    _prefill(pool)
    _prefill(twin)
    assert torch.equal(pool.cache.nan_to_num(), twin.cache.nan_to_num())  # the same cache
    q = _query(heads)
    default = decode_num_splits(len(LENS), heads, max(LENS), device=torch.device("cuda"))
    for step in range(STEPS):
        pool.append([1] * len(LENS), pad=1)
        twin.append([1] * len(LENS), pad=1)
        seq = pool.seq_lens()
        for splits in sorted({1, 4, default}):
            kw: dict[str, Any] = {"softmax_scale": SCALE, "quant": NVFP4, "num_splits": splits}
            args = (q, pool.cache, pool.shadow, pool.table, seq)
            got = decode_shadow(*args, storage="packed", **kw)
            f16 = decode_shadow(q, twin.cache, twin.shadow, twin.table, seq, storage="fp16",
                                config=NVFP4_CONFIG, **kw)  # fmt: skip
            label = f"packed h{heads} step {step}, {splits} splits"
            assert torch.equal(got[0], f16[0]) and torch.equal(got[1], f16[1]), (
                f"{label}: not bit for bit the fp16 storage"
            )
            if splits == default:
                ref = mla_reference.decode(
                    q.cpu(), pool.cache.cpu(), pool.table.cpu(), seq.cpu(), softmax_scale=SCALE,
                    quant=NVFP4,
                )  # fmt: skip
                check(got[0], got[1], ref[0].cuda(), ref[1].cuda(), NVFP4)
    check_contents(pool)
