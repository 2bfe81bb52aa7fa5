"""``mla_triton.decode`` against ``mla_reference.decode`` (CPU, Triton interpreter, fp16).

Tolerances (per output row ``(b, h)``: max abs difference over the 512 features
divided by the row's max abs reference value; the LSE in absolute terms):

- P not quantized: the kernel casts P to fp16 for the ``P V`` dot (relative error
  2^-11 per element), so rows agree to ``TOL_P_FP16 = 2.5e-3``.
- P quantized: P̂'s factored values are exact in fp16, every dot has exact
  products, and rows agree to ``TOL_EXACT_P = 5e-4`` (fp16 output rounding).
  The kernel's ``exp2`` and score rounding differ from the float64 reference by
  an ulp, which can move a P value across an E2M1/E4M3 rounding midpoint: such
  flips are bounded, not tolerated wholesale: at most ``max(1, 2%)`` of the rows
  may exceed the tight bound, and none may exceed ``LOOSE = 5e-2``.
- LSE: ``1e-5`` (float32 accumulation against float64).

A wrong quantization axis, a wrong block origin or a missing global scale moves
rows by 1e-2 to 1 (``test_tolerances_catch_mutations`` checks that for this data).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from calls import decode  # mla_triton.decode, with ``config`` forced through tuning.use

import mla_reference
from mla_formats import AttentionQuant, OperandQuant, qdq, qdq_factored
from mla_triton import tuning
from mla_triton.common import qdq as dev
from mla_triton.common.kernels import SPLIT_ALIGN
from mla_triton.common.splitk import (
    DecodeConfig,
    decode_num_splits,
    decode_workspace_size,
)

TOL_P_FP16 = 2.5e-3
TOL_EXACT_P = 5e-4
LOOSE = 5e-2
LSE_TOL = 1e-5
SCALE = 0.07
D = 576
LENS = [1, 15, 16, 17, 63, 64, 65, 200]  # 65 and 200 cross split bounds with 3 splits


def make_inputs(
    lens: list[int],
    heads: int,
    page: int,
    seed: int,
    *,
    spare_pages: int = 3,
    poison: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[B, H, 576]`` fp16, a shuffled paged cache, its block table and lengths.

    ``poison``: every page the block table does not reference, every slot past a
    sequence's end and every unused block-table entry's page hold NaN.
    """
    g = torch.Generator().manual_seed(seed)
    used = [-(-n // page) for n in lens]
    n_blocks = sum(used) + spare_pages
    cache = torch.randn(n_blocks, page, D, generator=g).half()
    perm = torch.randperm(n_blocks, generator=g)
    width = max([1, *used]) + 1
    table = torch.full((len(lens), width), n_blocks - 1, dtype=torch.int32)
    k = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[k : k + n]
        k += n
    if poison:
        referenced = torch.zeros(n_blocks, dtype=torch.bool)
        for b, (n, length) in enumerate(zip(used, lens, strict=False)):
            referenced[table[b, :n].long()] = True
            if length % page:
                cache[int(table[b, n - 1]), length % page :] = float("nan")
        cache[~referenced] = float("nan")
        table[:, -1] = int(perm[-1])  # unused entries point at a NaN page
    q = (torch.randn(len(lens), heads, D, generator=g) * 0.5).half()
    return q, cache, table, torch.tensor(lens, dtype=torch.int32)


def reference(
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    quant: AttentionQuant | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_reference.decode(q, cache, table, lens, softmax_scale=SCALE, quant=quant)


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    o, r = out.double(), ref.double()
    return (o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-3)


def p_quantized(quant: AttentionQuant | None) -> bool:
    return quant is not None and not quant.p.is_identity


def assert_matches(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    quant: AttentionQuant | None,
) -> None:
    """The module docstring's bounds; empty rows exactly 0 and -inf."""
    assert torch.isfinite(out).all()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty] == 0).all()
    full = ~empty
    assert (lse[full].double() - ref_lse[full].double()).abs().max().item() <= LSE_TOL
    err = row_errors(out[full], ref_out[full])
    if not p_quantized(quant):
        assert err.max().item() <= TOL_P_FP16, f"max row error {err.max().item():.3g}"
        return
    outliers = int((err > TOL_EXACT_P).sum())
    allowed = max(1, math.ceil(0.02 * err.numel()))
    assert outliers <= allowed, f"{outliers} rows above {TOL_EXACT_P} (allowed {allowed})"
    assert err.max().item() <= LOOSE, f"max row error {err.max().item():.3g}"


def run_and_check(
    lens: list[int],
    heads: int,
    page: int,
    quant: AttentionQuant | None,
    *,
    seed: int = 0,
    **kwargs: object,
) -> None:
    q, cache, table, seq = make_inputs(lens, heads, page, seed)
    out, lse = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, **kwargs)  # type: ignore[arg-type]
    assert out.shape == (len(lens), heads, 512) and out.dtype == q.dtype
    assert lse.shape == (len(lens), heads) and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    assert_matches(out, lse, ref_out, ref_lse, quant)


