"""The prefill oracle against independent formulations of its definition."""

from __future__ import annotations

import importlib
import itertools
import math
import sys
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_formats import AttentionQuant, NMSparsity, OperandQuant, qdq
from mla_reference import prefill

F64 = torch.float64
TIGHT: dict[str, Any] = {"atol": 1e-12, "rtol": 1e-12}


def packed(
    lens_q: list[int],
    lens_k: list[int],
    heads: int,
    kv_heads: int,
    dim: int,
    dim_v: int,
    *,
    dtype: torch.dtype = F64,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random packed q, k, v and their int32 cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, dim, generator=gen, dtype=F64).to(dtype)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=gen, dtype=F64).to(dtype)
    v = torch.randn(sum(lens_k), kv_heads, dim_v, generator=gen, dtype=F64).to(dtype)
    return q, k, v, cu(lens_q), cu(lens_k)


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def visible_mask(lq: int, lk: int, causal: bool) -> torch.Tensor:
    """[Lq, Lk]: query i sits at key position lk - lq + i (suffix alignment)."""
    q_pos = lk - lq + torch.arange(lq)
    if not causal:
        return torch.ones(lq, lk, dtype=torch.bool)
    return torch.arange(lk).unsqueeze(0) <= q_pos.unsqueeze(1)


def sdpa_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> torch.Tensor:
    """torch SDPA of one sequence, [L, H, D] layout, GQA through enable_gqa."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def dot_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax(q k^T scale) v and logsumexp; mask [Lq, Lk] or [H, Lq, Lk]."""
    group = q.shape[1] // k.shape[1]
    kh = k.repeat_interleave(group, dim=1)
    vh = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kh) * scale
    s = s.masked_fill(~mask.expand(s.shape), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vh), lse


def seq_slices(cu_t: torch.Tensor) -> list[slice]:
    c = cu_t.tolist()
    return [slice(a, b) for a, b in itertools.pairwise(c)]


# ---------------------------------------------------------------- quant none


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("dim", "dim_v", "heads"), [(192, 128, 4), (64, 32, 4), (576, 512, 2)])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_matches_sdpa(causal: bool, dim: int, dim_v: int, heads: int, kv_heads: int) -> None:
    lens_q, lens_k = [5, 17, 1, 33], [5, 40, 9, 33]
    q, k, v, cq, ck = packed(lens_q, lens_k, heads, kv_heads, dim, dim_v, seed=dim + kv_heads)
    scale = dim**-0.5
    out, lse = prefill(q, k, v, cq, ck, softmax_scale=scale, causal=causal, return_lse=True)
    assert out.shape == (sum(lens_q), heads, dim_v) and out.dtype == F64
    assert lse.shape == (heads, sum(lens_q)) and lse.dtype == F64
    for sq, sk in zip(seq_slices(cq), seq_slices(ck), strict=True):
        mask = visible_mask(sq.stop - sq.start, sk.stop - sk.start, causal)
        expected = sdpa_sequence(q[sq], k[sk], v[sk], scale, mask)
        torch.testing.assert_close(out[sq], expected, **TIGHT)
        expected_dot, expected_lse = dot_sequence(q[sq], k[sk], v[sk], scale, mask)
        torch.testing.assert_close(out[sq], expected_dot, **TIGHT)
        torch.testing.assert_close(lse[:, sq], expected_lse, **TIGHT)


