"""``mla_triton.prefill`` on a GPU in bfloat16 at real sizes, against ``mla_reference``.

Skipped without CUDA (CI has none). Run on a GPU machine with

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python -m pytest packages/mla-triton/tests/test_prefill_gpu.py -n 8

The oracle runs in float32 on the CPU from the same bf16 inputs: on CUDA, torch
divides a tensor by a Python scalar as a multiplication by its reciprocal, so
``mla_formats`` computes dynamic global scales ``amax / 2688`` one ulp off in
about a fifth of the rows there, and bf16 data sits on E2M1 ties often enough
that this moves ~1% of the outputs (seen on an H200; reported for mla_formats).
Tolerances: the bf16 output rounding (and bf16 P in the PV dot when P is not
quantized); with quantized P, a small fraction of elements may sit one P code
away (GPU exp2 is approximate, so values near a rounding midpoint can flip),
each bounded.

The tests that the Gluon sm90 kernel covers (every recipe, N:M sparsity; no
``PrefillConfig``, head dims up to 256/128) run for ``impl`` "triton" and "gluon"
(the latter skipped, as a GPU skip, off sm90): Gluon against the oracle and
against the Triton kernel (same tolerances, NaN and -inf positions equal);
``test_gluon_tilings`` runs every Gluon tiling ``prefill``'s dispatcher picks
(``gluon_prefill.AUTO_CONFIGS``, the warp-specialized one included) with its recipes,
the plain default, the warp-specialized tilings with fp8 / nvfp4 P, the ping-pong
tilings with every P format, and N:M on each schedule; ``test_nan_rule_gluon_tilings``
the NaN rule on the ping-pong tilings (their masked V tiles are checked by one
warpgroup for both).
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from calls import prefill  # mla_triton.prefill, with ``impl``/``config`` forced (tuning.use)

import mla_reference
from mla_formats import AttentionQuant, NMSparsity, OperandQuant, e2m1_round, e4m3_round
from mla_triton.common import qdq as dev
from mla_triton.common.intercept import intercept
from mla_triton.ops.prefill import gluon as gluon_prefill
from mla_triton.ops.prefill.core import Recipe
from mla_triton.ops.prefill.triton import PrefillConfig

torch.set_num_threads(2)  # one of several xdist workers sharing the host's cores

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU (not the interpreter)",
)

QUANTS: dict[str, AttentionQuant | None] = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "q-nvfp4": AttentionQuant(q="nvfp4"),
    "k-nvfp4": AttentionQuant(k="nvfp4"),
    "p-nvfp4": AttentionQuant(p="nvfp4"),
    "v-nvfp4": AttentionQuant(v="nvfp4"),
    "p-fp8": AttentionQuant(p="fp8"),
    "k-fp8-v-nvfp4": AttentionQuant(q="fp8", k="fp8", p="nvfp4", v="nvfp4"),
    "nvfp4-amax": AttentionQuant(
        q=OperandQuant("nvfp4", 7.0),
        k=OperandQuant("nvfp4", "dynamic"),
        p=OperandQuant("nvfp4", 1.5),
        v=OperandQuant("nvfp4", 3.0),
    ),
    "fp8-dynamic-k": AttentionQuant(q="fp8", k=OperandQuant("fp8", "dynamic"), p="fp8", v="fp8"),
}


def make_batch(
    lens_q: list[int],
    lens_k: list[int],
    heads: int,
    kv_heads: int,
    dim: int = 192,
    dim_v: int = 128,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, dim, device="cuda", generator=g)
    k = torch.randn(int(cu_k[-1]), kv_heads, dim, device="cuda", generator=g)
    v = torch.randn(int(cu_k[-1]), kv_heads, dim_v, device="cuda", generator=g)
    q[..., :3] *= 4.0
    k[::7] *= 3.0
    scale = 3.0 / math.sqrt(dim)
    return q.to(dtype), k.to(dtype), v.to(dtype), cu_q.cuda(), cu_k.cuda(), scale


def check(
    out: torch.Tensor,
    ref: torch.Tensor,
    lse: torch.Tensor,
    ref_lse: torch.Tensor,
    *,
    p_quantized: bool,
    what: str,
) -> None:
    assert not torch.isnan(out).any(), what
    o, r = out.double(), ref.double()
    scale = r.abs().max().item()
    err = (o - r).abs()
    bad = err > 5e-3 * scale + 1e-2 * r.abs()
    frac = bad.double().mean().item()
    worst = err.max().item() / scale
    allowed = 0.005 if p_quantized else 0.0
    print(f"{what}: max err {worst:.3g} of max|ref|, {frac:.4%} elements off")
    assert frac <= allowed, f"{what}: {frac:.3%} elements off, worst {worst:.3g}"
    assert worst <= (0.35 if p_quantized else 0.02), what
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float())), what
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite].float(), atol=1e-3, rtol=1e-4), what


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(params=["triton", "gluon"])
def impl(request: pytest.FixtureRequest) -> str:
    """``prefill``'s implementation under test (Gluon: on an sm90 GPU only)."""
    if request.param == "gluon" and not _sm90():
        pytest.skip("impl gluon needs an sm90 (H100/H200) GPU")
    return str(request.param)