RECIPES = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
}


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_matches_reference_ragged(recipe: str, page: int) -> None:
    run_and_check(LENS, 4, page, RECIPES[recipe], num_splits=3)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("operand", ["q", "k", "p", "v"])
def test_each_operand_alone(operand: str, fmt: str) -> None:
    run_and_check([17, 65, 130], 4, 16, AttentionQuant(**{operand: fmt}), seed=1)


@pytest.mark.parametrize(
    ("k", "v"), [("nvfp4", "fp8"), ("fp8", "nvfp4"), ("none", "nvfp4"), ("nvfp4", "none")]
)
def test_k_and_v_formats_differ(k: str, v: str) -> None:
    quant = AttentionQuant(q="fp8", k=k, p="nvfp4", v=v)
    run_and_check([16, 63, 100], 4, 64, quant, seed=2)


AMAX_RECIPES = {
    "k_dynamic_nvfp4": AttentionQuant(q="nvfp4", k=OperandQuant("nvfp4", "dynamic")),
    "k_dynamic_fp8": AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="fp8"),
    "static_pow2": AttentionQuant(
        q=OperandQuant("nvfp4", 2688.0 * 2),
        k=OperandQuant("nvfp4", 2688.0 / 4),
        v=OperandQuant("nvfp4", 2688.0 * 8),
        p="nvfp4",
    ),
    "static_calibrated": AttentionQuant(
        q=OperandQuant("nvfp4", 12.0),
        k=OperandQuant("nvfp4", 100.0),
        v=OperandQuant("fp8", 5.0),
        p=OperandQuant("fp8", 1.5),
    ),
    "fp8_calibrated": AttentionQuant(
        q=OperandQuant("fp8", 3.0), k=OperandQuant("fp8", 5.0), v=OperandQuant("fp8", 5.0)
    ),
}


@pytest.mark.parametrize("recipe", list(AMAX_RECIPES))
def test_static_and_dynamic_amax(recipe: str) -> None:
    run_and_check([33, 64, 97], 4, 16, AMAX_RECIPES[recipe], seed=3)


@pytest.mark.parametrize("recipe", ["none", "nvfp4"])
def test_64_heads_per_program(recipe: str) -> None:
    """80 heads: two head groups of 64, the second partly masked."""
    run_and_check([40, 130], 80, 64, RECIPES[recipe], seed=4, num_splits=2)


def test_one_head_and_query_pair() -> None:
    q, cache, table, seq = make_inputs([5, 70], 1, 16, seed=5)
    quant = AttentionQuant.uniform("nvfp4")
    pair = (q[..., :512], q[..., 512:].contiguous())
    out, lse = decode(pair, cache, table, seq, softmax_scale=SCALE, quant=quant)
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    assert_matches(out, lse, ref_out, ref_lse, quant)
    out2, lse2 = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize(
    "config",
    [
        DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2),
        DecodeConfig(block_h=32, block_n=64, num_warps=4, num_stages=2),
        DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=4),
    ],
    ids=["bn16", "bn64-bh32", "bn32-4-stages"],
)
def test_tile_configs(config: DecodeConfig) -> None:
    """Other tiles compute the same thing."""
    run_and_check([15, 64, 81], 4, 16, AttentionQuant.uniform("nvfp4"), seed=6, config=config)