def test_empty_rows_give_zero_and_minus_inf() -> None:
    # sequence 0: no keys; 1: 6 queries over 4 keys (2 leading rows see nothing);
    # 2: no queries; 3: ordinary.
    lens_q, lens_k = [3, 6, 0, 4], [0, 4, 5, 4]
    q, k, v, cq, ck = packed(lens_q, lens_k, 2, 1, 32, 16, seed=3)
    for quant in (None, AttentionQuant.uniform("nvfp4")):
        out, lse = prefill(q, k, v, cq, ck, softmax_scale=0.2, quant=quant, return_lse=True)
        assert torch.equal(out[0:3], torch.zeros_like(out[0:3]))
        assert torch.equal(lse[:, 0:3], torch.full_like(lse[:, 0:3], -math.inf))
        assert torch.equal(out[3:5], torch.zeros_like(out[3:5]))
        assert bool(torch.isneginf(lse[:, 3:5]).all())
        assert bool(torch.isfinite(lse[:, 5:]).all()) and bool(torch.isfinite(out).all())
    out, lse = prefill(q, k, v, cq, ck, softmax_scale=0.2, return_lse=True)
    mask = visible_mask(6, 4, True)[2:]
    expected, expected_lse = dot_sequence(q[5:9], k[0:4], v[0:4], 0.2, mask)
    torch.testing.assert_close(out[5:9], expected, **TIGHT)
    torch.testing.assert_close(lse[:, 5:9], expected_lse, **TIGHT)


@pytest.mark.parametrize("quant", [None, AttentionQuant.uniform("nvfp4")])
@pytest.mark.parametrize("dtype", [torch.float16, F64])
def test_a_batch_of_no_sequences(quant: AttentionQuant | None, dtype: torch.dtype) -> None:
    """cu_seqlens [0]: B = 0, T = 0; empty out [0, H, Dv] and lse [H, 0], as decode's B = 0."""
    q, k, v, cq, ck = packed([], [], 4, 2, 64, 32, dtype=dtype)
    assert cq.tolist() == [0] and q.shape == (0, 4, 64)
    debug: dict[str, Any] = {}
    out, lse = prefill(
        q, k, v, cq, ck, softmax_scale=0.1, quant=quant, return_lse=True, debug=debug
    )
    assert out.shape == (0, 4, 32) and out.dtype == dtype
    assert lse.shape == (4, 0) and lse.dtype == torch.promote_types(dtype, torch.float32)
    assert debug["p"] == [] and debug["q"].shape == (0, 4, 64)
    assert prefill(q, k, v, cq, ck, softmax_scale=0.1, causal=False).shape == (0, 4, 32)


def test_all_none_recipe_is_no_quantization() -> None:
    q, k, v, cq, ck = packed([9, 20], [9, 31], 4, 2, 64, 32, seed=5)
    base = prefill(q, k, v, cq, ck, softmax_scale=0.125)
    none = prefill(q, k, v, cq, ck, softmax_scale=0.125, quant=AttentionQuant())
    assert torch.equal(base, none)


def test_dtypes() -> None:
    q, k, v, cq, ck = packed([9, 20], [9, 31], 4, 2, 64, 32, seed=6)
    ref, ref_lse = prefill(q, k, v, cq, ck, softmax_scale=0.125, return_lse=True)
    out32, lse32 = prefill(
        q, k, v, cq, ck, softmax_scale=0.125, compute_dtype=torch.float32, return_lse=True
    )
    assert out32.dtype == F64 and lse32.dtype == F64
    torch.testing.assert_close(out32, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse32, ref_lse, atol=1e-5, rtol=1e-5)
    h = (q.half(), k.half(), v.half())
    out16, lse16 = prefill(*h, cq, ck, softmax_scale=0.125, return_lse=True)
    assert out16.dtype == torch.float16 and lse16.dtype == torch.float32
    out_wide = prefill(*h, cq, ck, softmax_scale=0.125, out_dtype=F64)
    assert out_wide.dtype == F64
    assert torch.equal(out_wide.half(), out16)


def merge_attn_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's merge of two partial attention states (o [T, H, D], lse [H, T])."""
    m = torch.maximum(lse1, lse2)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (o1 * w1.T.unsqueeze(-1) + o2 * w2.T.unsqueeze(-1)) / safe.T.unsqueeze(-1)
    lse = torch.where(total > 0, m + torch.log(safe), torch.full_like(m, -math.inf))
    return out, lse


