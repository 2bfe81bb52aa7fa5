"""``mla_triton.prefill`` against the oracle ``mla_reference.prefill`` (CPU, interpreter).

Run with ``TRITON_INTERPRET=1``; inputs are float32 or float16, and bfloat16
(which ``prefill`` computes in float32 under the interpreter, whose bf16
arithmetic is wrong). Comparisons are elementwise with tight tolerances; where
quantized P can legitimately differ from the oracle by one code (a value within
an ulp of an E2M1/E4M3 rounding midpoint, since exp2 rounds differently), a small
fraction of elements may exceed them, each by a bounded amount ("flips"). A
wrong axis, block origin or scale moves most elements and fails.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import triton
import triton.language as tl
from calls import prefill  # mla_triton.prefill, with ``config`` forced through tuning.use
from hypothesis import event, given, settings
from hypothesis import strategies as st

import mla_reference
from mla_formats import AttentionQuant, NMSparsity, OperandQuant, e2m1_round, qdq, qdq_factored
from mla_triton.common import qdq as dev
from mla_triton.common.intercept import intercept
from mla_triton.ops.prefill.triton import PrefillConfig

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs a GPU or TRITON_INTERPRET=1",
)

QUANTS: dict[str, AttentionQuant | None] = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "q-nvfp4": AttentionQuant(q="nvfp4"),
    "k-nvfp4": AttentionQuant(k="nvfp4"),
    "p-nvfp4": AttentionQuant(p="nvfp4"),
    "v-nvfp4": AttentionQuant(v="nvfp4"),
    "q-fp8": AttentionQuant(q="fp8"),
    "k-fp8": AttentionQuant(k="fp8"),
    "p-fp8": AttentionQuant(p="fp8"),
    "v-fp8": AttentionQuant(v="fp8"),
    "k-fp8-v-nvfp4": AttentionQuant(q="fp8", k="fp8", p="nvfp4", v="nvfp4"),
    "k-nvfp4-v-fp8": AttentionQuant(q="nvfp4", k="nvfp4", p="fp8", v="fp8"),
    # static Q, dynamic K, calibrated (non power-of-two) V and P amax
    "nvfp4-amax": AttentionQuant(
        q=OperandQuant("nvfp4", 7.0),
        k=OperandQuant("nvfp4", "dynamic"),
        p=OperandQuant("nvfp4", 1.5),
        v=OperandQuant("nvfp4", 3.0),
    ),
    "fp8-amax": AttentionQuant(
        q=OperandQuant("fp8", 9.0),
        k=OperandQuant("fp8", "dynamic"),
        p=OperandQuant("fp8", 2.5),
        v=OperandQuant("fp8", 2.5),
    ),
}


def make_batch(
    lens_q: list[int],
    lens_k: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dim_v: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    score_std: float = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Packed random q, k, v, their offsets and a softmax scale giving scores of ``score_std``."""
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=g)
    k = torch.randn(int(cu_k[-1]), kv_heads, dim, generator=g)
    v = torch.randn(int(cu_k[-1]), kv_heads, dim_v, generator=g)
    # a few large channels and tokens, as real activations have
    q[..., :3] *= 4.0
    k[::7] *= 3.0
    return q.to(dtype), k.to(dtype), v.to(dtype), cu_q, cu_k, score_std / math.sqrt(dim)


def assert_matches(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    rtol: float,
    atol: float,
    flips: float = 0.0,
    flip_err: float = 0.0,
    what: str = "",
) -> None:
    """Elementwise ``|out - ref| <= atol * max|ref| + rtol * |ref|``, except for at most a
    fraction ``flips`` of elements, each within ``flip_err * max|ref|``."""
    assert out.shape == ref.shape, what
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    if not out.numel():
        return
    o, r = out.double(), ref.double()
    scale = max(r.abs().max().item(), 1e-30)
    err = (o - r).abs()
    bad = err > atol * scale + rtol * r.abs()
    frac = bad.double().mean().item() if bad.numel() else 0.0
    worst = err.max().item() / scale if err.numel() else 0.0
    assert frac <= flips, f"{what}: {frac:.2%} off (allowed {flips:.2%}), worst {worst:.3g}"
    if frac:
        assert worst <= flip_err, f"{what}: worst error {worst:.3g} of max|ref| > {flip_err}"


def tolerance(quant: AttentionQuant | None, dtype: torch.dtype) -> dict[str, float]:
    """Tolerances of one case: rounding of the output dtype; P code flips when P is quantized."""
    p_quantized = quant is not None and not quant.p.is_identity
    if dtype == torch.float32:
        tol = {"rtol": 2e-5, "atol": 2e-5}
    elif dtype == torch.bfloat16:  # bf16 output rounding (8 significant bits)
        tol = {"rtol": 1e-2, "atol": 5e-3}
    else:  # fp16 output rounding; unquantized P rounds to fp16 for the PV dot
        tol = {"rtol": 4e-3, "atol": 2e-3}
    if p_quantized:  # one code of P̂ moves one row's output by at most ~ V / 3
        tol.update(flips=0.005, flip_err=0.35)
    return tol


def assert_lse(lse: torch.Tensor, ref: torch.Tensor, atol: float = 1e-4) -> None:
    """Natural-log LSE ``[H, T]``: -inf exactly where the oracle has it, else close."""
    assert lse.dtype == torch.float32 and lse.shape == ref.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref.float()))
    finite = torch.isfinite(ref)
    assert torch.allclose(lse[finite].double(), ref[finite].double(), atol=atol, rtol=1e-5)