def test_strided_cache_view() -> None:
    """A cache that is a view of a larger buffer: page and row strides from the tensor."""
    q, cache, table, seq = make_inputs([31, 77], 4, 16, seed=7)
    big = torch.full((cache.shape[0], 3, 16, 640), float("nan"), dtype=cache.dtype)
    big[:, 1, :, :D] = cache
    view = big[:, 1, :, :D]
    assert view.stride() == (3 * 16 * 640, 640, 1)
    quant = AttentionQuant.uniform("nvfp4")
    out, lse = decode(q, view, table, seq, softmax_scale=SCALE, quant=quant)
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    assert_matches(out, lse, ref_out, ref_lse, quant)


@pytest.mark.parametrize("recipe", ["none", "nvfp4"])
def test_split_invariance(recipe: str) -> None:
    """1 split against 7: equal up to float32 summation order (docs/numerics.md
    "Softmax, P and schedule invariance").

    Every rescale is a power of two, so P̂ and the partial sums only differ by the
    order of float32 additions (and P codes that an ulp moves across a midpoint,
    bounded as against the reference): out rows within one fp16 ulp-ish, LSE 1e-6.
    With 7 splits (64-token chunks): 393 tokens fill all 7, the last a 9-token tail;
    172 fill 3 (the last one tile and a 12-token tail) and leave 4 empty; 1 token
    one split.
    """
    quant = RECIPES[recipe]
    q, cache, table, seq = make_inputs([1, 172, 393], 4, 64, seed=8)
    one = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=1)
    many = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=7)
    assert (one[1] - many[1]).abs().max().item() <= 1e-6
    err = row_errors(many[0], one[0])
    assert int((err > 1e-3).sum()) <= 1
    assert err.max().item() <= LOOSE


def test_batch_invariance() -> None:
    """A request's result does not depend on the rest of the batch.

    Request 1 (172 tokens, 4 splits of 64: three active, the last one tile and a
    12-token tail, and one empty split) beside a 2-split request, a 1-tile one
    and one of its own length.
    """
    quant = AttentionQuant.uniform("nvfp4")
    q, cache, table, seq = make_inputs([90, 172, 5, 172], 4, 16, seed=9)
    full = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=4)
    # request 1 alone, and with different neighbours at another position
    alone = decode(
        q[1:2], cache, table[1:2], seq[1:2], softmax_scale=SCALE, quant=quant, num_splits=4
    )
    order = torch.tensor([2, 3, 1])
    mixed = decode(
        q[order], cache, table[order], seq[order], softmax_scale=SCALE, quant=quant, num_splits=4
    )
    for got in (alone[0][0], mixed[0][2]):
        assert torch.equal(got, full[0][1])
    for got in (alone[1][0], mixed[1][2]):
        assert torch.equal(got, full[1][1])
    # requests 1 and 3 are identical in length and differ in data: not mixed up
    assert not torch.equal(full[0][1], full[0][3])
    # the automatic policy picks splits from the batch size: same result up to summation order
    auto_one = decode(q[1:2], cache, table[1:2], seq[1:2], softmax_scale=SCALE, quant=quant)
    auto_all = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant)
    assert (auto_one[1][0] - auto_all[1][1]).abs().max().item() <= 1e-6
    assert row_errors(auto_one[0][0], auto_all[0][1]).max().item() <= LOOSE