def run(q, k, v, cu_q, cu_k, scale, what, **kwargs):  # type: ignore[no-untyped-def]
    """prefill against the oracle; with ``impl="gluon"`` against the Triton kernel too."""
    quant = kwargs.get("quant")
    out, lse = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, return_lse=True, **kwargs)
    p_quantized = quant is not None and not quant.p.is_identity
    if kwargs.get("impl") == "gluon":
        triton_kwargs = kwargs | {"impl": "triton", "config": None}
        want, want_lse = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, return_lse=True,
                                 **triton_kwargs)  # fmt: skip
        check(out.cpu(), want.cpu(), lse.cpu(), want_lse.cpu(), p_quantized=p_quantized,
              what=f"{what} gluon vs triton")  # fmt: skip
    kwargs.pop("impl", None)
    kwargs.pop("config", None)
    kwargs.pop("max_seqlen_q", None)
    kwargs.pop("max_seqlen_k", None)
    cpu = [t.cpu() for t in (q, k, v, cu_q, cu_k)]
    ref, ref_lse = mla_reference.prefill(
        *cpu, softmax_scale=scale, return_lse=True, compute_dtype=torch.float32,
        out_dtype=torch.float32, **kwargs,
    )  # fmt: skip
    check(out.cpu(), ref, lse.cpu(), ref_lse, p_quantized=p_quantized, what=what)
    return out


LENS = [1, 15, 16, 17, 300, 1000, 2500]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(QUANTS))
def test_bf16_192_128_varlen(name: str, causal: bool, impl: str) -> None:
    q, k, v, cu_q, cu_k, scale = make_batch(LENS, [n + 7 * (n % 2) for n in LENS], 16, 16)
    run(q, k, v, cu_q, cu_k, scale, f"{name} causal={causal}", causal=causal, quant=QUANTS[name],
        impl=impl)  # fmt: skip


@pytest.mark.parametrize("name", ["none", "nvfp4"])
def test_bf16_long_sequence_gqa(name: str, impl: str) -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([4096], [4096], 16, 2, seed=1)
    run(q, k, v, cu_q, cu_k, scale, f"{name} L=4096 GQA 16/2", quant=QUANTS[name], impl=impl)


@pytest.mark.parametrize("name", ["none", "nvfp4"])
def test_bf16_nm_sparsity(name: str, impl: str) -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([1, 100, 2000], [50, 100, 2048], 16, 16, seed=2)
    for sparsity in (NMSparsity(2, 4), NMSparsity(2, 4, 64, 64), NMSparsity(4, 8, 16, 0)):
        run(q, k, v, cu_q, cu_k, scale, f"{name} {sparsity}", quant=QUANTS[name], sparsity=sparsity,
            impl=impl)  # fmt: skip


@pytest.mark.parametrize("name", ["none", "nvfp4"])
def test_bf16_576_512(name: str) -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([5, 200], [40, 300], 16, 1, 576, 512, seed=3)
    run(q, k, v, cu_q, cu_k, scale, f"{name} 576/512", quant=QUANTS[name])


def test_fp16_and_fused_placement(impl: str) -> None:
    """Sequences of one 128-query tile: K/V QDQ fused into the attention kernel; an
    overstated max_seqlen_q (idle extra tiles) takes the K/V pass: the same numbers."""
    q, k, v, cu_q, cu_k, scale = make_batch([100, 120], [100, 900], 8, 8, dtype=torch.float16)
    quant = QUANTS["nvfp4"]
    a = run(q, k, v, cu_q, cu_k, scale, "fp16 nvfp4 fused", quant=quant, impl=impl)
    b = run(q, k, v, cu_q, cu_k, scale, "fp16 nvfp4 prepass", quant=quant, max_seqlen_q=1000,
            max_seqlen_k=900, impl=impl)  # fmt: skip
    assert torch.equal(a, b)