def run_both(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    scale: float,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    config = kwargs.pop("config", None)
    out, lse = prefill(
        q, k, v, cu_q, cu_k, softmax_scale=scale, return_lse=True, config=config, **kwargs
    )  # type: ignore[arg-type]
    ref, ref_lse = mla_reference.prefill(
        q, k, v, cu_q, cu_k, softmax_scale=scale, return_lse=True, **kwargs
    )  # type: ignore[arg-type]
    return out, lse, ref, ref_lse


# -- the quantization matrix: every recipe, causal and not, varlen + GQA ----------

# lengths 1, 15, 16, 17 and a few hundred; keys longer than queries for some
# sequences (suffix alignment), equal for others
LENS_Q = [1, 15, 16, 17, 240]
LENS_K = [1, 20, 16, 49, 240]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", list(QUANTS))
def test_quant_matrix_64_32(name: str, causal: bool) -> None:
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch(LENS_Q, LENS_K, 2, 1, 64, 32, seed=1)
    config = PrefillConfig(block_m=64, block_n=64)
    out, lse, ref, ref_lse = run_both(
        q, k, v, cu_q, cu_k, scale, causal=causal, quant=quant, config=config
    )
    assert_matches(out, ref, **tolerance(quant, q.dtype), what=name)
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", ["none", "fp8", "nvfp4", "nvfp4-amax"])
def test_deepseek_dims_192_128(name: str, causal: bool) -> None:
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch([1, 17, 40], [1, 20, 70], 2, 1, 192, 128, seed=2)
    config = PrefillConfig(block_m=16, block_n=16)
    out, lse, ref, ref_lse = run_both(
        q, k, v, cu_q, cu_k, scale, causal=causal, quant=quant, config=config
    )
    assert_matches(out, ref, **tolerance(quant, q.dtype), what=name)
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("name", ["none", "nvfp4"])
def test_absorbed_dims_576_512(name: str) -> None:
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch([3, 20], [10, 33], 2, 1, 576, 512, seed=3)
    out, lse, ref, ref_lse = run_both(q, k, v, cu_q, cu_k, scale, causal=True, quant=quant)
    assert_matches(out, ref, **tolerance(quant, q.dtype), what=name)
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("dims", [(80, 48), (208, 16)], ids=["80-48", "208-16"])
def test_padded_head_dims(dims: tuple[int, int]) -> None:
    """Head dims whose remainder or value dim is not a power of two (zero-padded tiles)."""
    quant = QUANTS["nvfp4"]
    q, k, v, cu_q, cu_k, scale = make_batch([5, 33], [5, 40], 2, 2, *dims, seed=4)
    out, lse, ref, ref_lse = run_both(q, k, v, cu_q, cu_k, scale, causal=True, quant=quant)
    assert_matches(out, ref, **tolerance(quant, q.dtype))
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["none", "nvfp4", "fp8"])
def test_16_bit_inputs(name: str, dtype: torch.dtype) -> None:
    """bf16: computed in float32 under the interpreter, the output rounded to bf16."""
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch([7, 16, 70], [7, 30, 70], 4, 1, 64, 32, dtype=dtype)
    for causal in (True, False):
        out, lse, ref, ref_lse = run_both(q, k, v, cu_q, cu_k, scale, causal=causal, quant=quant)
        assert out.dtype == dtype
        assert_matches(out, ref, **tolerance(quant, q.dtype), what=f"{name} causal={causal}")
        assert_lse(lse, ref_lse, atol=2e-3)
    # into a strided buffer
    big = torch.zeros(q.shape[0], 6, 40, dtype=dtype)
    got = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, out=big[:, 1:5, 4:36])
    assert got.data_ptr() == big[:, 1:5, 4:36].data_ptr()
    assert torch.equal(got, prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant))
    assert bool((big[:, 0] == 0).all()) and bool((big[:, :, :4] == 0).all())


def test_tolerances_reject_common_mistakes() -> None:
    """The comparison above fails for a wrong block origin, a wrong axis or a wrong scale."""
    quant = QUANTS["nvfp4"]
    q, k, v, cu_q, cu_k, scale = make_batch([15, 17, 60], [20, 49, 60], 2, 1, 64, 32, seed=13)
    out = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant)
    tol = tolerance(quant, q.dtype)
    ref = mla_reference.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant)
    assert_matches(out, ref, **tol)
    pre_v = AttentionQuant(q="nvfp4", k="nvfp4", p="nvfp4")  # V passed in already QDQ'd
    wrong_v = {
        "V blocks from the packed tensor's origin": qdq(v, "nvfp4", axis=0, pad=True),
        "V blocked along the head dim": qdq(v, "nvfp4", axis=-1),
    }
    for what, v_hat in wrong_v.items():
        bad = mla_reference.prefill(q, k, v_hat, cu_q, cu_k, softmax_scale=scale, quant=pre_v)
        with pytest.raises(AssertionError):
            assert_matches(out, bad, **tol, what=what)
    unit_q = AttentionQuant(q=OperandQuant("nvfp4", 2688.0), k="nvfp4", p="nvfp4", v="nvfp4")
    bad = mla_reference.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=unit_q)
    with pytest.raises(AssertionError):
        assert_matches(out, bad, **tol, what="Q's dynamic global scale left out")


# -- N:M sparsity ----------------------------------------------------------------

