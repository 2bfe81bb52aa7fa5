"""Property tests of the oracles' invariants, over drawn shapes, lengths, recipes, layouts.

decode: a request's output does not depend on the rest of the batch, on the order of
the requests, on the page size and order of the cache, on strides, or on q being one
tensor or the (nope, rope) pair. prefill: a packed batch equals one call per sequence,
in any order and any strides. Both bit for bit, non-finite values included (NaN equal
to NaN). Drawn bad arguments raise a ValueError that starts with the argument's name.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_reference import decode, prefill

SETTINGS = settings(max_examples=12, deadline=None)
ROPE = 16
RECIPES = [
    None,
    AttentionQuant.uniform("nvfp4"),
    AttentionQuant.uniform("fp8"),
    AttentionQuant(
        q=OperandQuant("nvfp4", 12.0),
        k=OperandQuant("fp8", "dynamic"),
        p=OperandQuant("nvfp4", 1.5),
        v=OperandQuant("nvfp4", 20.0),
    ),
]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def strided(x: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous view (every other element of a wider last dim)."""
    wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def maybe_poison(x: torch.Tensor, data: st.DataObject) -> None:
    """Sometimes put one NaN or ±inf somewhere in ``x`` (in place)."""
    if x.numel() and data.draw(st.booleans()):
        index = data.draw(st.integers(0, x.numel() - 1))
        x.view(-1)[index] = data.draw(st.sampled_from([math.nan, math.inf, -math.inf]))


# ----------------------------------------------------------------------------- decode