def test_understated_max_seqlen_k_and_empty_batch(impl: str) -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([33, 500], [40, 512], 8, 8, seed=6)
    want = run(q, k, v, cu_q, cu_k, scale, "nvfp4", quant=QUANTS["nvfp4"], impl=impl)
    for max_k in (0, 1, 100):
        got = prefill(
            q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS["nvfp4"], max_seqlen_q=500,
            max_seqlen_k=max_k, impl=impl,
        )  # fmt: skip
        assert torch.equal(got, want), max_k
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse = prefill(q[:0], k[:0], v[:0], cu, cu, softmax_scale=scale, return_lse=True,
                       impl=impl)  # fmt: skip
    assert out.shape == (0, 8, 128) and lse.shape == (8, 0)
    # sequences without keys (no key tokens at all): out 0, lse -inf
    cu_k0 = torch.zeros(3, dtype=torch.int32, device="cuda")
    out, lse = prefill(q, k[:0], v[:0], cu_q, cu_k0, softmax_scale=scale, return_lse=True,
                       causal=False, impl=impl)  # fmt: skip
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


def test_nan_rule_bf16(impl: str) -> None:
    """NaN / inf in q, k and v (real tile sizes: the causal diagonal tiles are 128 x 64):
    exactly the rows that see them are NaN; the others match the oracle."""
    _nan_rule(impl, None)


def _nan_rule(impl: str, config: object) -> None:
    lens = [300, 200]
    q, k, v, cu_q, cu_k, scale = make_batch(lens, lens, 16, 16, seed=7)
    q[10, 3, 5] = float("nan")  # sequence 0, query 10, head 3
    k[300 + 70, 5, 100] = float("inf")  # sequence 1, key 70, head 5
    v[300 + 130, 7, 2] = float("-inf")  # sequence 1, key 130 (nvfp4 block 128-143), head 7
    for name in ("none", "nvfp4"):
        for causal in (True, False):
            out, lse = prefill(
                q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS[name], causal=causal,
                return_lse=True, impl=impl, config=config,
            )  # fmt: skip
            want = torch.zeros(500, 16, dtype=torch.bool)
            want[10, 3] = True
            first_v = 128 if name == "nvfp4" else 130
            want[300 + (70 if causal else 0) :, 5] = True
            want[300 + (first_v if causal else 0) :, 7] = True
            what = f"{name} causal={causal}"
            assert torch.equal(out.isnan().all(-1).cpu(), want), what
            assert bool(out[~want.cuda()].isfinite().all()), what
            lse_nan = want.clone()
            lse_nan[:, 7] = False
            assert torch.equal(lse.isnan().T.cpu(), lse_nan), what


@pytest.mark.parametrize(
    "config",
    [PrefillConfig(64, 32, num_warps=4, num_stages=2), PrefillConfig(128, 64, 8, 3),
     PrefillConfig(64, 64, 4, 1), PrefillConfig(32, 32, 4, 4)],
    ids=str,
)  # fmt: skip
def test_other_tilings_bf16(config: PrefillConfig) -> None:
    """Non-default tilings, warps and stages (1 to 4, all PrefillConfig accepts) against
    the oracle, not against each other."""
    q, k, v, cu_q, cu_k, scale = make_batch([300, 1000], [300, 1200], 16, 16, seed=4)
    for name in ("none", "nvfp4"):
        run(q, k, v, cu_q, cu_k, scale, f"{name} {config}", quant=QUANTS[name], config=config)


def test_out_slice_and_max_seqlen_no_sync(impl: str) -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([33, 500], [40, 512], 8, 8, seed=5)
    want = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS["nvfp4"], impl=impl)
    big = torch.zeros(q.shape[0], 10, 160, dtype=q.dtype, device="cuda")
    prefill(
        q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS["nvfp4"], out=big[:, 1:9, 16:144],
        max_seqlen_q=500, max_seqlen_k=512, impl=impl,
    )  # fmt: skip
    assert torch.equal(big[:, 1:9, 16:144], want)


