"""The decode oracle against a plain paged loop, the MLA absorption identity and prefill."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from mla_formats import AttentionQuant, OperandQuant, qdq
from mla_reference import decode, prefill

F64 = torch.float64
TIGHT: dict[str, Any] = {"atol": 1e-12, "rtol": 1e-12}
RANK, ROPE = 512, 64


def paged(
    seq_lens: list[int],
    page_size: int,
    *,
    dim: int = RANK + ROPE,
    spare_blocks: int = 3,
    dtype: torch.dtype = F64,
    seed: int = 0,
    fill: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random cache whose pages are handed out in shuffled order.

    Returns (kv_cache [num_blocks, page_size, dim], block_table, seq_lens);
    block-table entries past a request's pages hold ``fill``.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in seq_lens]
    num_blocks = sum(pages_per) + spare_blocks
    cache = torch.randn(num_blocks, page_size, dim, generator=gen, dtype=F64).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max([*pages_per, 1]) + 1
    table = torch.full((len(seq_lens), width), fill, dtype=torch.int32)
    for b, count in enumerate(pages_per):
        table[b, :count] = torch.tensor(order[:count], dtype=torch.int32)
        order = order[count:]
    return cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def rows_of(cache: torch.Tensor, table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Request b's latent rows, gathered token by token with Python ints."""
    page_size = cache.shape[1]
    rows = [cache[int(table[b, t // page_size]), t % page_size] for t in range(length)]
    return torch.stack(rows) if rows else cache.new_zeros(0, cache.shape[2])


def plain_decode(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q · rows * scale) · rows[:, :512] per request, and the logsumexp."""
    out = torch.zeros(q.shape[0], q.shape[1], RANK, dtype=F64)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=F64)
    for b, length in enumerate(lens.tolist()):
        rows = rows_of(cache, table, b, length).double()
        if length == 0:
            continue
        s = q[b].double() @ rows.T * scale  # [H, L]
        out[b] = torch.softmax(s, dim=-1) @ rows[:, :RANK]
        lse[b] = torch.logsumexp(s, dim=-1)
    return out, lse


@pytest.mark.parametrize("page_size", [16, 64, 1, 5])
def test_matches_plain_paged_loop(page_size: int) -> None:
    lens = [37, 1, 0, 130, 16]
    cache, table, seq_lens = paged(lens, page_size, seed=page_size)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), 8, RANK + ROPE, generator=gen, dtype=F64)
    scale = 192**-0.5
    out, lse = decode(q, cache, table, seq_lens, softmax_scale=scale)
    expected, expected_lse = plain_decode(q, cache, table, seq_lens, scale)
    assert out.shape == (5, 8, RANK) and lse.shape == (5, 8)
    torch.testing.assert_close(out, expected, **TIGHT)
    torch.testing.assert_close(lse, expected_lse, **TIGHT)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert bool(torch.isneginf(lse[2]).all())
    # the pair (absorbed nope, rope) is the concatenated query
    out_pair, lse_pair = decode(
        (q[..., :RANK], q[..., RANK:]), cache, table, seq_lens, softmax_scale=scale
    )
    assert torch.equal(out_pair, out) and torch.equal(lse_pair, lse)


def test_strided_cache_view_and_unused_table_entries() -> None:
    lens = [40, 7]
    cache, table, seq_lens = paged(lens, 16, seed=2, fill=10_000)  # unused entries: garbage
    wide = torch.zeros(cache.shape[0], 2, 16, 640, dtype=F64)
    wide[:, 1, :, 32:608] = cache
    view = wide[:, 1, :, 32:608]  # a strided view: page stride 2 * 16 * 640
    assert not view.is_contiguous()
    q = torch.randn(2, 4, RANK + ROPE, dtype=F64)
    quant = AttentionQuant.uniform("nvfp4")
    out, lse = decode(q, cache, table, seq_lens, softmax_scale=0.07, quant=quant)
    out_v, lse_v = decode(q, view, table, seq_lens, softmax_scale=0.07, quant=quant)
    assert torch.equal(out, out_v) and torch.equal(lse, lse_v)


def test_other_latent_widths() -> None:
    cache, table, seq_lens = paged([21, 3], 8, dim=96, seed=3)
    q = torch.randn(2, 4, 96, dtype=F64)
    out, lse = decode(q, cache, table, seq_lens, softmax_scale=0.1, kv_lora_rank=64)
    assert out.shape == (2, 4, 64)
    for b, length in enumerate([21, 3]):
        rows = rows_of(cache, table, b, length)
        s = q[b] @ rows.T * 0.1
        torch.testing.assert_close(out[b], torch.softmax(s, -1) @ rows[:, :64], **TIGHT)
        torch.testing.assert_close(lse[b], torch.logsumexp(s, -1), **TIGHT)


def test_mla_absorption_identity() -> None:
    """Decode on (W_UK-absorbed q, latent) then W_UV = attention on up-projected K, V."""
    heads, nope, dim_v, lens = 4, 128, 128, [37, 50]
    gen = torch.Generator().manual_seed(7)
    w_uk = torch.randn(heads, RANK, nope, generator=gen, dtype=F64) / RANK**0.5
    w_uv = torch.randn(heads, RANK, dim_v, generator=gen, dtype=F64) / RANK**0.5
    q_nope = torch.randn(len(lens), heads, nope, generator=gen, dtype=F64)
    q_pe = torch.randn(len(lens), heads, ROPE, generator=gen, dtype=F64)
    cache, table, seq_lens = paged(lens, 16, seed=8)
    scale = (nope + ROPE) ** -0.5

    q_absorbed = torch.einsum("bhn,hrn->bhr", q_nope, w_uk)
    latent_out, lse = decode((q_absorbed, q_pe), cache, table, seq_lens, softmax_scale=scale)
    out = torch.einsum("bhr,hrv->bhv", latent_out, w_uv)

    for b, length in enumerate(lens):
        rows = rows_of(cache, table, b, length)
        c, k_pe = rows[:, :RANK], rows[:, RANK:]
        k = torch.cat(
            [torch.einsum("lr,hrn->lhn", c, w_uk), k_pe.unsqueeze(1).expand(-1, heads, -1)], -1
        )
        v = torch.einsum("lr,hrv->lhv", c, w_uv)
        q = torch.cat([q_nope[b], q_pe[b]], -1).unsqueeze(0)  # one query, the last position
        cq = torch.tensor([0, 1], dtype=torch.int32)
        ck = torch.tensor([0, length], dtype=torch.int32)
        o, o_lse = prefill(q, k, v, cq, ck, softmax_scale=scale, return_lse=True)
        torch.testing.assert_close(out[b], o[0], **TIGHT)
        torch.testing.assert_close(lse[b], o_lse[:, 0], **TIGHT)


@pytest.mark.parametrize(
    "quant",
    [
        AttentionQuant.uniform("nvfp4"),
        AttentionQuant.uniform("fp8"),
        AttentionQuant(q="fp8", k=OperandQuant("nvfp4", "dynamic"), p="nvfp4", v="fp8"),
    ],
)
def test_decode_equals_prefill_on_the_latent(quant: AttentionQuant) -> None:
    """The two oracles agree where their definitions meet: one query at the last
    position, one KV head whose K is the latent row and V its first 512 features."""
    lens = [37, 64, 1]
    cache, table, seq_lens = paged(lens, 16, seed=9)
    q = torch.randn(len(lens), 8, RANK + ROPE, dtype=F64)
    out, lse = decode(q, cache, table, seq_lens, softmax_scale=0.05, quant=quant)
    for b, length in enumerate(lens):
        rows = rows_of(cache, table, b, length).unsqueeze(1)
        cq = torch.tensor([0, 1], dtype=torch.int32)
        ck = torch.tensor([0, length], dtype=torch.int32)
        o, o_lse = prefill(
            q[b : b + 1],
            rows,
            rows[..., :RANK],
            cq,
            ck,
            softmax_scale=0.05,
            quant=quant,
            return_lse=True,
        )
        torch.testing.assert_close(out[b], o[0], **TIGHT)
        torch.testing.assert_close(lse[b], o_lse[:, 0], **TIGHT)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_decode_operands_are_qdq_at_absolute_positions(fmt: str) -> None:
    lens = [37, 21]  # not multiples of 16
    cache, table, seq_lens = paged(lens, 16, dtype=torch.float32, seed=10)
    gen = torch.Generator().manual_seed(11)
    q_nope = torch.randn(2, 4, RANK, generator=gen)
    q_pe = torch.randn(2, 4, ROPE, generator=gen)
    scale = 0.05
    debug: dict[str, Any] = {}
    out, lse = decode(
        (q_nope, q_pe),
        cache,
        table,
        seq_lens,
        softmax_scale=scale,
        quant=AttentionQuant.uniform(fmt),
        debug=debug,
    )
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    q_full = torch.cat([q_nope, q_pe], dim=-1)
    assert torch.equal(debug["q"], qdq(q_full, fmt, axis=-1, amax="dynamic").double())
    for b, length in enumerate(lens):
        rows = rows_of(cache, table, b, length)
        assert torch.equal(debug["k"][b], qdq(rows, fmt, axis=-1).double())
        expected_v = qdq(rows[:, :RANK], fmt, axis=0, pad=True).double()
        assert torch.equal(debug["v"][b], expected_v)
        if fmt == "nvfp4":  # blocks anywhere else would differ
            shifted = qdq(rows[:, :RANK], fmt, axis=0, offset=5, pad=True).double()
            assert not torch.equal(debug["v"][b], shifted)
        s = debug["q"][b] @ debug["k"][b].T * scale
        t = s * math.log2(math.e)
        m = torch.ceil(t.amax(dim=-1))
        p = torch.exp2(t - m.unsqueeze(-1))
        p_hat = qdq(p.float(), fmt, axis=-1, amax=1.0, pad=True).double()
        assert torch.equal(debug["m"][b], m)
        assert torch.equal(debug["p"][b], p_hat)
        torch.testing.assert_close(debug["l"][b], p.sum(-1), **TIGHT)
        expected_out = (p_hat @ debug["v"][b]) / p.sum(-1, keepdim=True)
        torch.testing.assert_close(out[b], expected_out.float(), atol=1e-6, rtol=1e-6)
        expected_lse = torch.log(p.sum(-1)) + m * math.log(2.0)
        torch.testing.assert_close(lse[b], expected_lse.float(), atol=1e-6, rtol=1e-6)


def test_batch_invariance() -> None:
    lens = [37, 130, 5, 64]
    cache, table, seq_lens = paged(lens, 16, seed=12)
    q = torch.randn(4, 8, RANK + ROPE, dtype=F64)
    kw: dict[str, Any] = {"softmax_scale": 0.05, "quant": AttentionQuant.uniform("nvfp4")}
    out, lse = decode(q, cache, table, seq_lens, **kw)
    for b in range(4):
        alone, alone_lse = decode(q[b : b + 1], cache, table[b : b + 1], seq_lens[b : b + 1], **kw)
        assert torch.equal(out[b], alone[0]) and torch.equal(lse[b], alone_lse[0])


def test_dtypes() -> None:
    cache, table, seq_lens = paged([30, 9], 16, seed=13)
    q = torch.randn(2, 4, RANK + ROPE, dtype=F64)
    ref, ref_lse = decode(q, cache, table, seq_lens, softmax_scale=0.05)
    out16, lse16 = decode(q.half(), cache.half(), table, seq_lens, softmax_scale=0.05)
    assert out16.dtype == torch.float16 and lse16.dtype == torch.float32
    out32, lse32 = decode(
        q,
        cache,
        table,
        seq_lens,
        softmax_scale=0.05,
        compute_dtype=torch.float32,
        out_dtype=torch.float32,
    )
    assert out32.dtype == torch.float32 and lse32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse32.double(), ref_lse, atol=1e-5, rtol=1e-5)