SPARSITIES = {
    "2:4": NMSparsity(2, 4),
    "2:4-windows": NMSparsity(2, 4, dense_sink_tokens=5, dense_recent_tokens=7),
    "3:8-windows": NMSparsity(3, 8, dense_sink_tokens=16, dense_recent_tokens=3),
    "1:4-recent": NMSparsity(1, 4, dense_recent_tokens=20),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("quant_name", ["none", "nvfp4"])
@pytest.mark.parametrize("sparsity_name", list(SPARSITIES))
def test_nm_sparsity(sparsity_name: str, quant_name: str, causal: bool) -> None:
    quant = QUANTS[quant_name]
    # a single-query sequence (never sparsified) and suffix-aligned queries
    q, k, v, cu_q, cu_k, scale = make_batch([1, 19, 64], [9, 40, 100], 2, 1, 64, 32, seed=6)
    config = PrefillConfig(block_m=32, block_n=32)
    out, lse, ref, ref_lse = run_both(
        q, k, v, cu_q, cu_k, scale, causal=causal, quant=quant,
        sparsity=SPARSITIES[sparsity_name], config=config,
    )  # fmt: skip
    assert_matches(out, ref, **tolerance(quant, q.dtype), what=sparsity_name)
    assert_lse(lse, ref_lse)


def _one_hot_values(length: int) -> torch.Tensor:
    """V = identity: the output row is then P̂ / l, the kept keys made visible."""
    return torch.eye(length).reshape(length, 1, length)


@pytest.mark.parametrize("m", [4, 8])
def test_nm_keeps_exactly_n_with_ties(m: int) -> None:
    """Every group with n or more visible keys and no dense key keeps exactly n; ties
    (duplicated keys) go to the lower index."""
    n, length = m // 2, 64
    g = torch.Generator().manual_seed(7)
    q = torch.randn(length, 1, 32, generator=g)
    k = torch.randn(length, 1, 32, generator=g)
    k[1::4] = k[0::4]  # exact score ties within every group
    k[10] = k[8]
    v = _one_hot_values(length)
    cu = torch.tensor([0, length], dtype=torch.int32)
    sparsity = NMSparsity(n, m, dense_recent_tokens=1)  # the diagonal stays dense
    out = prefill(q, k, v, cu, cu, softmax_scale=0.3, causal=True, sparsity=sparsity)
    ref = mla_reference.prefill(q, k, v, cu, cu, softmax_scale=0.3, causal=True, sparsity=sparsity)
    assert_matches(out, ref, rtol=1e-5, atol=1e-6)
    kept = out[:, 0, :] > 0  # [query, key]
    for i in range(length):
        for g0 in range(0, i - i % m, m):  # whole groups before the diagonal's group
            group = kept[i, g0 : g0 + m]
            assert int(group.sum()) == n, (i, g0)
            # k[g0] == k[g0 + 1]: of the tied pair, the lower index is kept first
            assert bool(group[0]) or not bool(group[1]), (i, g0)


# -- LSE, empty rows, out=, max_seqlen, placement, tiles --------------------------


def test_empty_key_ranges_give_zero_and_neg_inf() -> None:
    # sequence 0 has no keys (non-causal context chunk); sequence 1 has more queries
    # than keys, so under suffix alignment its first queries see nothing
    q, k, v, cu_q, cu_k, scale = make_batch([3, 6], [0, 2], 2, 2, 32, 16, seed=8)
    for causal in (False, True):
        out, lse, ref, ref_lse = run_both(q, k, v, cu_q, cu_k, scale, causal=causal)
        assert torch.equal(out[:3], torch.zeros_like(out[:3]))
        assert bool(torch.isneginf(lse[:, :3]).all())
        assert_matches(out, ref, rtol=1e-5, atol=1e-5)
        assert_lse(lse, ref_lse)
    out, lse = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, causal=True, return_lse=True)
    assert bool(torch.isneginf(lse[:, 3:7]).all()) and bool(torch.isfinite(lse[:, 7:]).all())


def test_out_buffer_slice_and_max_seqlen() -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([5, 21], [9, 40], 4, 2, 64, 32, seed=9)
    quant = QUANTS["nvfp4"]
    want = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant)
    big = torch.full((q.shape[0], 6, 48), 7.0)
    view = big[:, 1:5, 8:40]  # strided: not contiguous in heads or tokens
    got = prefill(
        q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, out=view,
        max_seqlen_q=21, max_seqlen_k=40,
    )  # fmt: skip
    assert got.data_ptr() == view.data_ptr()
    assert torch.equal(view, want)
    untouched = big.clone()
    untouched[:, 1:5, 8:40] = 7.0
    assert bool((untouched == 7.0).all())


def test_kv_prepass_and_fused_give_the_same_numbers() -> None:
    """One query tile per sequence and no GQA: K/V QDQ fused into the attention kernel;
    an overstated max_seqlen_q (more query tiles, the extra ones idle) takes the pass."""
    q, k, v, cu_q, cu_k, scale = make_batch([5, 30], [9, 40], 2, 2, 64, 32, seed=10)
    for name in ("nvfp4", "nvfp4-amax", "fp8-amax"):
        kw = {"softmax_scale": scale, "quant": QUANTS[name], "max_seqlen_k": 40}
        fused = prefill(q, k, v, cu_q, cu_k, **kw, max_seqlen_q=30)  # type: ignore[arg-type]
        pass_ = prefill(q, k, v, cu_q, cu_k, **kw, max_seqlen_q=100)  # type: ignore[arg-type]
        assert torch.equal(fused, pass_), name
        ref = mla_reference.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS[name])
        assert_matches(fused, ref, **tolerance(QUANTS[name], q.dtype), what=name)