@pytest.mark.parametrize("name", ["none", "nvfp4"])
@pytest.mark.parametrize(
    ("shift", "seq", "over"),
    [(0, 1, (300, 0)), (0, 0, (0, 700)), (5, 1, (0, 0)), (0, 2, (1, 1))],
    ids=["q-past-end", "k-past-end", "negative-start", "last-one-past"],
)
def test_vouched_offsets_never_leave_the_tensors(
    name: str, shift: int, seq: int, over: tuple[int, int], impl: str
) -> None:
    """Vouched offsets that leave the tensors (docs/numerics.md "Vouched offsets"): the
    sequences inside are as with checked offsets, a sequence that leaves gets NaN rows,
    nothing around ``out`` is written (compute-sanitizer's memcheck sees no bad access)."""
    lens_q, lens_k = [33, 300, 7], [40, 512, 64]
    q, k, v, _, _, scale = make_batch(lens_q, lens_k, 8, 8, seed=11)
    cu_q, cu_k = [0], [0]
    for i, (a, b) in enumerate(zip(lens_q, lens_k, strict=True)):
        cu_q.append(cu_q[-1] + a + (over[0] if i == seq else 0))
        cu_k.append(cu_k[-1] + b + (over[1] if i == seq else 0))
    cu_q, cu_k = [x - shift for x in cu_q], [x - shift for x in cu_k]
    tokens, tokens_k = q.shape[0], k.shape[0]
    big = torch.full((tokens + 64, 10, 160), 7.0, dtype=q.dtype, device="cuda")
    out = big[32 : 32 + tokens, 1:9, 16:144]
    kw: dict[str, Any] = {"softmax_scale": scale, "quant": QUANTS[name], "impl": impl}
    cq, ck = (torch.tensor(x, dtype=torch.int32, device="cuda") for x in (cu_q, cu_k))
    _, lse = prefill(
        q, k, v, cq, ck, return_lse=True, out=out, max_seqlen_q=max(lens_q) + over[0],
        max_seqlen_k=max(lens_k) + over[1], **kw,
    )  # fmt: skip
    torch.cuda.synchronize()
    outside = torch.ones(big.shape, dtype=torch.bool, device="cuda")
    outside[32 : 32 + tokens, 1:9, 16:144] = False
    assert torch.all(big[outside] == 7.0), "prefill wrote outside out"
    for i in range(len(lens_q)):
        a = max(cu_q[i], 0)
        b = max(min(cu_q[i + 1], tokens), a)
        if cu_q[i] < 0 or cu_q[i + 1] > tokens or cu_k[i] < 0 or cu_k[i + 1] > tokens_k:
            assert out[a:b].isnan().all() and lse[:, a:b].isnan().all(), (i, a, b)
            continue
        ka, kb = cu_k[i], cu_k[i + 1]
        one_q, one_k = (torch.tensor([0, n], dtype=torch.int32, device="cuda")
                        for n in (b - a, kb - ka))  # fmt: skip
        want, want_lse = prefill(q[a:b], k[ka:kb], v[ka:kb], one_q, one_k, return_lse=True, **kw)
        assert torch.equal(out[a:b], want) and torch.equal(lse[:, a:b], want_lse), i


