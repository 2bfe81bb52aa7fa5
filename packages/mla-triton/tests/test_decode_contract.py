"""The input contract of ``decode``, ``decode_shadow`` and ``update_cache``.

CPU, Triton interpreter, small latent widths (kv_lora_rank 32 + rope 16) so each
case takes a fraction of a second. What is checked, against ``mla_reference``:

- the NaN rule (docs/numerics.md "Non-finite input"): exactly the rows the oracle
  poisons are NaN, in every feature, and the LSE is NaN exactly where the oracle's
  is; every other row matches the oracle;
- memory safety without value checks: an out-of-range block id or sequence length
  poisons that request alone (NaN out and LSE) and reads nothing outside the cache
  or outside the request's ``block_table`` row; ``update_cache`` skips slots outside
  the cache; duplicates are refused when checked;
- the shadow is self-describing: read or written with another recipe, refused;
- bfloat16 under the interpreter computes correctly (float32 inside);
- property tests: random shapes, strides, lengths, splits, recipes and one
  optional defect; either a ``ValueError`` naming the argument before any kernel
  launch, or the oracle's result.

``MLA_CONTRACT_DEVICE=cuda`` runs the same cases on a GPU (compiled kernels, the
hardware fp8 conversion); the oracle runs on the CPU. ``MLA_CONTRACT_IMPL=gluon`` (with
``cuda``, on an sm90 GPU) forces the Gluon split kernel (``tuning.use("gluon")``) at the
widths it takes (kv_lora_rank 512 + rope 64) on the recipes it implements (none, fp8),
for ``decode`` and for ``decode_shadow`` (fp16 shadows of those recipes);
``MLA_CONTRACT_IMPL=gluon_ws`` the warp-specialized Gluon kernel, on recipe none. The
shadow's own tests (``update_cache``, the recipe stamp, nvfp4) are skipped in those modes.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
from calls import decode, decode_shadow  # the public calls, ``impl`` forced (tuning.use)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_reference
from mla_formats import AttentionQuant, OperandQuant
from mla_triton import allocate_shadow, update_cache
from mla_triton.ops.decode.triton import OnRead
from mla_triton.ops.shadow import _ShadowFamily

# The interpreter computes with numpy, which warns on NaN and inf arithmetic (a GPU does not).
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

DEVICE = torch.device(os.environ.get("MLA_CONTRACT_DEVICE", "cpu"))
IMPL = os.environ.get("MLA_CONTRACT_IMPL", "triton")  # "triton", "gluon" or "gluon_ws"
GLUON = IMPL in ("gluon", "gluon_ws")
if IMPL not in ("triton", "gluon", "gluon_ws") or (GLUON and DEVICE.type != "cuda"):
    raise ValueError(
        f"MLA_CONTRACT_IMPL={IMPL!r}: 'triton', or 'gluon'/'gluon_ws' with MLA_CONTRACT_DEVICE=cuda"
    )
R, ROPE = (512, 64) if GLUON else (32, 16)  # latent and rope widths (Gluon: DeepSeek's only)
D = R + ROPE
SCALE = 0.2
ROW_TOL = 5e-2  # finite rows: the loose bound of test_decode (a P flip at most)

splitk_module = importlib.import_module("mla_triton.common.splitk")  # stages 0 and 2
shadow_module = importlib.import_module("mla_triton.ops.shadow")
gluon_module = importlib.import_module("mla_triton.ops.decode.gluon")

RECIPES: dict[str, AttentionQuant] = {
    "none": AttentionQuant(),
    "fp8": AttentionQuant(q="fp8", k="fp8", v="fp8", p="fp8"),
    "nvfp4": AttentionQuant(q="nvfp4", k="nvfp4", v="nvfp4", p="nvfp4"),
    "nvfp4_kdyn": AttentionQuant(q="nvfp4", k=OperandQuant("nvfp4", "dynamic"), v="nvfp4"),
}
if GLUON:  # the recipes the Gluon kernels implement
    RECIPES = {k: RECIPES[k] for k in (("none", "fp8") if IMPL == "gluon" else ("none",))}
PATHS = ["decode", "shadow"]
QUANTIZED = {"triton": "nvfp4", "gluon": "fp8", "gluon_ws": "none"}[IMPL]  # single-recipe tests
shadow_only = pytest.mark.skipif(
    GLUON, reason="MLA_CONTRACT_IMPL=gluon: update_cache and nvfp4 shadows are Triton's"
)


def make_case(
    lens: list[int], heads: int, page: int, seed: int, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q ``[B, H, D]``, a shuffled paged cache with one spare page, table, lengths."""
    g = torch.Generator().manual_seed(seed)
    used = [max(1, -(-n // page)) for n in lens]
    n_blocks = sum(used) + 1
    cache = torch.randn(n_blocks, page, D, generator=g).to(dtype)
    perm = torch.randperm(n_blocks, generator=g)
    table = torch.zeros(len(lens), max([1, *used]), dtype=torch.int32)
    k = 0
    for b, n in enumerate(used):
        table[b, :n] = perm[k : k + n]
        k += n
    q = (torch.randn(len(lens), heads, D, generator=g) * 0.7).to(dtype)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return q.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), lens_t.to(DEVICE)


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    quant: AttentionQuant,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = mla_reference.decode(
        q.cpu(), cache.cpu(), table.cpu(), lens.cpu(), softmax_scale=SCALE, kv_lora_rank=R,
        quant=quant,
    )  # fmt: skip
    return out.to(DEVICE), lse.to(DEVICE)


def write_shadow(cache: torch.Tensor, quant: AttentionQuant, storage: str = "fp16") -> torch.Tensor:
    """A shadow of every slot of ``cache``, written by ``update_cache`` (rows unchanged)."""
    shadow = allocate_shadow(
        cache.shape[0], cache.shape[1], quant, kv_lora_rank=R, rope_dim=ROPE, storage=storage,
        device=cache.device,
    )  # fmt: skip
    rows = cache.reshape(-1, D).clone()
    slots = torch.arange(rows.shape[0], dtype=torch.int64, device=cache.device)
    update_cache(rows[:, :R], rows[:, R:], cache, slots, shadow, quant=quant, storage=storage)
    return shadow


def run(
    path: str,
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    quant: AttentionQuant,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-read ``decode`` or ``decode_shadow`` over a freshly written shadow."""
    if path == "decode":
        return decode(q, cache, table, lens, softmax_scale=SCALE, kv_lora_rank=R, quant=quant,
                      impl=IMPL, **kwargs)  # fmt: skip
    shadow = write_shadow(cache, quant)
    return decode_shadow(q, cache, shadow, table, lens, softmax_scale=SCALE, kv_lora_rank=R,
                         quant=quant, impl=IMPL, **kwargs)  # fmt: skip


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    o, r = out.double(), ref.double()
    return (o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-3)


def assert_like_oracle(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor
) -> None:
    """NaN rows and NaN LSEs exactly the oracle's, NaN rows NaN throughout, others close."""
    want = ref_out.isnan().any(-1)
    got = out.isnan().any(-1)
    assert torch.equal(got, want), f"NaN rows {got.nonzero().tolist()} != {want.nonzero().tolist()}"
    assert torch.equal(out.isnan().all(-1), got), "a poisoned row has finite features"
    assert torch.equal(lse.isnan(), ref_lse.isnan()), "NaN LSEs differ from the oracle's"
    fine = ~want
    assert torch.isfinite(out[fine]).all(), "a row the rule leaves alone is not finite"
    err = row_errors(out[fine], ref_out[fine])
    assert err.numel() == 0 or float(err.max()) < ROW_TOL, float(err.max())
    lse_fine = ~ref_lse.isnan() & torch.isfinite(ref_lse)
    assert torch.allclose(lse[lse_fine], ref_lse[lse_fine].float(), atol=1e-3)


# ---------------------------------------------------------------------------- NaN rule

SITES = ["q", "latent", "rope"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_poisons_exactly_the_rows_that_read_it(
    path: str, recipe: str, site: str, value: float
) -> None:
    """One non-finite element: the rows that read it are NaN, nothing else changes."""
    quant = RECIPES[recipe]
    lens = [40, 37, 0]
    q, cache, table, seq = make_case(lens, 3, 16, seed=hash((site, recipe)) % 1000)
    if site == "q":
        q[1, 2, 5] = value  # request 1, head 2
    else:
        t = 20  # token 20 of request 0
        feature = 3 if site == "latent" else R + 2
        cache[int(table[0, t // 16]), t % 16, feature] = value
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    assert ref_out.isnan().any(), "the case must poison something"
    for splits in (1, 2):
        out, lse = run(path, q, cache, table, seq, quant, num_splits=splits)
        assert_like_oracle(out, lse, ref_out, ref_lse)


def test_unread_non_finite_memory_never_poisons() -> None:
    """NaN in slots past each sequence's end and in unreferenced pages: all rows finite."""
    q, cache, table, seq = make_case([17, 33], 2, 16, seed=5)
    used = set(table.flatten().tolist())
    for blk in range(cache.shape[0]):
        if blk not in used:
            cache[blk] = float("nan")
    cache[int(table[0, 1]), 1:] = float("nan")  # past token 17
    cache[int(table[1, 2]), 1:] = float("nan")  # past token 33
    for recipe in ("none", QUANTIZED):
        for path in PATHS:
            out, lse = run(path, q, cache, table, seq, RECIPES[recipe], num_splits=2)
            assert torch.isfinite(out).all() and torch.isfinite(lse).all(), (recipe, path)


# ------------------------------------------------------------------- memory safety


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("bad", ["page_negative", "page_past_end", "len_negative", "len_past"])
def test_out_of_range_index_poisons_its_request_only(path: str, page: int, bad: str) -> None:
    """Unchecked bad indices: that request's out and LSE NaN, the others the oracle's."""
    quant = RECIPES[QUANTIZED]
    lens = [50, 70, 20]
    q, cache, table, seq = make_case(lens, 2, page, seed=11)
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    if bad == "page_negative":
        table[1, 0] = -7
    elif bad == "page_past_end":
        table[1, 1] = cache.shape[0] + 10**6
    elif bad == "len_negative":
        seq[1] = -3
    else:
        seq[1] = table.shape[1] * page + 1
    for splits in (1, 3):
        out, lse = run(path, q, cache, table, seq, quant, num_splits=splits, check_values=False)
        assert out[1].isnan().all() and lse[1].isnan().all(), (bad, splits)
        keep = [0, 2]
        assert torch.isfinite(out[keep]).all()
        assert float(row_errors(out[keep], ref_out[keep]).max()) < ROW_TOL
        assert torch.allclose(lse[keep], ref_lse[keep].float(), atol=1e-3)
    name = "block_table" if bad.startswith("page") else "seq_lens"
    with pytest.raises(ValueError, match=f"^{name}: "):  # checked on the host
        run(path, q, cache, table, seq, quant, check_values=True)


def case_past_the_row(
    page: int, past: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three requests, request 0 filling its ``W``-column row exactly, request 1 claiming
    ``past`` tokens beyond its row; ``block_table`` is ``big[:, :W]`` of a wider int32
    tensor whose other columns hold the id of a page of huge values, a page no request
    references within its length.

    Returns ``(q, cache, table, seq, clean)``: ``seq`` with the bad length, ``clean`` the
    lengths as made (request 1 within its row)."""
    w = 3
    lens = [w * page, 2 * page + 5, page - 3]
    q, cache, table, seq = make_case(lens, 2, page, seed)
    assert table.shape[1] == w
    huge = torch.full((1, page, D), 1e4, dtype=cache.dtype, device=DEVICE)
    cache = torch.cat([cache, huge])  # the last page: huge values
    big = torch.full((len(lens), 4 * w), cache.shape[0] - 1, dtype=torch.int32, device=DEVICE)
    big[:, :w] = table
    bad = seq.clone()
    bad[1] = w * page + past
    return q, cache, big[:, :w], bad, seq


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("page", [16, 32])
@pytest.mark.parametrize("far", [False, True], ids=["one-token-past", "past-the-wide-tensor-row"])
def test_seq_len_beyond_the_table_row_reads_nothing_past_it(
    path: str, page: int, far: bool
) -> None:
    """A length beyond ``block_table``'s width times the page size: refused naming
    ``seq_lens`` when values are checked (the default for CPU tensors); unchecked, that
    request's out and LSE NaN and the other requests bit-identical to the same call
    without it, so nothing was read past the row (the columns there name a page of
    huge values that would change any result that read it)."""
    quant = RECIPES[QUANTIZED]
    past = 4 * 3 * page + 5 if far else 1  # far: beyond the wide tensor's row too
    q, cache, table, seq, _ = case_past_the_row(page, past, seed=13)
    assert table.stride(0) == 4 * table.shape[1], "the table must be a column slice"
    keep = [0, 2]
    for splits in (1, 3):
        out, lse = run(path, q, cache, table, seq, quant, num_splits=splits, check_values=False)
        assert out[1].isnan().all() and lse[1].isnan().all(), splits
        want_out, want_lse = run(path, q[keep], cache, table[keep], seq[keep], quant,
                                 num_splits=splits, check_values=False)  # fmt: skip
        assert torch.equal(out[keep], want_out) and torch.equal(lse[keep], want_lse), splits
        assert torch.isfinite(want_out).all() and torch.isfinite(want_lse).all()
    ref_out, ref_lse = reference(q[keep], cache, table[keep], seq[keep], quant)
    assert float(row_errors(out[keep], ref_out).max()) < ROW_TOL
    assert torch.allclose(lse[keep], ref_lse.float(), atol=1e-3)
    with pytest.raises(ValueError, match=r"^seq_lens: "):
        run(path, q, cache, table, seq, quant, check_values=True)
    if DEVICE.type == "cpu":  # unset, values are checked for CPU tensors
        with pytest.raises(ValueError, match=r"^seq_lens: "):
            run(path, q, cache, table, seq, quant)


def test_seq_len_within_the_row_reads_the_row() -> None:
    """The control of the case above: the same table with request 1 within its row
    matches the oracle, so the huge page is referenced only past the lengths."""
    quant = RECIPES[QUANTIZED]
    q, cache, table, _, seq = case_past_the_row(16, 1, seed=13)
    out, lse = run("decode", q, cache, table, seq, quant, num_splits=3)
    assert_like_oracle(out, lse, *reference(q, cache, table, seq, quant))


@shadow_only
def test_update_cache_skips_slots_outside_the_cache_and_refuses_duplicates() -> None:
    quant = RECIPES["nvfp4"]
    _, cache, _, _ = make_case([32], 1, 16, seed=3)
    shadow = write_shadow(cache, quant)
    before = (cache.clone(), shadow.clone())
    rows = torch.randn(3, D).half().to(DEVICE)
    cap = cache.shape[0] * cache.shape[1]
    slots = torch.tensor([cap + 5, -1, 10**9], dtype=torch.int64, device=DEVICE)
    update_cache(rows[:, :R], rows[:, R:], cache, slots, shadow, quant=quant, check_values=False)
    assert torch.equal(cache, before[0]) and torch.equal(shadow, before[1])
    with pytest.raises(ValueError, match=r"^slot_mapping: entry 0 is"):
        update_cache(rows[:, :R], rows[:, R:], cache, slots, shadow, quant=quant, check_values=True)
    dup = torch.tensor([4, 9, 4], dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"^slot_mapping: slot 4 appears more than once"):
        update_cache(rows[:, :R], rows[:, R:], cache, dup, shadow, quant=quant, check_values=True)
    assert torch.equal(cache, before[0]), "a refused call wrote something"


# ------------------------------------------------------------------ shadow recipe


@shadow_only
def test_shadow_read_or_written_with_another_recipe_is_refused() -> None:
    written = AttentionQuant(q="fp8", k=OperandQuant("fp8", 448.0), v="fp8", p="fp8")
    # the same layout shape (fp8 K and V sharing one scale), another scale: 224, not 448
    other = AttentionQuant(
        q="fp8", k=OperandQuant("fp8", 224.0), v=OperandQuant("fp8", 224.0), p="fp8"
    )
    q, cache, table, seq = make_case([30], 2, 16, seed=4)
    shadow = write_shadow(cache, written)
    with pytest.raises(ValueError, match=r"^quant: this shadow holds"):
        decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE, kv_lora_rank=R,
                      quant=other)  # fmt: skip
    rows = cache[0, :1].reshape(1, D).clone()
    slot = torch.tensor([0], device=DEVICE)
    with pytest.raises(ValueError, match=r"^quant: this shadow holds"):
        update_cache(rows[:, :R], rows[:, R:], cache, slot, shadow, quant=other)
    # q and p do not enter the shadow: another q or p recipe reads it
    same_kv = AttentionQuant(q="nvfp4", k=OperandQuant("fp8", 448.0), v="fp8")
    out, _ = decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE, kv_lora_rank=R,
                           quant=same_kv)  # fmt: skip
    ref, _ = reference(q, cache, table, seq, same_kv)
    assert float(row_errors(out, ref).max()) < ROW_TOL


# ------------------------------------------------------------------ bf16 interpreter


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("recipe", [r for r in ("none", "fp8", "nvfp4") if r in RECIPES])
def test_bfloat16_under_the_interpreter_is_correct(path: str, recipe: str) -> None:
    """bf16 in, bf16 out: rows within bf16 output rounding of the oracle (not 1e9)."""
    quant = RECIPES[recipe]
    q, cache, table, seq = make_case([45, 16], 4, 16, seed=8, dtype=torch.bfloat16)
    out, lse = run(path, q, cache, table, seq, quant, num_splits=2)
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    assert out.dtype == torch.bfloat16
    assert float(row_errors(out, ref_out).max()) < 1e-2
    assert torch.allclose(lse, ref_lse.float(), atol=1e-3)


@shadow_only
def test_update_cache_bfloat16_under_the_interpreter_matches_torch() -> None:
    """Raw rows cast as torch casts them; K̂ the oracle's QDQ of those rows."""
    quant = RECIPES["fp8"]
    _, cache, _, _ = make_case([16], 1, 16, seed=9, dtype=torch.bfloat16)
    shadow = allocate_shadow(
        cache.shape[0], 16, quant, kv_lora_rank=R, rope_dim=ROPE, device=DEVICE
    )
    rows = torch.randn(16, D).to(DEVICE)  # float32: the cache rounds them to bf16
    slots = torch.arange(16, dtype=torch.int64, device=DEVICE)
    update_cache(rows[:, :R], rows[:, R:], cache, slots, shadow, quant=quant)
    assert torch.equal(cache.reshape(-1, D)[:16], rows.to(torch.bfloat16))
    lay = shadow_module.shadow_layout(quant, kv_lora_rank=R, rope_dim=ROPE)
    k_hat = lay.views(shadow)[0]
    assert k_hat is not None
    from mla_formats import qdq_factored

    want, _ = qdq_factored(rows.to(torch.bfloat16).float().cpu(), "fp8", axis=-1)
    assert torch.equal(k_hat.reshape(-1, D)[:16].float().cpu(), want)


# ------------------------------------------------------------------ property tests


@contextmanager
def launches() -> Iterator[list[str]]:
    """Record the names of the kernels launched by decode and decode_shadow."""
    seen: list[str] = []

    class Spy:
        def __init__(self, name: str, kernel: Any) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid: Any) -> Callable[..., Any]:
            seen.append(self.name)
            return self.kernel[grid]  # type: ignore[no-any-return]

    patches = [
        mock.patch.object(splitk_module, name, Spy(name, getattr(splitk_module, name)))
        for name in ("decode_q_kernel", "decode_merge_kernel")
    ]
    # the split kernels are attributes of their families (on read, shadow)
    patches += [
        mock.patch.object(family, "kernel", Spy(name, family.kernel))
        for family, name in ((OnRead, "decode_split_kernel"),
                             (_ShadowFamily, "shadow_decode_split_kernel"))
    ]  # fmt: skip
    by_name = gluon_module._ByName
    gluon_launch = by_name.__getitem__

    def gluon_spy(self: Any, grid: Any) -> Any:  # both Gluon kernels launch through _ByName
        seen.append("gluon kernel")
        return gluon_launch(self, grid)

    patches.append(mock.patch.object(by_name, "__getitem__", gluon_spy))
    for p in patches:
        p.start()
    try:
        yield seen
    finally:
        for p in patches:
            p.stop()


DEFECTS: dict[str, str] = {
    "": "",
    "q_fp32": "q",
    "q_rank": "q",
    "cache_dtype": "kv_cache",
    "cache_width": "kv_cache",
    "table_float": "block_table",
    "table_rows": "block_table",
    "table_page": "block_table",
    "lens_rows": "seq_lens",
    "lens_negative": "seq_lens",
    "scale": "softmax_scale",
    "splits": "num_splits",
    "rank": "kv_lora_rank",
}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lens=st.lists(st.integers(0, 70), min_size=0, max_size=3),
    heads=st.integers(1, 5),
    page=st.sampled_from([16, 32]),
    recipe=st.sampled_from(list(RECIPES)),
    splits=st.sampled_from([None, 1, 2, 3]),
    strided=st.booleans(),
    path=st.sampled_from(PATHS),
    defect=st.sampled_from(list(DEFECTS)),
    seed=st.integers(0, 2**16),
)
def test_decode_property(
    lens: list[int],
    heads: int,
    page: int,
    recipe: str,
    splits: int | None,
    strided: bool,
    path: str,
    defect: str,
    seed: int,
) -> None:
    """Either a ValueError naming the argument and no launch, or the oracle's result."""
    quant = RECIPES[recipe]
    q, cache, table, seq = make_case(lens, heads, page, seed)
    if strided:  # q as a view with a head stride of 2 * D
        q = torch.stack([q, torch.zeros_like(q)], 2).reshape(q.shape[0], 2 * heads, D)[:, ::2]
    ref = reference(q, cache, table, seq, quant) if not defect else None
    kwargs: dict[str, Any] = {"num_splits": splits}
    scale: Any = SCALE
    rank: Any = R
    if defect == "q_fp32":
        q = q.float()
    elif defect == "q_rank":
        q = q.reshape(-1, D)
    elif defect == "cache_dtype":
        cache = cache.float()
    elif defect == "cache_width":
        cache = cache[..., :-16]
    elif defect == "table_float":
        table = table.float()  # type: ignore[assignment]
    elif defect == "table_rows":
        table = torch.cat([table, table[:1]])
    elif defect == "table_page":
        table = table.clone()
        if table.numel():
            table[0, 0] = cache.shape[0]
        seq = torch.full_like(seq, 1)
    elif defect == "lens_rows":
        seq = torch.cat([seq, seq[:1] + 1])
    elif defect == "lens_negative":
        seq = seq - 100
    elif defect == "scale":
        scale = -1.0
    elif defect == "splits":
        kwargs["num_splits"] = 0
    elif defect == "rank":
        rank = 24
    vacuous = defect in ("table_page", "lens_negative", "table_rows", "lens_rows") and not lens
    with launches() as seen:
        if defect and not vacuous:
            with pytest.raises(ValueError, match=f"^{DEFECTS[defect]}"):
                _call(path, q, cache, table, seq, quant, scale, rank, kwargs)
            assert seen == [], f"launched {seen} before refusing"
            return
        if vacuous:  # a defect in entries of an empty batch is no defect
            return
        out, lse = _call(path, q, cache, table, seq, quant, scale, rank, kwargs)
    assert ref is not None
    assert out.shape == (len(lens), heads, R) and lse.shape == (len(lens), heads)
    if lens:
        assert_like_oracle(out, lse, *ref)


def _call(
    path: str,
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq: torch.Tensor,
    quant: AttentionQuant,
    scale: Any,
    rank: Any,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, torch.Tensor]:
    if path == "decode":
        return decode(q, cache, table, seq, softmax_scale=scale, kv_lora_rank=rank, quant=quant,
                      check_values=True, impl=IMPL, **kwargs)  # fmt: skip
    shadow = (
        write_shadow(cache, quant)
        if cache.dtype == torch.float16 and cache.shape[-1] == D
        else torch.zeros(1, 1, 1, dtype=torch.uint8, device=DEVICE)
    )
    return decode_shadow(q, cache, shadow, table, seq, softmax_scale=scale, kv_lora_rank=rank,
                         quant=quant, check_values=True, impl=IMPL, **kwargs)  # fmt: skip