@pytest.mark.parametrize("recipe", ["none", "nvfp4"])
def test_poisoned_memory(recipe: str) -> None:
    """NaN in unreferenced pages, past sequence ends and in every output buffer."""
    quant = RECIPES[recipe]
    lens = [0, 17, 65, 130]
    clean = make_inputs(lens, 4, 16, seed=10)
    q, cache, table, seq = make_inputs(lens, 4, 16, seed=10, poison=True)
    assert torch.isnan(cache).any()
    want = decode(*clean, softmax_scale=SCALE, quant=quant, num_splits=3)
    splits = 3
    ws = torch.full((decode_workspace_size(4, 4, 130, num_splits=splits) // 4,), float("nan"))
    out = torch.full((4, 4, 512), float("nan"), dtype=torch.float16)
    lse = torch.full((4, 4), float("nan"))
    got = decode(
        q,
        cache,
        table,
        seq,
        softmax_scale=SCALE,
        quant=quant,
        num_splits=splits,
        workspace=ws,
        out=out,
        lse=lse,
    )
    assert got[0] is out and got[1] is lse
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert (out[0] == 0).all() and torch.isinf(lse[0]).all() and (lse[0] < 0).all()


def test_direct_write_poisoned_outputs() -> None:
    """One split writes out and lse directly: NaN-prefilled buffers are overwritten."""
    q, cache, table, seq = make_inputs([0, 40], 20, 64, seed=11)
    out = torch.full((2, 20, 512), float("nan"), dtype=torch.float16)
    lse = torch.full((2, 20), float("nan"))
    decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=1, out=out, lse=lse)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()


def test_empty_batch_and_empty_rows() -> None:
    q, cache, table, seq = make_inputs([3], 4, 16, seed=12)
    out, lse = decode(q[:0], cache, table[:0], seq[:0], softmax_scale=SCALE)
    assert out.shape == (0, 4, 512) and lse.shape == (0, 4)
    out, lse = decode(
        q,
        cache,
        table,
        torch.zeros(1, dtype=torch.int32),
        softmax_scale=SCALE,
        quant=AttentionQuant.uniform("nvfp4"),
    )
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_tolerances_catch_mutations() -> None:
    """A wrong V block origin, a wrong P axis or a missing scale exceed the bounds."""
    quant = AttentionQuant.uniform("nvfp4")
    q, cache, table, seq = make_inputs([70, 130], 4, 16, seed=13)
    dbg: dict[str, object] = {}
    ref_out, _ = mla_reference.decode(
        q, cache, table, seq, softmax_scale=SCALE, quant=quant, debug=dbg
    )
    out, _ = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant)
    assert row_errors(out, ref_out).max().item() <= LOOSE
    ps, ls = dbg["p"], dbg["l"]
    assert isinstance(ps, list) and isinstance(ls, list)
    for b, length in enumerate(seq.tolist()):
        latent = mla_reference.gather_latent(cache, table[b].tolist(), length, 16)[:, :512]
        shifted = qdq(latent.float(), "nvfp4", axis=0, offset=8, pad=True).double()
        wrong_axis = qdq(latent.float(), "nvfp4", axis=1).double()
        good = qdq(latent.float(), "nvfp4", axis=0, pad=True).double()
        p_wrong_axis = qdq(ps[b].float(), "nvfp4", axis=0, amax=1.0, pad=True).double()
        for mutant in (
            ps[b] @ shifted / ls[b][:, None],
            ps[b] @ wrong_axis / ls[b][:, None],
            p_wrong_axis @ good / ls[b][:, None],
            ps[b] @ good / ls[b][:, None] * 1.0625,  # a global scale off by 1/16
        ):
            assert row_errors(mutant, ref_out[b]).median().item() > 5 * TOL_P_FP16


# ------------------------------------------------------------------ policy, workspace