_AUTO = gluon_prefill.AUTO_CONFIGS
_PLAIN = gluon_prefill.GluonPrefillConfig()
_WS = gluon_prefill.GluonPrefillConfig(warp_specialize=True)
_PP64 = gluon_prefill.GluonPrefillConfig(128, 64, 3, warp_specialize=True, pingpong=True)
_PP128 = gluon_prefill.GluonPrefillConfig(128, 128, 2, warp_specialize=True, pingpong=True)
_NM = NMSparsity(2, 4, 16, 32)
# (tiling, recipe, sparsity): every tiling prefill's dispatcher picks with its recipes,
# the plain default, the warp-specialized tilings with quantized P and at 128 x 128,
# the ping-pong tilings, and N:M on each schedule
GLUON_CASES: dict[str, tuple[gluon_prefill.GluonPrefillConfig, str, NMSparsity | None]] = {
    "auto-none": (_AUTO["none"], "none", None),
    "auto-fp8": (_AUTO["fp8"], "fp8", None),
    "auto-fp8-dynamic-k": (_AUTO["fp8"], "fp8-dynamic-k", None),
    "auto-nvfp4": (_AUTO["nvfp4"], "nvfp4", None),
    "auto-k-fp8-v-nvfp4": (_AUTO["nvfp4"], "k-fp8-v-nvfp4", None),
    "plain-none": (_PLAIN, "none", None),
    "plain-nvfp4": (_PLAIN, "nvfp4", None),
    "ws-fp8": (_WS, "fp8", None),
    "ws-nvfp4": (_WS, "nvfp4", None),
    "ws-128x128-none": (gluon_prefill.GluonPrefillConfig(128, 128, 2, True), "none", None),
    "pp64-none": (_PP64, "none", None),
    "pp64-fp8": (_PP64, "fp8", None),
    "pp64-nvfp4": (_PP64, "nvfp4", None),
    "pp128-none": (_PP128, "none", None),
    "pp128-nvfp4": (_PP128, "nvfp4", None),
    "auto-nvfp4-2:4": (_AUTO["nvfp4+nm"], "nvfp4", _NM),
    "ws-none-2:4": (_WS, "none", _NM),
    "pp64-nvfp4-2:4": (_PP64, "nvfp4", _NM),
    "pp128-fp8-4:8": (_PP128, "fp8", NMSparsity(4, 8)),
}
# The schedule options: K slots released after Q K^T (early_k), two consumer warpgroups
# without turns (FA3's head-dim-192 schedule)
_EK128 = gluon_prefill.GluonPrefillConfig(128, 128, 2, True, True, early_k=True)
_NT128 = gluon_prefill.GluonPrefillConfig(128, 128, 2, True, True, turns=False, early_k=True)
SCHEDULE_CASES: dict[str, tuple[gluon_prefill.GluonPrefillConfig, str, NMSparsity | None]] = {
    "pp128-ek-none": (_EK128, "none", None),
    "pp128-ek-nvfp4": (_EK128, "nvfp4", None),
    "nt128-none": (_NT128, "none", None),
    "nt128-fp8": (_NT128, "fp8", None),
    "nt128-nvfp4-2:4": (_NT128, "nvfp4", _NM),
    "nt64-nvfp4": (gluon_prefill.GluonPrefillConfig(128, 64, 3, True, True, turns=False),
                   "nvfp4", None),
    "ws64-ek-nvfp4-2:4": (gluon_prefill.GluonPrefillConfig(128, 64, 3, True, early_k=True),
                          "nvfp4", _NM),
}  # fmt: skip
# Combined schedule options: two consumers without turns with early_k at 128 x 64, and
# nm_pairs (2:4 ranked by pair maxima and minima) on the warp-specialized tilings
_NT64_EK = gluon_prefill.GluonPrefillConfig(128, 64, 3, True, True, turns=False, early_k=True)
_WS128_EK = gluon_prefill.GluonPrefillConfig(128, 128, 2, True, early_k=True)
COMBINED_CASES: dict[str, tuple[gluon_prefill.GluonPrefillConfig, str, NMSparsity | None]] = {
    "nt64-ek-nvfp4": (_NT64_EK, "nvfp4", None),
    "nt64-ek-fp8": (_NT64_EK, "fp8", None),
    "ws128-ek-nvfp4-2:4": (_WS128_EK, "nvfp4", _NM),
    "ws128-ek-np-nvfp4-2:4": (replace(_WS128_EK, nm_pairs=True), "nvfp4", _NM),
    "ws128-ek-np-nr-nvfp4-2:4": (replace(_WS128_EK, nm_pairs=True, nm_nan_rank=True),
                                    "nvfp4", _NM),
    "ws64-ek-np-nr-nvfp4-2:4": (gluon_prefill.GluonPrefillConfig(
        128, 64, 3, True, early_k=True, nm_pairs=True, nm_nan_rank=True), "nvfp4", _NM),
    "ws64-ek-np-none-2:4": (gluon_prefill.GluonPrefillConfig(
        128, 64, 3, True, early_k=True, nm_pairs=True), "none", NMSparsity(2, 4)),
}  # fmt: skip
GLUON_CASES |= SCHEDULE_CASES | COMBINED_CASES


@pytest.mark.skipif(not _sm90(), reason="the Gluon prefill needs an sm90 (H100/H200) GPU")
@pytest.mark.parametrize("case", list(GLUON_CASES))
def test_gluon_tilings(case: str) -> None:
    """Gluon tilings (``GLUON_CASES``), varlen causal with GQA and a chunked context
    (non-causal, fewer queries than keys), against the oracle and the Triton kernel."""
    config, name, sparsity = GLUON_CASES[case]
    q, k, v, cu_q, cu_k, scale = make_batch(LENS, [n + 7 * (n % 2) for n in LENS], 16, 4)
    run(q, k, v, cu_q, cu_k, scale, f"{case} causal", quant=QUANTS[name], impl="gluon",
        config=config, sparsity=sparsity)  # fmt: skip
    q, k, v, cu_q, cu_k, scale = make_batch([1, 200, 64], [300, 1000, 64], 16, 16, seed=8)
    run(q, k, v, cu_q, cu_k, scale, f"{case} chunk", quant=QUANTS[name], causal=False,
        impl="gluon", config=config, sparsity=sparsity)  # fmt: skip