def page(
    rows: list[torch.Tensor], page_size: int, gen: torch.Generator, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay requests' latent rows into a cache of shuffled pages with spare pages full of
    NaN; returns (cache, block_table, seq_lens)."""
    counts = [-(-r.shape[0] // page_size) for r in rows]
    num_blocks = sum(counts) + 2
    cache = torch.full((num_blocks, page_size, dim), math.nan)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(rows), max([*counts, 1])), order[-1], dtype=torch.int32)
    for b, (r, count) in enumerate(zip(rows, counts, strict=True)):
        pages, order = order[:count], order[count:]
        table[b, :count] = torch.tensor(pages, dtype=torch.int32)
        for t in range(r.shape[0]):
            cache[pages[t // page_size], t % page_size] = r[t]
    lens = torch.tensor([r.shape[0] for r in rows], dtype=torch.int32)
    return cache, table, lens


@SETTINGS
@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=4),
    st.integers(1, 3),
    st.sampled_from([16, 32]),
    st.sampled_from([1, 5, 16]),
    st.sampled_from([3, 16, 32]),
    st.sampled_from(RECIPES),
    st.integers(0, 2**31 - 1),
    st.data(),
)
def test_decode_is_invariant_to_batch_order_pages_and_strides(
    lens: list[int],
    heads: int,
    rank: int,
    page_size: int,
    other_page_size: int,
    quant: AttentionQuant | None,
    seed: int,
    data: st.DataObject,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    dim = rank + ROPE
    rows = [torch.randn(n, dim, generator=gen) for n in lens]
    for r in rows:
        maybe_poison(r, data)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    maybe_poison(q, data)
    kw: dict[str, Any] = {"softmax_scale": 0.3, "kv_lora_rank": rank, "quant": quant}
    cache, table, seq_lens = page(rows, page_size, gen, dim)
    out, lse = decode(q, cache, table, seq_lens, **kw)
    assert out.shape == (len(lens), heads, rank) and lse.shape == (len(lens), heads)

    cache2, table2, lens2 = page(rows, other_page_size, gen, dim)  # other pages
    out2, lse2 = decode(strided(q), strided(cache2), table2, lens2, **kw)
    assert same(out2, out) and same(lse2, lse)

    pair = (q[..., :rank], q[..., rank:])
    out3, lse3 = decode(pair, cache, table, seq_lens, **kw)
    assert same(out3, out) and same(lse3, lse)

    perm = data.draw(st.permutations(range(len(lens))))
    cache4, table4, lens4 = page([rows[i] for i in perm], page_size, gen, dim)
    out4, lse4 = decode(q[perm], cache4, table4, lens4, **kw)
    assert same(out4, out[perm]) and same(lse4, lse[perm])

    b = data.draw(st.integers(0, len(lens) - 1))  # the request alone
    out5, lse5 = decode(q[b : b + 1], cache, table[b : b + 1], seq_lens[b : b + 1], **kw)
    assert same(out5, out[b : b + 1]) and same(lse5, lse[b : b + 1])


DECODE_BAD = ["seq_lens", "block_table", "kv_cache", "q", "kv_lora_rank", "softmax_scale"]


@SETTINGS
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=3),
    st.sampled_from([1, 5, 16]),
    st.sampled_from(DECODE_BAD),
    st.integers(0, 2**31 - 1),
)
def test_decode_names_a_drawn_bad_argument(
    lens: list[int], page_size: int, bad: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rank, dim = 16, 16 + ROPE
    cache, table, seq_lens = page([torch.randn(n, dim) for n in lens], page_size, gen, dim)
    args: dict[str, Any] = {
        "q": torch.randn(len(lens), 2, dim),
        "kv_cache": cache,
        "block_table": table,
        "seq_lens": seq_lens,
        "softmax_scale": 0.3,
        "kv_lora_rank": rank,
    }
    b = int(torch.randint(0, len(lens), (1,), generator=gen))
    if bad == "seq_lens":  # beyond the table's capacity, or negative
        capacity = table.shape[1] * page_size
        seq_lens[b] = capacity + 1 if seed % 2 else -1
    elif bad == "block_table":  # a used page outside the cache
        table[b, 0] = cache.shape[0] if seed % 2 else -1
    elif bad == "kv_cache":  # a width that is not rank + a multiple of 16
        args["kv_cache"] = cache[..., : dim - 8]
    elif bad == "q":
        args["q"] = args["q"][..., : dim - 16] if seed % 2 else args["q"].long()
    elif bad == "kv_lora_rank":
        args["kv_lora_rank"] = 8 if seed % 2 else 16.0
    else:
        args["softmax_scale"] = -0.3 if seed % 2 else math.inf
    q = args.pop("q")
    with pytest.raises(ValueError, match=rf"^{bad}(:| \()"):
        decode(q, args.pop("kv_cache"), args.pop("block_table"), args.pop("seq_lens"), **args)


# ----------------------------------------------------------------------------- prefill


def cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


@st.composite
def sequences(draw: st.DrawFn) -> list[tuple[int, int]]:
    """(Lq, Lk) per sequence, 0 to 3 sequences; Lq > Lk happens (rows without keys)."""
    return draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), max_size=3))


@SETTINGS
@given(
    sequences(),
    st.sampled_from([(2, 1), (2, 2), (4, 2)]),
    st.sampled_from([(16, 16), (32, 16)]),
    st.booleans(),
    st.sampled_from(RECIPES),
    st.sampled_from([None, NMSparsity(2, 4), NMSparsity(1, 4, 2, 3)]),
    st.integers(0, 2**31 - 1),
    st.data(),
)
def test_prefill_packed_equals_one_call_per_sequence(
    seqs: list[tuple[int, int]],
    head_counts: tuple[int, int],
    dims: tuple[int, int],
    causal: bool,
    quant: AttentionQuant | None,
    sparsity: NMSparsity | None,
    seed: int,
    data: st.DataObject,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads = head_counts
    dim, dim_v = dims
    lens_q, lens_k = [s[0] for s in seqs], [s[1] for s in seqs]
    q = torch.randn(sum(lens_q), heads, dim, generator=gen)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=gen)
    v = torch.randn(sum(lens_k), kv_heads, dim_v, generator=gen)
    for x in (q, k, v):
        maybe_poison(x, data)
    kw: dict[str, Any] = {
        "softmax_scale": 0.25,
        "causal": causal,
        "quant": quant,
        "sparsity": sparsity,
        "return_lse": True,
    }
    out, lse = prefill(q, k, v, cu(lens_q), cu(lens_k), **kw)
    assert out.shape == (sum(lens_q), heads, dim_v) and lse.shape == (heads, sum(lens_q))

    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    parts = [slice(cq[b], cq[b + 1]) for b in range(len(seqs))]
    keys = [slice(ck[b], ck[b + 1]) for b in range(len(seqs))]
    for b, (sq, sk) in enumerate(zip(parts, keys, strict=True)):
        one = cu([lens_q[b]]), cu([lens_k[b]])
        out_b, lse_b = prefill(q[sq], k[sk], v[sk], *one, **kw)
        assert same(out_b, out[sq]) and same(lse_b, lse[:, sq])

    perm = data.draw(st.permutations(range(len(seqs))))
    q_p = torch.cat([q[parts[i]] for i in perm]) if seqs else q
    k_p = torch.cat([k[keys[i]] for i in perm]) if seqs else k
    v_p = torch.cat([v[keys[i]] for i in perm]) if seqs else v
    cu_p = cu([lens_q[i] for i in perm]), cu([lens_k[i] for i in perm])
    out_p, lse_p = prefill(strided(q_p), strided(k_p), strided(v_p), *cu_p, **kw)
    want_out = torch.cat([out[parts[i]] for i in perm]) if seqs else out
    want_lse = torch.cat([lse[:, parts[i]] for i in perm], dim=1) if seqs else lse
    assert same(out_p, want_out) and same(lse_p, want_lse)


PREFILL_BAD = ["cu_seqlens_q", "cu_seqlens_k", "q", "v", "k"]


@SETTINGS
@given(
    st.lists(st.tuples(st.integers(1, 8), st.integers(1, 20)), min_size=1, max_size=3),
    st.sampled_from(PREFILL_BAD),
    st.integers(0, 2**31 - 1),
)
def test_prefill_names_a_drawn_bad_argument(
    seqs: list[tuple[int, int]], bad: str, seed: int
) -> None:
    lens_q, lens_k = [s[0] for s in seqs], [s[1] for s in seqs]
    args: dict[str, Any] = {
        "q": torch.randn(sum(lens_q), 2, 32),
        "k": torch.randn(sum(lens_k), 1, 32),
        "v": torch.randn(sum(lens_k), 1, 16),
        "cu_seqlens_q": cu(lens_q),
        "cu_seqlens_k": cu(lens_k),
    }
    b = seed % (len(seqs) + 1)
    if bad.startswith("cu_seqlens"):
        offsets = args[bad].clone()
        if seed % 3 == 0:  # wrong total
            offsets[-1] += 1
        elif seed % 3 == 1 and len(seqs) > 1:  # decreasing
            offsets[1], offsets[2] = offsets[2].item(), offsets[1].item() - 1
        elif seed % 3 == 1:
            offsets = offsets.float()
        else:  # not starting at 0
            offsets[0] = b + 1
        args[bad] = offsets
    elif bad == "q":  # head dim not a multiple of 16
        args["q"] = torch.randn(sum(lens_q), 2, 24 + 16 * (seed % 2))
    elif bad == "k":  # KV heads that do not divide the query heads
        args["k"] = torch.randn(sum(lens_k), 3, 32)
        args["v"] = torch.randn(sum(lens_k), 3, 16)
    else:  # V's tokens differ from K's
        args["v"] = torch.randn(sum(lens_k) + 1, 1, 16)
    with pytest.raises(ValueError, match=rf"^{bad}(:| \()"):
        prefill(
            *(args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")), softmax_scale=0.25
        )