def _fills(programs: int, splits: int, sms: int = 132) -> bool:
    """The documented goal: whole waves at least 90% full, a single wave included."""
    total = programs * splits
    return total >= 0.9 * -(-total // sms) * sms


@pytest.mark.parametrize("batch", [1, 3, 8, 64, 128])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("length", [100, 4096, 32768, 131072])
def test_split_policy_takes_the_fewest_splits_that_fill_the_gpu(
    batch: int, heads: int, length: int
) -> None:
    """The docstring's rule, checked against a brute force of it (132 SMs off-GPU)."""
    programs = batch * (-(-heads // 64) if heads > 32 else 1)  # 64 heads a program, or all
    cap = max(1, min(64, length // 256))  # every split at least 256 tokens long
    s = decode_num_splits(batch, heads, length)
    assert 1 <= s <= cap
    want = next((n for n in range(1, cap + 1) if _fills(programs, n)), cap)
    assert s == want, (s, want)
    assert decode_num_splits(batch, heads, length, device=torch.device("cpu")) == s
    assert SPLIT_ALIGN % 16 == 0


@pytest.mark.parametrize(
    ("batch", "heads", "length", "splits"),
    [
        (8, 128, 32768, 8),  # 128 programs, one wave (1.04x FlashMLA; 15 splits 0.84x)
        (32, 128, 32768, 2),  # 128 programs (0.98x; 4 splits 0.95x)
        (128, 16, 8192, 1),  # 128 programs (1.07x; 2 splits 1.04x)
        (128, 128, 8192, 1),  # 256 programs, two full waves
        (1, 128, 32768, 60),  # 2 programs: 120 of 132 SMs
        (4, 128, 32768, 15),  # 8 programs: 120
        (2, 128, 32768, 30),  # 4 programs: 120
    ],
)
def test_split_policy_measured_shapes(batch: int, heads: int, length: int, splits: int) -> None:
    """The split counts the H200's measurements chose (132 SMs; docs/benchmarks.md):
    one wave of 128 programs is taken, not two waves of 240."""
    assert decode_num_splits(batch, heads, length) == splits


def test_workspace_size_covers_every_batch() -> None:
    size = decode_workspace_size(64, 16, 4096)
    for b in (1, 7, 64):
        splits = decode_num_splits(b, 16, 4096)
        partials = b * splits * 16 * (512 + 2) * 4 if splits > 1 else 0
        assert partials + b * 16 * (576 * 2 + 4) <= size
    one = decode_workspace_size(4, 8, 100, num_splits=1)
    assert 4 * 8 * (576 * 2 + 4) <= one < 4 * 8 * (576 * 2 + 4) + 1024
    three = decode_workspace_size(4, 8, 100, num_splits=3)
    assert three - one >= 4 * 3 * 8 * 514 * 4
    # a quantized-q decode with the largest batch fits the size the function gives
    q, cache, table, seq = make_inputs([40] * 4, 8, 16, seed=17)
    ws = torch.empty(three, dtype=torch.uint8)
    got = decode(
        q,
        cache,
        table,
        seq,
        softmax_scale=SCALE,
        num_splits=3,
        workspace=ws,
        quant=AttentionQuant.uniform("nvfp4"),
    )
    want = decode(
        q,
        cache,
        table,
        seq,
        softmax_scale=SCALE,
        num_splits=3,
        quant=AttentionQuant.uniform("nvfp4"),
    )
    assert torch.equal(got[0], want[0])


def test_preallocated_workspace_is_used() -> None:
    q, cache, table, seq = make_inputs([50, 120], 4, 16, seed=14)
    size = decode_workspace_size(2, 4, 128, num_splits=5)
    ws = torch.zeros(size, dtype=torch.uint8)
    got = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=5, workspace=ws)
    assert ws.any()
    want = decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=5)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="workspace"):
        decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=5, workspace=ws[:100])


# ------------------------------------------------------------------ validation


def _bad_calls() -> list[tuple[str, dict[str, object]]]:
    q, cache, table, seq = make_inputs([5, 20], 4, 16, seed=15)
    base: dict[str, object] = {
        "q": q,
        "kv_cache": cache,
        "block_table": table,
        "seq_lens": seq,
        "softmax_scale": SCALE,
    }
    cases: list[tuple[str, dict[str, object]]] = [
        ("q", {"q": q.float()}),
        ("q", {"q": q[..., :560]}),
        ("q", {"q": q[:, :0]}),
        ("q", {"q": q.transpose(1, 2).contiguous().transpose(1, 2)}),
        ("q", {"q": q[0]}),
        ("q\\[1\\]", {"q": (q[..., :512], q[:1, :, 512:])}),
        ("q\\[0\\]", {"q": (q[..., :256], q[..., 512:])}),
        ("kv_cache", {"kv_cache": cache.float()}),
        ("kv_cache", {"kv_cache": cache[..., :512]}),
        ("kv_cache", {"kv_cache": cache[0]}),
        ("kv_cache", {"kv_cache": cache.transpose(1, 2).contiguous().transpose(1, 2)}),
        ("block_table", {"block_table": table.float()}),
        ("block_table", {"block_table": table[:1]}),
        ("block_table", {"block_table": torch.full_like(table, 10_000)}),
        ("seq_lens", {"seq_lens": seq[:1]}),
        ("seq_lens", {"seq_lens": seq.float()}),
        ("seq_lens", {"seq_lens": torch.tensor([5, 10_000], dtype=torch.int32)}),
        ("seq_lens", {"seq_lens": torch.tensor([-1, 5], dtype=torch.int32)}),
        ("softmax_scale", {"softmax_scale": 0.0}),
        ("softmax_scale", {"softmax_scale": float("nan")}),
        ("kv_lora_rank", {"kv_lora_rank": 500}),
        ("quant", {"quant": "nvfp4"}),
        ("num_splits", {"num_splits": 0}),
        ("max_seq_len", {"max_seq_len": 10_000}),
        ("out", {"out": torch.empty(2, 4, 512)}),
        ("lse", {"lse": torch.empty(2, 4, dtype=torch.float16)}),
    ]
    return [(name, {**base, **change}) for name, change in cases]


@pytest.mark.parametrize(("argument", "kwargs"), _bad_calls())
def test_validation(argument: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{argument}"):
        decode(**kwargs)  # type: ignore[arg-type]


def test_tuning_rejects_unknown_implementation() -> None:
    """A forced implementation that does not exist is refused naming ``impl``."""
    q, cache, table, seq = make_inputs([5], 4, 16, seed=15)
    with pytest.raises(ValueError, match=r"^impl"), tuning.use("fast"):
        decode(q, cache, table, seq, softmax_scale=SCALE)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="block_n"):
        DecodeConfig(block_h=64, block_n=128, num_warps=8, num_stages=2)


# ------------------------------------------------------------------ fast QDQ device functions


@triton.jit
def _fast_nvfp4_kernel(
    x_ptr, y_ptr, gs, inv_6gs, ROWS: tl.constexpr, COLS: tl.constexpr, ALONG_ROWS: tl.constexpr
):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offs).to(tl.float32)
    y = dev.nvfp4_qdq_fast(x, gs, inv_6gs, ROWS, COLS, 1 if ALONG_ROWS else 0, False, True)
    tl.store(y_ptr + offs, y)