@pytest.mark.skipif(not _sm90(), reason="the Gluon prefill needs an sm90 (H100/H200) GPU")
@pytest.mark.parametrize(
    "config",
    [_PP64, _PP128, _EK128, _NT128, gluon_prefill.GluonPrefillConfig(), _NT64_EK, _WS128_EK,
     _AUTO["none"], _AUTO["nvfp4"]],
    ids=["pp64", "pp128", "pp128-ek", "nt128", "plain", "nt64-ek", "ws128-ek", "auto-none",
         "auto-nvfp4"],
)  # fmt: skip
def test_nan_rule_gluon_tilings(config: gluon_prefill.GluonPrefillConfig) -> None:
    """The NaN rule on the ping-pong tilings: a masked V tile is checked and zeroed by
    warpgroup 0 only, warpgroup 1 reads the first bad key it left (rows of both; without
    turns through the per-slot hand-over barrier); the infinite K element (key 70: on an
    unmasked tile for the queries of the second 128-row tile) poisons its rows."""
    _nan_rule("gluon", config)


@pytest.mark.skipif(not _sm90(), reason="the Gluon prefill needs an sm90 (H100/H200) GPU")
@pytest.mark.parametrize(
    ("name", "sparsity", "options"),
    [("nvfp4", _NM, {"nm_pairs": True}), ("none", NMSparsity(2, 4), {"nm_pairs": True}),
     ("nvfp4", _NM, {"nm_nan_rank": True}),
     ("none", NMSparsity(2, 4), {"nm_pairs": True, "nm_nan_rank": True})],
    ids=["np-nvfp4-2:4-dense", "np-none-2:4", "nr-nvfp4-2:4-dense", "np-nr-none-2:4"],
)  # fmt: skip
def test_nm_options_bit_for_bit(name: str, sparsity: NMSparsity, options: dict[str, bool]) -> None:
    """``nm_pairs`` keeps the same keys as the general rank, ``nm_nan_rank`` keeps every
    NaN score the guard keeps: out and LSE bit for bit against the same tiling without them
    (varlen causal, GQA; a chunked context; the NaN rule's batch: a NaN in Q, an infinite
    K element, a -inf in V, causal and not)."""
    nan_batch = make_batch([300, 200], [300, 200], 16, 16, seed=7)
    q, k, v = nan_batch[:3]
    q[10, 3, 5] = float("nan")
    k[300 + 70, 5, 100] = float("inf")
    v[300 + 130, 7, 2] = float("-inf")
    batches = [(True, make_batch(LENS, LENS, 16, 4, seed=3)),
               (False, make_batch([1, 200, 64], [300, 1000, 64], 16, 16, seed=8)),
               (True, nan_batch), (False, nan_batch)]  # fmt: skip
    for index, (causal, (q, k, v, cu_q, cu_k, scale)) in enumerate(batches):
        kwargs = {"softmax_scale": scale, "return_lse": True, "causal": causal,
                  "quant": QUANTS[name], "sparsity": sparsity, "impl": "gluon"}  # fmt: skip
        got = [prefill(q, k, v, cu_q, cu_k, config=replace(_WS128_EK, **on), **kwargs)
               for on in (options, {})]  # fmt: skip
        for a, b in zip(*got, strict=True):
            assert torch.equal(a.isnan(), b.isnan()), (name, index)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (name, index)
        assert bool(got[0][0].isnan().any()) == (index >= 2), (name, index)


_Q_STATIC = {
    "fp8-static-q": AttentionQuant(q=OperandQuant("fp8", 5.0), k="fp8", p="fp8", v="fp8"),
    "nvfp4-static-q": AttentionQuant(q=OperandQuant("nvfp4", 5.0), k="nvfp4", p="nvfp4",
                                     v="nvfp4"),
    "fp8-pow2-q": AttentionQuant(q=OperandQuant("fp8", 7.0), k="fp8", p="fp8", v="fp8"),
    "nvfp4-pow2-q": AttentionQuant(q=OperandQuant("nvfp4", 5.25), k="nvfp4", p="nvfp4",
                                   v="nvfp4"),
}  # fmt: skip