@pytest.mark.parametrize("sparsity", [None, NMSparsity(2, 4, dense_sink_tokens=4)])
def test_tile_invariance(sparsity: NMSparsity | None) -> None:
    """Two tilings agree within the bound of docs/numerics.md "Softmax, P and schedule
    invariance" (P codes may flip only at ties)."""
    quant = QUANTS["nvfp4"]
    q, k, v, cu_q, cu_k, scale = make_batch([17, 100], [40, 100], 2, 1, 64, 32, seed=11)
    outs = []
    for bm, bn in ((16, 16), (64, 32)):
        config = PrefillConfig(block_m=bm, block_n=bn)
        outs.append(
            prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, sparsity=sparsity,
                    config=config)
        )  # fmt: skip
    assert_matches(outs[0], outs[1], rtol=1e-5, atol=1e-6, flips=0.005, flip_err=0.35)


# -- validation ----------------------------------------------------------------------


def _valid() -> dict[str, object]:
    q, k, v, cu_q, cu_k, scale = make_batch([4, 5], [4, 6], 2, 1, 32, 16)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
            "softmax_scale": scale}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"q": "not a tensor"}, "q"),
        ({"q": torch.zeros(9, 2)}, "q"),
        ({"q": torch.zeros(9, 2, 32, dtype=torch.float64)}, "q"),
        ({"q": torch.zeros(9, 2, 24)}, "q"),
        ({"q": torch.zeros(9, 2, 640)}, "q"),
        ({"k": torch.zeros(10, 1, 32, dtype=torch.float16)}, "k"),
        ({"k": torch.zeros(10, 1, 48)}, "k"),
        ({"k": torch.zeros(10, 3, 32), "v": torch.zeros(10, 3, 16)}, "k"),
        ({"v": torch.zeros(10, 1, 40)}, "v"),
        ({"v": torch.zeros(10, 1, 32)[:, :, ::2]}, "v"),
        ({"cu_seqlens_q": torch.tensor([0, 4, 9], dtype=torch.float32)}, "cu_seqlens_q"),
        ({"cu_seqlens_q": torch.tensor([0, 4, 8], dtype=torch.int32)}, "cu_seqlens_q"),
        ({"cu_seqlens_q": torch.tensor([0, 10, 9], dtype=torch.int32)}, "cu_seqlens_q"),
        ({"cu_seqlens_k": torch.tensor([1, 4, 10], dtype=torch.int32)}, "cu_seqlens_k"),
        ({"cu_seqlens_k": torch.tensor([0, 10], dtype=torch.int32)}, "cu_seqlens_k"),
        ({"softmax_scale": -1.0}, "softmax_scale"),
        ({"softmax_scale": float("nan")}, "softmax_scale"),
        ({"causal": 1}, "causal"),
        ({"quant": "nvfp4"}, "quant"),
        ({"sparsity": (2, 4)}, "sparsity"),
        ({"sparsity": NMSparsity(2, 32), "config": PrefillConfig(16, 16)}, "sparsity"),
        ({"out": torch.zeros(9, 2, 8)}, "out"),
        ({"out": torch.zeros(9, 2, 16, dtype=torch.float16)}, "out"),
        ({"max_seqlen_q": -1, "max_seqlen_k": 6}, "max_seqlen_q"),
        ({"max_seqlen_q": 4}, "max_seqlen_q"),  # understated, offsets checked
        ({"max_seqlen_k": 5}, "max_seqlen_k"),
        ({"max_seqlen_k": True, "max_seqlen_q": 5}, "max_seqlen_k"),
        (
            {
                "cu_seqlens_q": torch.zeros(1, dtype=torch.int32),
                "cu_seqlens_k": torch.zeros(1, dtype=torch.int32),
            },
            "cu_seqlens_q",
        ),  # B = 0, T = 9
        ({"cu_seqlens_q": torch.zeros(0, dtype=torch.int32)}, "cu_seqlens_q"),
        ({"return_lse": "yes"}, "return_lse"),
    ],
)
def test_validation_names_the_argument(change: dict[str, object], argument: str) -> None:
    kwargs = _valid() | change
    with pytest.raises(ValueError, match=f"^{argument}"):
        prefill(**kwargs)  # type: ignore[arg-type]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"^config\.block_m"):
        PrefillConfig(block_m=24, block_n=16)
    with pytest.raises(ValueError, match=r"^config\.num_warps"):
        PrefillConfig(block_m=16, block_n=16, num_warps=3)
    for stages in (0, 5, 2.0):
        with pytest.raises(ValueError, match=r"^config\.num_stages"):
            PrefillConfig(block_m=16, block_n=16, num_stages=stages)  # type: ignore[arg-type]
    # m = 16 divides block_n = 16
    kwargs = _valid() | {"sparsity": NMSparsity(2, 16), "config": PrefillConfig(16, 16)}
    prefill(**kwargs)  # type: ignore[arg-type]


def test_p_amax_below_one_is_refused_by_mla_formats() -> None:
    """One rule in one place: ``AttentionQuant`` refuses it, so prefill never sees it."""
    with pytest.raises(ValueError, match=r"^p: a static amax below 1"):
        AttentionQuant(p=OperandQuant("nvfp4", 0.75))
    q, k, v, cu_q, cu_k, scale = make_batch([4, 5], [4, 6], 2, 1, 32, 16)
    quant = AttentionQuant(p=OperandQuant("nvfp4", 1.0))  # the limit itself is accepted
    out, lse, ref, ref_lse = run_both(q, k, v, cu_q, cu_k, scale, quant=quant)
    assert_matches(out, ref, **tolerance(quant, q.dtype))
    assert_lse(lse, ref_lse)


