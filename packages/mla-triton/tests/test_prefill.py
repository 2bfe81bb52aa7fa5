"""``mla_triton.prefill`` against the oracle ``mla_reference.prefill`` (CPU, interpreter).

Run with ``TRITON_INTERPRET=1``; inputs are float32 or float16 (the interpreter
computes bf16 wrongly). Comparisons are elementwise with tight tolerances; where
quantized P can legitimately differ from the oracle by one code (a value within
an ulp of an E2M1/E4M3 rounding midpoint, since exp2 rounds differently), a small
fraction of elements may exceed them, each by a bounded amount ("flips"). A
wrong axis, block origin or scale moves most elements and fails.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl

import mla_reference
from mla_formats import AttentionQuant, NMSparsity, OperandQuant, e2m1_round, qdq, qdq_factored
from mla_triton import prefill
from mla_triton import qdq_device as dev
from mla_triton.prefill import PrefillConfig

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
    """Also the pipelined loop (next tile's Q K^T before this tile's softmax)."""
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch([1, 17, 40], [1, 20, 70], 2, 1, 192, 128, seed=2)
    config = PrefillConfig(block_m=16, block_n=16, pipeline=True)
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


@pytest.mark.parametrize("name", ["none", "nvfp4", "fp8"])
def test_float16_inputs(name: str) -> None:
    quant = QUANTS[name]
    q, k, v, cu_q, cu_k, scale = make_batch(
        [7, 16, 70], [7, 30, 70], 4, 1, 64, 32, dtype=torch.float16, seed=5
    )
    out, lse, ref, ref_lse = run_both(q, k, v, cu_q, cu_k, scale, causal=True, quant=quant)
    assert out.dtype == torch.float16
    assert_matches(out, ref, **tolerance(quant, q.dtype), what=name)
    assert_lse(lse, ref_lse, atol=2e-3)


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
    config = PrefillConfig(block_m=32, block_n=32, pipeline=quant is not None)
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
    q, k, v, cu_q, cu_k, scale = make_batch([5, 30], [9, 40], 2, 2, 64, 32, seed=10)
    for name in ("nvfp4", "nvfp4-amax", "fp8-amax"):
        a = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS[name], kv_qdq="prepass")
        b = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=QUANTS[name], kv_qdq="fused")
        assert torch.equal(a, b), name


@pytest.mark.parametrize("sparsity", [None, NMSparsity(2, 4, dense_sink_tokens=4)])
def test_tile_invariance(sparsity: NMSparsity | None) -> None:
    """Two tilings agree within the SPEC 4 bound (P codes may flip only at ties)."""
    quant = QUANTS["nvfp4"]
    q, k, v, cu_q, cu_k, scale = make_batch([17, 100], [40, 100], 2, 1, 64, 32, seed=11)
    outs = []
    for bm, bn, pipeline in ((16, 16, False), (64, 32, True)):
        config = PrefillConfig(block_m=bm, block_n=bn, pipeline=pipeline)
        outs.append(
            prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, sparsity=sparsity,
                    config=config)
        )  # fmt: skip
    assert_matches(outs[0], outs[1], rtol=1e-5, atol=1e-6, flips=0.005, flip_err=0.35)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, under the interpreter
def test_non_finite_inputs_poison_the_rows_that_see_them() -> None:
    q, k, v, cu_q, cu_k, scale = make_batch([48], [48], 1, 1, 32, 16, seed=12)
    k[20, 0, 3] = float("nan")
    for quant in (None, QUANTS["nvfp4"]):
        out = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant)
        assert bool(torch.isfinite(out[:20]).all())  # causal rows before key 20
        assert bool(torch.isnan(out[20:]).all())
    # V: P = 0 times NaN is NaN, so a non-finite value reaches every row whose key
    # tiles hold it, visible or not; with 16-key tiles, rows 0-15 never load key 20
    k[20, 0, 3] = 0.0
    v[20, 0, 0] = float("inf")
    config = PrefillConfig(block_m=16, block_n=16)
    for quant in (None, QUANTS["nvfp4"]):
        out = prefill(q, k, v, cu_q, cu_k, softmax_scale=scale, quant=quant, config=config)
        assert bool(torch.isfinite(out[:16]).all())
        assert not bool(torch.isfinite(out[16:, :, 0]).any())
        assert bool(torch.isfinite(out[16:, :, 1:]).all())


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
        ({"quant": AttentionQuant(p=OperandQuant("nvfp4", 0.75))}, "quant"),
        ({"sparsity": (2, 4)}, "sparsity"),
        ({"sparsity": NMSparsity(2, 32), "config": PrefillConfig(16, 16)}, "sparsity"),
        ({"out": torch.zeros(9, 2, 8)}, "out"),
        ({"out": torch.zeros(9, 2, 16, dtype=torch.float16)}, "out"),
        ({"kv_qdq": "never"}, "kv_qdq"),
        ({"max_seqlen_q": -1, "max_seqlen_k": 6}, "max_seqlen_q"),
        ({"return_lse": "yes"}, "return_lse"),
    ],
)
def test_validation_names_the_argument(change: dict[str, object], argument: str) -> None:
    kwargs = _valid() | change
    with pytest.raises(ValueError, match=f"^{argument}"):
        prefill(**kwargs)  # type: ignore[arg-type]


def test_config_validation() -> None:
    with pytest.raises(ValueError, match=r"config\.block_m"):
        PrefillConfig(block_m=24, block_n=16)
    # m = 16 divides block_n = 16
    kwargs = _valid() | {"sparsity": NMSparsity(2, 16), "config": PrefillConfig(16, 16)}
    prefill(**kwargs)  # type: ignore[arg-type]


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