@pytest.mark.parametrize(
    "quant", [None, AttentionQuant.uniform("nvfp4"), AttentionQuant.uniform("fp8")]
)
def test_chunk_merge_equals_full_attention(quant: AttentionQuant | None) -> None:
    """Context keys (non-causal) + new keys (causal), merged by LSE = full causal.

    With a quantized recipe this is the invariance of docs/numerics.md "Softmax, P and
    schedule invariance": the cut is at a multiple of
    16 and the score spread keeps every P block scale out of E4M3 subnormals.
    """
    heads, dim, dim_v = 4, 64, 32
    for context, new in ((32, 20), (0, 7), (48, 1)):
        q, k, v, _, _ = packed([new], [context + new], heads, 2, dim, dim_v, seed=context)
        cq, ck = cu([new]), cu([context + new])
        scale = 0.1
        full, full_lse = prefill(q, k, v, cq, ck, softmax_scale=scale, quant=quant, return_lse=True)
        kw: dict[str, Any] = {"softmax_scale": scale, "quant": quant, "return_lse": True}
        o1, l1 = prefill(q, k[:context], v[:context], cq, cu([context]), causal=False, **kw)
        o2, l2 = prefill(q, k[context:], v[context:], cq, cu([new]), causal=True, **kw)
        if context == 0:
            assert bool(torch.isneginf(l1).all())
        merged, merged_lse = merge_attn_states(o1, l1, o2, l2)
        torch.testing.assert_close(merged, full, **TIGHT)
        torch.testing.assert_close(merged_lse, full_lse, **TIGHT)


def test_noncausal_split_anywhere_merges() -> None:
    q, k, v, cq, ck = packed([11], [45], 2, 1, 32, 16, seed=8)
    full, full_lse = prefill(q, k, v, cq, ck, softmax_scale=0.3, causal=False, return_lse=True)
    for cut in (1, 13, 44):
        kw: dict[str, Any] = {"softmax_scale": 0.3, "causal": False, "return_lse": True}
        o1, l1 = prefill(q, k[:cut], v[:cut], cq, cu([cut]), **kw)
        o2, l2 = prefill(q, k[cut:], v[cut:], cq, cu([45 - cut]), **kw)
        merged, merged_lse = merge_attn_states(o1, l1, o2, l2)
        torch.testing.assert_close(merged, full, **TIGHT)
        torch.testing.assert_close(merged_lse, full_lse, **TIGHT)


# ---------------------------------------------------------------- quantized operands