# -- B = 0, max_seqlen -------------------------------------------------------------------


def test_empty_batch() -> None:
    """``cu_seqlens = [0]``: no sequences, empty outputs (checked offsets or not)."""
    cu = torch.zeros(1, dtype=torch.int32)
    q, k, v = torch.zeros(0, 4, 32), torch.zeros(0, 2, 32), torch.zeros(0, 2, 16)
    for max_seqlen in (None, 0):
        out, lse = prefill(
            q, k, v, cu, cu, softmax_scale=0.2, quant=QUANTS["nvfp4"], return_lse=True,
            max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        )  # fmt: skip
        assert out.shape == (0, 4, 16) and lse.shape == (4, 0) and lse.dtype == torch.float32
    ref, ref_lse = mla_reference.prefill(q, k, v, cu, cu, softmax_scale=0.2, return_lse=True)
    assert ref.shape == out.shape and ref_lse.shape == lse.shape


@pytest.mark.parametrize("name", ["none", "nvfp4", "fp8-amax"])
def test_understated_max_seqlen_k_is_still_right(name: str) -> None:
    """Unchecked (both maxima given): ``max_seqlen_k`` only sizes the K/V pass's launch,
    whose programs stride over every key, so any value gives the same output."""
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch([20, 70], [45, 100], 2, 1, 32, 16, seed=15)
    want = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant)
    ref = mla_reference.prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant)
    assert_matches(want, ref, **tolerance(quant, q.dtype), what=name)
    for max_k in (0, 1, 31, 33, 500):
        got = prefill(
            q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, max_seqlen_q=70,
            max_seqlen_k=max_k,
        )  # fmt: skip
        assert torch.equal(got, want), (name, max_k)
    with pytest.raises(ValueError, match=r"^max_seqlen_k: 99 is less than the longest"):
        prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, max_seqlen_k=99)


def test_quantize_kv_covers_every_key() -> None:
    """The pass on its own, launched for 1 token per sequence: every key still QDQ'd."""
    from mla_triton.ops.prefill.core import quantize_kv

    _, k, v, _, cu_k, _ = make_batch([1, 1], [40, 70], 1, 2, 32, 16, seed=16)
    quant = AttentionQuant(q="nvfp4", k=OperandQuant("nvfp4", "dynamic"), p="nvfp4", v="nvfp4")
    k_hat, v_hat, k_scales = quantize_kv(k, v, cu_k, quant, max_seqlen_k=1)
    want_k, want_ks = qdq_factored(k, "nvfp4", amax="dynamic")
    assert torch.equal(k_hat, want_k) and torch.equal(k_scales, want_ks.reshape(k_scales.shape))
    for a, b in ((0, 40), (40, 110)):
        want_v, _ = qdq_factored(v[a:b], "nvfp4", axis=0, pad=True)
        assert torch.equal(v_hat[a:b], want_v)


# -- the NaN rule (docs/numerics.md) ---------------------------------------------------

# (operand, sequence, token in the sequence, head, feature): q's head is a query head,
# k's and v's a KV head. Sequence 0 has 5 queries over 9 keys (suffix-aligned), sequence
# 1 40 over 40, sequence 2 12 over 20 (only a q site: the rest of it stays clean when not
# causal). With 16-query x 32-key tiles, v's key 20 of sequence 1 lies in the causal
# diagonal tile of queries 0-15, which load it without seeing it.
NAN_SITES = [("q", 1, 3, 1, 5), ("k", 1, 27, 0, 17), ("v", 1, 20, 0, 2), ("q", 0, 2, 0, 0),
             ("v", 0, 8, 0, 9), ("q", 2, 4, 0, 31)]  # fmt: skip
NAN, INF = float("nan"), float("inf")
NAN_PATTERNS = {
    "nan-inf-neginf": (NAN, INF, -INF, INF, NAN, -INF),
    "inf-neginf-nan": (INF, -INF, NAN, NAN, -INF, NAN),
    "negnan": (-NAN, -NAN, -NAN, INF, NAN, -INF),  # sign bit set: N:M must still keep it
}
NAN_QUANTS = {**{n: (QUANTS[n], None) for n in ("none", "fp8", "nvfp4", "nvfp4-amax")},
              "none+2:4": (None, NMSparsity(2, 4)),
              "nvfp4+2:4": (QUANTS["nvfp4"], NMSparsity(2, 4))}  # fmt: skip