@pytest.mark.parametrize("amax", [2688.0, 2688.0 * 8, 2688.0 / 64])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("along_rows", [True, False])
def test_fast_nvfp4_is_bit_exact_for_16_bit_input(
    amax: float, dtype: torch.dtype, along_rows: bool
) -> None:
    """The on-read fast form equals mla_formats for 16-bit data and power-of-two scales,
    exact ties (values equal to a midpoint times a block scale) included."""
    g = torch.Generator().manual_seed(16)
    rows, cols = 64, 128
    gs = amax / 2688.0
    x = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-8, 6, (rows, 1), generator=g).float()
    )
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    scales = torch.tensor([1.0, 1.5, 0.875, 3.0, 0.3125, 13.0, 2.0**-7, 448.0])
    ties = (
        mids[torch.randint(0, 8, (rows, cols), generator=g)]
        * scales[torch.randint(0, 8, (rows, cols), generator=g)]
        * gs
    )
    x = torch.where(torch.rand(rows, cols, generator=g) < 0.5, ties, x).to(dtype).float()
    x[5] = 0.0
    y = torch.empty_like(x)
    _fast_nvfp4_kernel[(1,)](x, y, gs, 1.0 / (6.0 * gs), rows, cols, along_rows)
    want, _ = qdq_factored(x, "nvfp4", axis=1 if along_rows else 0, amax=amax)
    assert torch.equal(y, want)