@pytest.mark.skipif(not _sm90(), reason="the Gluon prefill needs an sm90 (H100/H200) GPU")
@pytest.mark.parametrize(
    ("name", "sparse"),
    [("fp8", False), ("fp8-dynamic-k", False), ("fp8-static-q", False),
     ("fp8-pow2-q", False), ("nvfp4-static-q", False), ("nvfp4-pow2-q", False),
     ("nvfp4-static-q", True), ("fp8", True)],
    ids=["s16-fp8", "s16-fp8-dyn-k", "s16-fp8-static-q", "s16-fp8-pow2-q", "s16-nvfp4-static-q",
         "s16-nvfp4-pow2-q", "s16-nvfp4-static-q-2:4", "s16-fp8-2:4"],
)  # fmt: skip
def test_q_in_kernel_bit_for_bit(name: str, sparse: bool) -> None:
    """``q_in_kernel`` (Q's QDQ in the kernel) gives the factored Q of the pass: out and
    LSE bit for bit against the same tiling (AUTO_CONFIGS') with the pass (varlen causal,
    GQA; a chunked context; the NaN rule's batch: a NaN and an inf in Q, causal and not)."""
    quant = QUANTS.get(name) or _Q_STATIC[name]
    sparsity = NMSparsity(2, 4) if sparse else None
    config = gluon_prefill.auto_config(Recipe.of(quant), sparse)
    nan_batch = make_batch([300, 200], [300, 200], 16, 16, seed=7)
    q, k, v = nan_batch[:3]
    q[10, 3, 5] = float("nan")
    q[300 + 40, 6, 150] = float("inf")
    batches = [(True, make_batch(LENS, LENS, 16, 4, seed=3)),
               (False, make_batch([1, 200, 64], [300, 1000, 64], 16, 16, seed=8)),
               (True, nan_batch), (False, nan_batch)]  # fmt: skip
    for index, (causal, (q, k, v, cu_q, cu_k, scale)) in enumerate(batches):
        kwargs = {"softmax_scale": scale, "return_lse": True, "causal": causal,
                  "quant": quant, "sparsity": sparsity, "impl": "gluon"}  # fmt: skip
        got = [prefill(q, k, v, cu_q, cu_k, config=replace(config, q_in_kernel=on), **kwargs)
               for on in (True, False)]  # fmt: skip
        for a, b in zip(*got, strict=True):
            assert torch.equal(a.isnan(), b.isnan()), (name, index)
            assert torch.equal(a.nan_to_num(), b.nan_to_num()), (name, index)
        assert bool(got[0][0].isnan().any()) == (index >= 2), (name, index)


@pytest.mark.skipif(not _sm90(), reason="the dispatch default needs an sm90 (H100/H200) GPU")
def test_auto_runs_gluon_on_sm90() -> None:
    """Without a forced implementation, sm90 launches the Gluon kernel, dense and N:M
    alike (the kernels run)."""
    launched: list[str] = []

    def spy(run: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> Any:
        launched.append(kernel.fn.__name__)
        return run(kernel, *args, grid=grid, warmup=False, **kwargs)

    q, k, v, cu_q, cu_k, scale = make_batch([300], [300], 8, 8, seed=9)
    with intercept(spy):
        prefill(q, k, v, cu_q, cu_k, softmax_scale=scale)
        prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, sparsity=NMSparsity(2, 4))
    assert launched.count("gluon_prefill_kernel") == 2 and "prefill_fwd_kernel" not in launched