def expected_p(
    q_hat: torch.Tensor,
    k_hat: torch.Tensor,
    scale: float,
    keep: torch.Tensor,
    p_fmt: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(QDQ(P) [H, Lq, Lk], m [H, Lq], l [H, Lq]) from the definition, for one sequence."""
    group = q_hat.shape[1] // k_hat.shape[1]
    s = torch.einsum("qhd,khd->hqk", q_hat, k_hat.repeat_interleave(group, dim=1)) * scale
    t = s * math.log2(math.e)
    m = torch.ceil(t.masked_fill(~keep, -math.inf).amax(dim=-1))
    p = torch.where(keep, torch.exp2(t - m.unsqueeze(-1)), torch.zeros_like(t))
    p_hat = qdq(p.float(), p_fmt, axis=-1, amax=1.0, pad=True).double()
    return p_hat, m, p.sum(dim=-1)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_prefill_operands_are_qdq_at_absolute_positions(fmt: str) -> None:
    # Sequences start at odd offsets (7, 28) of the packed batch.
    lens_q, lens_k = [7, 21, 18], [7, 21, 18]
    q, k, v, cq, ck = packed(lens_q, lens_k, 4, 2, 64, 32, dtype=torch.float32, seed=11)
    scale = 0.125
    debug: dict[str, Any] = {}
    out = prefill(
        q, k, v, cq, ck, softmax_scale=scale, quant=AttentionQuant.uniform(fmt), debug=debug
    )
    assert torch.equal(debug["q"], qdq(q, fmt, axis=-1, amax="dynamic").double())
    assert torch.equal(debug["k"], qdq(k, fmt, axis=-1).double())
    for sk in seq_slices(ck):
        expected_v = qdq(v[sk], fmt, axis=0, pad=True).double()
        assert torch.equal(debug["v"][sk], expected_v)
    if fmt == "nvfp4":  # blocks at packed-batch positions would give something else
        packed_v = qdq(v[7:28], fmt, axis=0, offset=7, pad=True).double()
        assert not torch.equal(debug["v"][7:28], packed_v)

    for b, (sq, sk) in enumerate(zip(seq_slices(cq), seq_slices(ck), strict=True)):
        keep = visible_mask(sq.stop - sq.start, sk.stop - sk.start, True).expand(4, -1, -1)
        p_hat, m, denom = expected_p(debug["q"][sq], debug["k"][sk], scale, keep, fmt)
        assert torch.equal(debug["keep"][b], keep)
        assert torch.equal(debug["p"][b], p_hat)
        assert torch.equal(debug["m"][b], m)
        torch.testing.assert_close(debug["l"][b], denom, **TIGHT)
        acc = torch.einsum("hqk,khd->qhd", p_hat, debug["v"][sk].repeat_interleave(2, dim=1))
        expected_out = (acc / denom.T.unsqueeze(-1)).float()
        torch.testing.assert_close(out[sq], expected_out, atol=1e-6, rtol=1e-6)


def test_dynamic_k_and_static_amax() -> None:
    q, k, v, cq, ck = packed([5, 19], [5, 19], 2, 2, 32, 16, seed=12)
    quant = AttentionQuant(
        q=OperandQuant("nvfp4", amax=9.0),
        k=OperandQuant("fp8", amax="dynamic"),
        v=OperandQuant("nvfp4", amax=5.0),
        p="fp8",
    )
    debug: dict[str, Any] = {}
    prefill(q, k, v, cq, ck, softmax_scale=0.2, quant=quant, debug=debug)
    assert torch.equal(debug["q"], qdq(q, "nvfp4", axis=-1, amax=9.0).double())
    assert torch.equal(debug["k"], qdq(k, "fp8", axis=-1, amax="dynamic").double())
    assert torch.equal(debug["v"][5:], qdq(v[5:], "nvfp4", axis=0, amax=5.0, pad=True).double())
    assert not torch.equal(debug["q"], q)


def test_reference_point_is_power_of_two_max() -> None:
    q, k, v, cq, ck = packed([9, 30], [20, 30], 4, 1, 64, 32, seed=13)
    debug: dict[str, Any] = {}
    prefill(q, k, v, cq, ck, softmax_scale=0.3, debug=debug)
    for p, m in zip(debug["p"], debug["m"], strict=True):
        assert torch.equal(m, torch.ceil(m))
        top = p.amax(dim=-1)
        assert bool(((top > 0.5) & (top <= 1.0)).all())


# ---------------------------------------------------------------- N:M sparsity


def expected_keep(
    s: torch.Tensor, visible: torch.Tensor, lq: int, sparsity: NMSparsity
) -> torch.Tensor:
    """The N:M rule (docs/numerics.md "N:M sparsity") with plain loops.

    s [H, Lq, Lk], visible [Lq, Lk].
    """
    heads, _, lk = s.shape
    if lq == 1:
        return visible.expand(heads, lq, lk).clone()
    keep = torch.zeros(heads, lq, lk, dtype=torch.bool)
    for h in range(heads):
        for i in range(lq):
            q_pos = lk - lq + i
            for start in range(0, lk, sparsity.m):
                group = [j for j in range(start, min(lk, start + sparsity.m)) if visible[i, j]]
                ranked = sorted(group, key=lambda j: (-float(s[h, i, j]), j))
                for j in group:
                    dense = j < sparsity.dense_sink_tokens or (
                        0 <= q_pos - j < sparsity.dense_recent_tokens
                    )
                    keep[h, i, j] = dense or j in ranked[: sparsity.n]
    return keep


def integer_inputs(
    lq: int, lk: int, heads: int, dim: int, seed: int, levels: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Small-integer q and k (exact scores, frequent ties) and random v."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-levels, levels + 1, (lq, heads, dim), generator=gen).double()
    k = torch.randint(-levels, levels + 1, (lk, heads, dim), generator=gen).double()
    v = torch.randn(lk, heads, dim, generator=gen, dtype=F64)
    return q, k, v


NM_PAIRS = [(1, 2), (2, 4), (1, 4), (3, 4), (2, 8)]


@settings(max_examples=40, deadline=None)
@given(
    lq=st.integers(1, 10),
    extra=st.integers(0, 20),
    nm=st.sampled_from(NM_PAIRS),
    sink=st.integers(0, 5),
    recent=st.integers(0, 5),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_nm_keep_follows_the_rule(
    lq: int, extra: int, nm: tuple[int, int], sink: int, recent: int, causal: bool, seed: int
) -> None:
    lk = lq + extra
    sparsity = NMSparsity(nm[0], nm[1], dense_sink_tokens=sink, dense_recent_tokens=recent)
    q, k, v = integer_inputs(lq, lk, 2, 16, seed)
    scale = 0.25  # a power of two: the scores are exact
    debug: dict[str, Any] = {}
    out, lse = prefill(
        q,
        k,
        v,
        cu([lq]),
        cu([lk]),
        softmax_scale=scale,
        causal=causal,
        sparsity=sparsity,
        debug=debug,
        return_lse=True,
    )
    visible = visible_mask(lq, lk, causal)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    keep = debug["keep"][0]
    assert torch.equal(keep, expected_keep(s, visible, lq, sparsity))
    assert not bool((keep & ~visible).any())  # causal masking respected
    # the output is dense attention over the kept keys
    expected, expected_lse = dot_sequence(q, k, v, scale, keep)
    torch.testing.assert_close(out, expected, **TIGHT)
    torch.testing.assert_close(lse, expected_lse, **TIGHT)


@settings(max_examples=25, deadline=None)
@given(
    lq=st.integers(2, 12),
    extra=st.integers(0, 24),
    nm=st.sampled_from(NM_PAIRS),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_nm_keeps_exactly_n_per_group(
    lq: int, extra: int, nm: tuple[int, int], causal: bool, seed: int
) -> None:
    n, m = nm
    lk = lq + extra
    q, k, v = integer_inputs(lq, lk, 2, 16, seed, levels=1)
    debug: dict[str, Any] = {}
    prefill(
        q,
        k,
        v,
        cu([lq]),
        cu([lk]),
        softmax_scale=0.5,
        causal=causal,
        sparsity=NMSparsity(n, m),
        debug=debug,
    )
    keep = debug["keep"][0]
    visible = visible_mask(lq, lk, causal)
    for start in range(0, lk, m):
        group_visible = visible[:, start : start + m].sum(dim=-1)  # [Lq]
        kept = keep[:, :, start : start + m].sum(dim=-1)  # [H, Lq]
        expected = torch.clamp(group_visible, max=n).expand_as(kept)
        assert torch.equal(kept, expected)


def test_nm_ties_go_to_the_lower_index() -> None:
    lq, lk = 4, 16
    q = torch.ones(lq, 1, 16, dtype=F64)
    k = torch.ones(lk, 1, 16, dtype=F64)
    k[9] = 2.0  # one clear winner in group [8, 12)
    v = torch.randn(lk, 1, 16, dtype=F64)
    debug: dict[str, Any] = {}
    prefill(
        q,
        k,
        v,
        cu([lq]),
        cu([lk]),
        softmax_scale=0.25,
        causal=False,
        sparsity=NMSparsity(2, 4),
        debug=debug,
    )
    kept = debug["keep"][0][0, 0].nonzero().flatten().tolist()
    assert kept == [0, 1, 4, 5, 8, 9, 12, 13]


def test_nm_dense_windows() -> None:
    lq, lk = 8, 40
    q, k, v = integer_inputs(lq, lk, 2, 16, seed=21)
    sparsity = NMSparsity(1, 4, dense_sink_tokens=3, dense_recent_tokens=6)
    debug: dict[str, Any] = {}
    prefill(q, k, v, cu([lq]), cu([lk]), softmax_scale=0.25, sparsity=sparsity, debug=debug)
    keep = debug["keep"][0]
    assert bool(keep[:, :, :3].all())  # sink
    for i in range(lq):
        q_pos = lk - lq + i
        assert bool(keep[:, i, q_pos - 5 : q_pos + 1].all())  # recent window, inclusive
        assert not bool(keep[:, i, q_pos + 1 :].any())  # causal
        # outside the windows a group of 4 keeps 1
        for start in range(4, q_pos - 5 - 4, 4):
            assert bool((keep[:, i, start : start + 4].sum(dim=-1) == 1).all())


def test_nm_single_query_is_dense() -> None:
    q, k, v = integer_inputs(1, 30, 2, 16, seed=4)
    kw: dict[str, Any] = {"softmax_scale": 0.25, "return_lse": True}
    dense = prefill(q, k, v, cu([1]), cu([30]), **kw)
    sparse = prefill(q, k, v, cu([1]), cu([30]), sparsity=NMSparsity(1, 4), **kw)
    assert torch.equal(dense[0], sparse[0]) and torch.equal(dense[1], sparse[1])
    # the same query with a second one in its sequence is sparsified
    q2 = torch.cat([q, q])
    two = prefill(q2, k, v, cu([2]), cu([30]), sparsity=NMSparsity(1, 4), **kw)
    assert not torch.equal(two[0][1], dense[0][0])


# ---------------------------------------------------------------- invariances


def test_batch_invariance() -> None:
    quant = AttentionQuant.uniform("nvfp4")
    sparsity = NMSparsity(2, 4, dense_sink_tokens=4, dense_recent_tokens=8)
    q, k, v, cq, ck = packed([13, 29, 6], [30, 29, 17], 4, 2, 64, 32, seed=31)
    kw: dict[str, Any] = {
        "softmax_scale": 0.125,
        "quant": quant,
        "sparsity": sparsity,
        "return_lse": True,
    }
    out, lse = prefill(q, k, v, cq, ck, **kw)
    alone, alone_lse = prefill(q[13:42], k[30:59], v[30:59], cu([29]), cu([29]), **kw)
    assert torch.equal(out[13:42], alone)
    assert torch.equal(lse[:, 13:42], alone_lse)


def test_chunking_does_not_change_results(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("mla_reference.prefill")
    q, k, v, cq, ck = packed([13, 29], [30, 29], 4, 2, 64, 32, seed=32)
    kw: dict[str, Any] = {
        "softmax_scale": 0.125,
        "quant": AttentionQuant.uniform("nvfp4"),
        "sparsity": NMSparsity(2, 4),
        "return_lse": True,
    }
    out, lse = prefill(q, k, v, cq, ck, **kw)
    monkeypatch.setattr(module, "_ELEMENT_BUDGET", 100)
    out_c, lse_c = prefill(q, k, v, cq, ck, **kw)
    torch.testing.assert_close(out_c, out, atol=1e-14, rtol=1e-14)
    torch.testing.assert_close(lse_c, lse, atol=1e-14, rtol=1e-14)


def peak_rss_mib() -> float | None:
    """The process's peak resident memory in MiB, where the platform reports it."""
    try:
        import resource
    except ImportError:  # pragma: no cover (Windows)
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def test_prefill_4096_tokens_bounded_memory() -> None:
    """One 4096-token causal sequence, DeepSeek head dims, float32 compute."""
    length, heads = 4096, 8
    q, k, v, cq, ck = packed(
        [length], [length], heads, heads, 192, 128, dtype=torch.float32, seed=40
    )
    peak_before = peak_rss_mib()
    start = time.perf_counter()
    out, lse = prefill(
        q, k, v, cq, ck, softmax_scale=192**-0.5, compute_dtype=torch.float32, return_lse=True
    )
    elapsed = time.perf_counter() - start
    # One [H, Lq, Lk] float32 score tensor alone would be 512 MiB; the chunks stay far
    # below. (The process's peak only grows, so this bound can pass but never misfire.)
    if peak_before is not None:
        peak_after = peak_rss_mib()
        assert peak_after is not None and peak_after - peak_before < 1024
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        is_causal=True,
        scale=192**-0.5,
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert elapsed < 120