def _rule_rows(
    sites: list[tuple[str, int, int, int, int]],
    quant: AttentionQuant | None,
    lens_q: list[int],
    lens_k: list[int],
    heads: int,
    kv_heads: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The NaN rule, from the sites alone: bool ``[T, H]`` rows whose out is NaN, and
    ``[T, H]`` rows whose LSE is NaN. A non-finite q̂ / k̂ element poisons its own row of
    features whatever the format (element, nvfp4 block or dynamic row: all in the row);
    one of v̂ (blocked along the tokens) poisons every key of its nvfp4 block of 16."""
    v_nvfp4 = quant is not None and quant.v.format.name == "nvfp4"
    out_nan = torch.zeros(sum(lens_q), heads, dtype=torch.bool)
    lse_nan = torch.zeros_like(out_nan)
    group = heads // kv_heads
    q0 = [sum(lens_q[:b]) for b in range(len(lens_q))]
    for operand, b, tok, head, _ in sites:
        for i in range(lens_q[b]):
            q_pos = lens_k[b] - lens_q[b] + i
            limit = q_pos if causal else lens_k[b] - 1
            if limit < 0:
                continue  # a row without a visible key: out 0, LSE -inf
            if operand == "q":
                seen = i == tok
            elif operand == "k":
                seen = tok <= limit
            else:
                first = tok // 16 * 16 if v_nvfp4 else tok
                seen = first <= limit
            hs = [head] if operand == "q" else range(head * group, (head + 1) * group)
            for h in hs if seen else []:
                out_nan[q0[b] + i, h] = True
                lse_nan[q0[b] + i, h] |= operand != "v"
    return out_nan, lse_nan


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(
    ("name", "pattern"),
    [(n, p) for n in NAN_QUANTS for p in NAN_PATTERNS if p != "negnan" or "2:4" in n],
)
def test_nan_rule(name: str, causal: bool, pattern: str) -> None:
    """Exactly the rows the rule names are NaN (out all features; LSE for q̂ / k̂); every
    other row is finite and matches the oracle."""
    quant, sparsity = NAN_QUANTS[name]
    lens_q, lens_k, heads, kv_heads = [5, 40, 12], [9, 40, 20], 2, 1
    q, k, v, cu_q, cu_k, scale = make_batch(lens_q, lens_k, heads, kv_heads, 32, 16, seed=17)
    tensors, starts = {"q": q, "k": k, "v": v}, {"q": cu_q, "k": cu_k, "v": cu_k}
    for (operand, b, tok, head, feat), value in zip(NAN_SITES, NAN_PATTERNS[pattern], strict=True):
        tensors[operand][int(starts[operand][b]) + tok, head, feat] = value
    config = PrefillConfig(block_m=16, block_n=32)
    out, lse, ref, ref_lse = run_both(
        q, k, v, cu_q, cu_k, scale, causal=causal, quant=quant, sparsity=sparsity, config=config
    )
    out_nan, lse_nan = _rule_rows(NAN_SITES, quant, lens_q, lens_k, heads, kv_heads, causal)
    assert 0 < int(out_nan.sum()) < out_nan.numel()
    assert torch.equal(out.isnan().all(-1), out_nan), "rows that are NaN"
    assert bool(out[~out_nan].isfinite().all()), "the other rows are finite"
    assert torch.equal(lse.isnan().T, lse_nan), "LSE rows that are NaN"
    assert torch.equal(ref.isnan().all(-1), out_nan), "the oracle follows the same rule"
    clean = ~out_nan
    assert_matches(out[clean], ref[clean], **tolerance(quant, q.dtype), what=name)
    keep = ~lse_nan.T
    assert_lse(lse[keep], ref_lse[keep])


# -- property: any drawn call is refused before a launch, or matches the oracle --------

FORMATS = ("none", "fp8", "nvfp4")
# an invalid change of one argument, given the case: (argument, change)
MUTATIONS = ("softmax_scale", "cu_seqlens_q", "cu_seqlens_k", "q", "k", "v", "out",
             "max_seqlen_q", "max_seqlen_k", "sparsity", "causal", "quant")  # fmt: skip


@st.composite
def _operand(draw: st.DrawFn, role: str) -> OperandQuant | None:
    fmt = draw(st.sampled_from(FORMATS))
    if fmt == "none":
        return None
    choices: list[Any] = [None, draw(st.floats(0.5, 50.0))]
    if role in ("q", "k"):
        choices.append("dynamic")
    if role == "p":  # below 1 is refused by AttentionQuant (not drawn: see the test above)
        choices[1] = draw(st.floats(1.0, 4.0))
    amax = draw(st.sampled_from(choices))
    return OperandQuant(fmt) if amax is None else OperandQuant(fmt, amax)


def _packed(
    g: torch.Generator, tokens: int, heads: int, dim: int, dtype: torch.dtype, layout: str
) -> torch.Tensor:
    """A ``[tokens, heads, dim]`` tensor, contiguous or a strided view of a larger one."""
    if layout == "heads-strided":
        return torch.randn(tokens, heads + 1, dim + 16, generator=g)[:, 1:, 16:].to(dtype)
    if layout == "tokens-strided":
        return torch.randn(2 * tokens, heads, dim, generator=g)[::2].to(dtype)
    return torch.randn(tokens, heads, dim, generator=g).to(dtype)


@st.composite
def _cases(draw: st.DrawFn, mutation: str | None) -> tuple[dict[str, Any], str | None]:
    """Keyword arguments of one ``prefill`` call, with an invalid change of the argument
    ``mutation``; returns that name, or None when there was nothing to break."""
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    kv_heads, group = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    dim, dim_v = draw(st.sampled_from([16, 32, 48])), draw(st.sampled_from([16, 32]))
    batch = draw(st.sampled_from([1, 2, 3, 0]))
    lens_q = draw(st.lists(st.integers(0, 20), min_size=batch, max_size=batch))
    lens_k = draw(st.lists(st.integers(0, 24), min_size=batch, max_size=batch))
    layout = draw(st.sampled_from(["contiguous", "heads-strided", "tokens-strided"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    cu_q = torch.tensor([0, *itertools_accumulate(lens_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools_accumulate(lens_k)], dtype=torch.int64)
    kwargs: dict[str, Any] = {
        "q": _packed(g, sum(lens_q), kv_heads * group, dim, dtype, layout),
        "k": _packed(g, sum(lens_k), kv_heads, dim, dtype, layout),
        "v": _packed(g, sum(lens_k), kv_heads, dim_v, dtype, layout),
        "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
        "softmax_scale": draw(st.floats(0.05, 1.0)), "causal": draw(st.booleans()),
        "quant": AttentionQuant(**{r: draw(_operand(r)) for r in "qkpv"}),
        "sparsity": draw(st.sampled_from([None, NMSparsity(2, 4), NMSparsity(1, 4, 3, 2)])),
        "config": draw(st.sampled_from([None, PrefillConfig(16, 16), PrefillConfig(32, 16)])),
    }  # fmt: skip
    longest_q, longest_k = max(lens_q, default=0), max(lens_k, default=0)
    if draw(st.booleans()):  # given (exact or overstated): no offsets check
        kwargs["max_seqlen_q"] = longest_q + draw(st.sampled_from([0, 5]))
        kwargs["max_seqlen_k"] = longest_k + draw(st.sampled_from([0, 7]))
    tokens, heads = sum(lens_q), kv_heads * group
    change: dict[str, Any] = {
        "softmax_scale": {"softmax_scale": draw(st.sampled_from([0.0, -1.0, math.inf, "1"]))},
        "cu_seqlens_q": {"cu_seqlens_q": cu_q.float(), "max_seqlen_q": None},
        "cu_seqlens_k": {"cu_seqlens_k": cu_k + 1, "max_seqlen_k": None},
        "q": {"q": kwargs["q"].double()},
        "k": {"k": kwargs["k"].to(torch.float16 if dtype != torch.float16 else torch.float32)},
        "v": {"v": torch.zeros(sum(lens_k), kv_heads, dim_v + 8, dtype=dtype)},
        "out": {"out": torch.zeros(tokens, heads, dim_v + 16, dtype=dtype)},
        "max_seqlen_q": {"max_seqlen_q": -1},
        "max_seqlen_k": {"max_seqlen_k": longest_k - 1, "max_seqlen_q": None},
        "sparsity": {"sparsity": NMSparsity(2, 32), "config": PrefillConfig(16, 16)},
        "causal": {"causal": 1},
        "quant": {"quant": "nvfp4"},
    }.get(mutation or "", {})
    if mutation == "max_seqlen_k" and longest_k == 0:
        change, mutation = {}, None  # nothing to understate
    return kwargs | change, mutation


def itertools_accumulate(values: list[int]) -> list[int]:
    out, total = [], 0
    for x in values:
        total += x
        out.append(total)
    return out


def _spied_prefill(kwargs: dict[str, Any]) -> tuple[Any, list[str]]:
    """``prefill(**kwargs, return_lse=True)`` (or the ValueError it raised), and the
    names of the kernels it launched (each launch runs)."""
    launches: list[str] = []

    def spy(run: Any, kernel: Any, args: Any, kw: dict[str, Any], grid: Any) -> Any:
        launches.append(kernel.fn.__name__)
        return run(kernel, *args, grid=grid, warmup=False, **kw)

    with intercept(spy):
        try:
            return prefill(**kwargs, return_lse=True), launches
        except ValueError as error:
            return error, launches


@pytest.mark.parametrize("argument", MUTATIONS)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(data=st.data())
def test_property_bad_arguments_are_refused_before_a_launch(
    argument: str, data: st.DataObject
) -> None:
    kwargs, mutation = data.draw(_cases(argument))
    event(f"refused: {mutation}")
    result, launches = _spied_prefill(kwargs)
    if mutation is None:  # nothing to break in this case
        assert not isinstance(result, ValueError), result
        return
    assert isinstance(result, ValueError), (mutation, result)
    assert str(result).startswith(mutation), (mutation, str(result))
    assert not launches, (mutation, launches)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter
@settings(max_examples=15, deadline=None, derandomize=True)
@given(_cases(None))
def test_property_valid_calls_match_the_oracle(case: tuple[dict[str, Any], str | None]) -> None:
    kwargs, _ = case
    event(f"compared: {kwargs['q'].dtype}, {kwargs['cu_seqlens_q'].numel() - 1} sequences")
    result, launches = _spied_prefill(kwargs)
    assert not isinstance(result, ValueError), result
    out, lse = result
    kwargs = {
        n: x for n, x in kwargs.items() if n not in ("config", "max_seqlen_q", "max_seqlen_k")
    }
    ref, ref_lse = mla_reference.prefill(**kwargs, return_lse=True)
    quant, q = kwargs["quant"], kwargs["q"]
    assert bool(launches) == (out.numel() > 0 and not bool((lse == -math.inf).all()))
    tol = tolerance(quant, q.dtype)
    if "flips" in tol and out.numel():  # one P code moves one row: allow one row
        tol["flips"] = max(tol["flips"], 1.01 * out.shape[2] / out.numel())
    assert out.dtype == q.dtype and out.shape == ref.shape
    assert_matches(out, ref, **tol)
    assert_lse(lse, ref_lse, atol=2e-3 if q.dtype != torch.float32 else 1e-4)


# -- the fast P QDQ device functions -------------------------------------------------


@triton.jit
def _e2m1_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, dev.e2m1_round_nonneg(tl.load(x_ptr + offs)))


@triton.jit
def _p_kernel(x_ptr, y_ptr, gs, inv, ROWS: tl.constexpr, COLS: tl.constexpr, FP8: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offs)
    if FP8:  # noqa: SIM108
        y = dev.fp8_qdq_p(x, inv, False)
    else:
        y = dev.nvfp4_qdq_p(x, gs, inv, ROWS, COLS, False)
    tl.store(y_ptr + offs, y)


def test_e2m1_round_nonneg_matches_reference() -> None:
    # every multiple of 2^-8 in [0, 8] (all midpoints and ties) plus random values
    x = torch.cat([torch.arange(0, 2049) / 256.0, torch.rand(2047) * 7.0])
    y = torch.empty_like(x)
    _e2m1_kernel[(1,)](x, y, x.numel())
    assert torch.equal(y, e2m1_round(x))


def test_nvfp4_p_fast_path_matches_reference() -> None:
    # ties: global scale 1 and block maxima 6 * sb make every midpoint exact
    rows, cols = 16, 64
    sb = torch.exp2(torch.randint(-9, 0, (rows, cols // 16))).repeat_interleave(16, 1)
    codes = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]).repeat(rows, cols // 8)
    x = (codes * sb).contiguous()
    y = torch.empty_like(x)
    _p_kernel[(1,)](x, y, 1.0, 1.0 / 6.0, rows, cols, False)
    assert torch.equal(y, qdq_factored(x, "nvfp4", amax=2688.0)[0])
    # P-like values at P's default amax 1: allow a rare one-ulp reciprocal difference
    x = torch.exp2(-torch.rand(64, 64) * 12.0)
    x[3, :16] = 0.0
    y = torch.empty_like(x)
    gs = float(torch.tensor(1.0) / 2688.0)
    _p_kernel[(1,)](x, y, gs, 1.0 / (6.0 * gs), 64, 64, False)
    want = qdq_factored(x, "nvfp4", amax=1.0)[0]
    assert (y != want).double().mean().item() < 1e-3


def test_fp8_p_fast_path_matches_reference() -> None:
    x = torch.exp2(-torch.rand(16, 64) * 20.0)
    y = torch.empty_like(x)
    _p_kernel[(1,)](x, y, 1.0, 448.0, 16, 64, True)
    want = qdq_factored(x, "fp8", amax=1.0)[0]
    assert (y != want).double().mean().item() < 1e-3


def vouched_outside(
    lens_q: list[int], lens_k: list[int], shift: int, seq: int, over_q: int, over_k: int,
) -> tuple[list[int], list[int]]:  # fmt: skip
    """Offsets of ``lens_*`` with sequence ``seq``'s end moved ``over_*`` rows on (the
    later offsets with it), and every offset ``shift`` rows back (a negative start)."""
    cu_q, cu_k = [0], [0]
    for i, (a, b) in enumerate(zip(lens_q, lens_k, strict=True)):
        cu_q.append(cu_q[-1] + a + (over_q if i == seq else 0))
        cu_k.append(cu_k[-1] + b + (over_k if i == seq else 0))
    return [x - shift for x in cu_q], [x - shift for x in cu_k]


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 24)), min_size=1, max_size=3),
    seq=st.integers(0, 2),
    over=st.sampled_from([(0, 0), (5, 0), (0, 9), (40, 40), (1, 1)]),
    shift=st.sampled_from([0, 0, 3]),
    quant=st.sampled_from(["none", "nvfp4", "fp8-amax"]),
    causal=st.booleans(),
)
def test_vouched_offsets_never_leave_the_tensors(
    lens: list[tuple[int, int]], seq: int, over: tuple[int, int], shift: int, quant: str,
    causal: bool,
) -> None:  # fmt: skip
    """Offsets the caller vouches for (both maxima given, no checks) that run past the
    tensors' rows or start before them: the sequences inside are computed as checked,
    each sequence that leaves gets NaN in the output rows (and LSE) it holds inside the
    tensors, and nothing around ``out`` is written (docs/numerics.md "Vouched offsets")."""
    lens_q, lens_k = [a for a, _ in lens], [b for _, b in lens]
    seq %= len(lens)
    q, k, v, _, _, scale = make_batch(lens_q, lens_k, 2, 1, 32, 16, seed=len(lens) + seq)
    bad_q, bad_k = vouched_outside(lens_q, lens_k, shift, seq, *over)
    tokens, tokens_k = q.shape[0], k.shape[0]
    big = torch.full((tokens + 4, 4, 24), 7.0)
    out = big[2 : 2 + tokens, 1:3, 4:20]
    kw: dict[str, Any] = {"softmax_scale": scale, "quant": QUANTS[quant], "causal": causal}
    vouched = {"max_seqlen_q": max(lens_q) + over[0], "max_seqlen_k": max(lens_k) + over[1]}
    cq, ck = (torch.tensor(x, dtype=torch.int32) for x in (bad_q, bad_k))
    _, lse = prefill(q, k, v, cq, ck, return_lse=True, out=out, **kw, **vouched)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[2 : 2 + tokens, 1:3, 4:20] = False
    assert torch.all(big[outside] == 7.0), "prefill wrote outside out"
    for i in range(len(lens)):
        a = max(bad_q[i], 0)
        b = max(min(bad_q[i + 1], tokens), a)
        left = bad_q[i] < 0 or bad_q[i + 1] > tokens or bad_k[i] < 0 or bad_k[i + 1] > tokens_k
        if left:
            assert out[a:b].isnan().all() and lse[:, a:b].isnan().all(), (i, a, b)
            continue
        ka, kb = bad_k[i], bad_k[i + 1]  # the sequence alone, offsets checked
        cu_one, cu_one_k = (torch.tensor([0, n], dtype=torch.int32) for n in (b - a, kb - ka))
        want, want_lse = prefill(
            q[a:b], k[ka:kb], v[ka:kb], cu_one, cu_one_k, return_lse=True, **kw
        )  # fmt: skip
        assert torch.equal(out[a:b], want) and torch.equal(lse[:, a:b], want_lse), i
    event(f"{sum(1 for x in bad_q if x > tokens or x < 0)} q offsets outside")