@triton.jit
def _hw_kernel(x_ptr, y_ptr, z_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(y_ptr + offs, dev.e4m3_round_hw(tl.abs(x), True))
    tl.store(z_ptr + offs, dev.e2m1_round_nonneg(tl.abs(x)))


def test_hardware_e4m3_and_fast_e2m1_match_reference() -> None:
    """The sm89+ conversion and the magic-number E2M1 equal mla_formats on all fp16 values."""
    bits = torch.arange(0, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = bits.float()
    x = x[torch.isfinite(x)][:30720].cuda()  # a multiple of the block below
    y, z = torch.empty_like(x), torch.empty_like(x)
    n = 1024
    for s in range(0, x.numel(), n):
        _hw_kernel[(1,)](x[s : s + n], y[s : s + n], z[s : s + n], n)
    assert torch.equal(y, e4m3_round(x.abs()))
    assert torch.equal(z, e2m1_round(x.abs()))


@triton.jit
def _recip_kernel(x_ptr, hw_ptr, div_ptr, N: tl.constexpr):
    offs = tl.program_id(0) * N + tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(hw_ptr + offs, dev.recip_hw(x, True))
    tl.store(div_ptr + offs, 1.0 / x)


def test_recip_hw_equals_triton_division() -> None:
    """``recip_hw``'s one ``rcp.approx.ftz`` gives the bits of Triton's ``1.0 / x``
    (``div.full.f32``) on the range it is for: every E4M3 block scale times global
    scales across it (the ``1e-30`` clamp up to 448 times a bf16 amax's), and random
    float32 values of that range, NaN too."""
    sb = e4m3_round(torch.arange(0, 449, dtype=torch.float32))
    sb = torch.unique(torch.cat([sb, e4m3_round(torch.rand(4096) * 448)]))
    sb = sb[sb > 0]
    gs = torch.tensor([2.0**-30, 1 / 2688, 1 / 448, 1.0, 3.7e-7, 0.123, 3.4e38 / 2688])
    x = torch.cat([(sb[:, None] * gs[None, :]).flatten(), torch.tensor([1e-30, float("nan")])])
    rnd = torch.exp2(torch.rand(1 << 16, dtype=torch.float64) * 225 - 99).float()  # 2^-99..2^126
    x = torch.cat([x, rnd.clamp(min=1e-30, max=2.0**126 * (1 - 2**-24))])
    n = 1024
    x = torch.cat([x, torch.ones(-x.numel() % n)]).cuda()
    hw, div = torch.empty_like(x), torch.empty_like(x)
    _recip_kernel[(x.numel() // n,)](x, hw, div, n)
    assert torch.equal(hw.isnan(), div.isnan()) and int(hw.isnan().sum()) == 1
    ok = ~hw.isnan()
    assert torch.equal(hw[ok].view(torch.int32), div[ok].view(torch.int32))


@triton.jit
def _p_qdq_kernel(
    p_ptr, new_ptr, old_ptr, sw_ptr, gs, inv_6gs, ROWS: tl.constexpr, COLS: tl.constexpr
):  # fmt: skip
    offs = tl.program_id(0) * ROWS * COLS + tl.arange(0, ROWS)[:, None] * COLS
    offs += tl.arange(0, COLS)[None, :]
    p = tl.load(p_ptr + offs)
    tl.store(new_ptr + offs, dev.nvfp4_qdq_p(p, gs, inv_6gs, ROWS, COLS, True))
    tl.store(sw_ptr + offs, dev.nvfp4_qdq_p(p, gs, inv_6gs, ROWS, COLS, False))
    # the same QDQ by Triton's division and float32 products
    xb = tl.reshape(p, (ROWS, COLS // 16, 16))
    sb = dev.e4m3_round_hw(tl.max(xb, axis=2) * inv_6gs, True)
    inv = 1.0 / tl.maximum(sb * gs, 1e-30)
    code = dev.e2m1_round_nonneg(xb * tl.expand_dims(inv, 2))
    tl.store(old_ptr + offs, tl.reshape(code * tl.expand_dims(sb, 2), (ROWS, COLS)))


@pytest.mark.parametrize("amax", [1.0, 0.37, 1e-3])
def test_nvfp4_qdq_p_hardware_path_bit_for_bit(amax: float) -> None:
    """P's nvfp4 QDQ (``recip_hw``'s reciprocal, the codes times block scales in f16x2)
    equals, bit for bit, the same QDQ with Triton's division and float32 products and
    the float32 path of GPUs without fp8 conversions (its
    software E4M3 of the products ``bmax * inv_6gs``: wrong before ``poison`` stopped
    using ``a - a``): P tiles of exponentials, blocks of zeros, NaN included."""
    g = torch.Generator().manual_seed(14)
    t = (
        -torch.rand(64, 32, 128, generator=g)
        * torch.tensor([1.0, 8.0, 40.0]).repeat(22)[:64, None, None]
    )
    p = torch.exp2(t * 4)
    p[::7, :, :16] = 0.0
    p[::5, 3, 17] = float("nan")
    gs = amax / 2688
    p = p.cuda()
    new, old, sw = torch.empty_like(p), torch.empty_like(p), torch.empty_like(p)
    _p_qdq_kernel[(p.shape[0],)](p, new, old, sw, gs, 1 / (6 * gs), 32, 128)
    for other in (old, sw):
        assert torch.equal(new.isnan(), other.isnan())
        assert torch.equal(new.nan_to_num().view(torch.int32), other.nan_to_num().view(torch.int32))
    assert int((old != 0).sum()) > p.numel() // 4  # not a tile of zeros
