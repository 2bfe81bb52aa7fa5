"""Bad inputs raise ValueError naming the argument (docs/numerics.md "Input checks")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from mla_formats import NMSparsity
from mla_reference import decode, prefill

F64 = torch.float64
META = torch.device("meta")


def prefill_args() -> dict[str, Any]:
    """A valid call: two sequences, 4 query heads over 2 KV heads, dims 64 / 32."""
    return {
        "q": torch.randn(12, 4, 64, dtype=F64),
        "k": torch.randn(20, 2, 64, dtype=F64),
        "v": torch.randn(20, 2, 32, dtype=F64),
        "cu_seqlens_q": torch.tensor([0, 5, 12], dtype=torch.int32),
        "cu_seqlens_k": torch.tensor([0, 8, 20], dtype=torch.int64),
        "softmax_scale": 0.125,
    }


def decode_args() -> dict[str, Any]:
    """A valid call: 2 requests of 20 and 33 tokens, pages of 16, 6 blocks."""
    return {
        "q": torch.randn(2, 4, 576, dtype=F64),
        "kv_cache": torch.randn(6, 16, 576, dtype=F64),
        "block_table": torch.tensor([[0, 1, 5], [2, 3, 4]], dtype=torch.int32),
        "seq_lens": torch.tensor([20, 33], dtype=torch.int32),
        "softmax_scale": 0.05,
    }


def call_prefill(args: dict[str, Any]) -> object:
    a = dict(args)
    return prefill(
        a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"), **a
    )


def call_decode(args: dict[str, Any]) -> object:
    a = dict(args)
    return decode(a.pop("q"), a.pop("kv_cache"), a.pop("block_table"), a.pop("seq_lens"), **a)


def test_valid_calls_pass() -> None:
    """The valid calls that every rejection below edits return finite results."""
    out = call_prefill(prefill_args())
    assert isinstance(out, torch.Tensor)
    assert out.shape == (12, 4, 32) and out.dtype == F64 and bool(out.isfinite().all())
    got = call_decode(decode_args())
    assert isinstance(got, tuple)
    dout, lse = got
    assert dout.shape == (2, 4, 512) and lse.shape == (2, 4)
    assert bool(dout.isfinite().all()) and bool(lse.isfinite().all())


Edit = Callable[[dict[str, Any]], None]


def _set(name: str, value: Callable[[dict[str, Any]], Any]) -> Edit:
    def edit(args: dict[str, Any]) -> None:
        args[name] = value(args)

    return edit


PREFILL_CASES: list[tuple[str, Edit, str]] = [
    ("q rank", _set("q", lambda a: a["q"][:, 0]), "q"),
    ("q int", _set("q", lambda a: a["q"].long()), "q"),
    ("q not a tensor", _set("q", lambda a: a["q"].tolist()), "q"),
    ("k rank", _set("k", lambda a: a["k"][None]), "k"),
    ("k dtype", _set("k", lambda a: a["k"].float()), "k"),
    ("v device", _set("v", lambda a: a["v"].to(META)), "v"),
    ("head dim 72", _set("q", lambda a: torch.randn(12, 4, 72, dtype=F64)), "q"),
    ("k head dim", _set("k", lambda a: torch.randn(20, 2, 48, dtype=F64)), "k"),
    ("v head dim 40", _set("v", lambda a: torch.randn(20, 2, 40, dtype=F64)), "v"),
    ("v tokens", _set("v", lambda a: a["v"][:19]), "v"),
    ("kv heads do not divide", _set("q", lambda a: torch.randn(12, 3, 64, dtype=F64)), "k"),
    ("cu_q float", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"].double()), "cu_seqlens_q"),
    ("cu_q 2-d", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"][None]), "cu_seqlens_q"),
    ("cu_q start", _set("cu_seqlens_q", lambda a: torch.tensor([1, 5, 12])), "cu_seqlens_q"),
    ("cu_q order", _set("cu_seqlens_q", lambda a: torch.tensor([0, 7, 5, 12])), "cu_seqlens_q"),
    ("cu_q total", _set("cu_seqlens_q", lambda a: torch.tensor([0, 5, 11])), "cu_seqlens_q"),
    ("cu_q device", _set("cu_seqlens_q", lambda a: a["cu_seqlens_q"].to(META)), "cu_seqlens_q"),
    ("cu_q single", _set("cu_seqlens_q", lambda a: torch.tensor([0])), "cu_seqlens_q"),
    (
        "cu_q empty",
        _set("cu_seqlens_q", lambda a: torch.zeros(0, dtype=torch.int32)),
        "cu_seqlens_q",
    ),
    ("cu_k total", _set("cu_seqlens_k", lambda a: torch.tensor([0, 8, 21])), "cu_seqlens_k"),
    ("cu_k batch", _set("cu_seqlens_k", lambda a: torch.tensor([0, 8, 9, 20])), "cu_seqlens_k"),
    ("scale negative", _set("softmax_scale", lambda a: -0.1), "softmax_scale"),
    ("scale nan", _set("softmax_scale", lambda a: float("nan")), "softmax_scale"),
    ("scale str", _set("softmax_scale", lambda a: "0.1"), "softmax_scale"),
    ("causal", _set("causal", lambda a: 1), "causal"),
    ("quant", _set("quant", lambda a: "nvfp4"), "quant"),
    ("sparsity", _set("sparsity", lambda a: (2, 4)), "sparsity"),
    ("return_lse", _set("return_lse", lambda a: None), "return_lse"),
    ("compute_dtype", _set("compute_dtype", lambda a: torch.float16), "compute_dtype"),
    ("out_dtype", _set("out_dtype", lambda a: torch.int32), "out_dtype"),
    ("debug", _set("debug", lambda a: []), "debug"),
]


@pytest.mark.parametrize(
    ("edit", "argument"), [c[1:] for c in PREFILL_CASES], ids=[c[0] for c in PREFILL_CASES]
)
def test_prefill_rejects(edit: Edit, argument: str) -> None:
    args = prefill_args()
    edit(args)
    with pytest.raises(ValueError, match=rf"^{argument}(:| \()"):
        call_prefill(args)


DECODE_CASES: list[tuple[str, Edit, str]] = [
    ("q rank", _set("q", lambda a: a["q"][0]), "q"),
    ("q int", _set("q", lambda a: a["q"].long()), "q"),
    ("q dim", _set("q", lambda a: a["q"][..., :512]), "q"),
    ("q triple", _set("q", lambda a: (a["q"], a["q"], a["q"])), "q"),
    ("q_nope width", _set("q", lambda a: (a["q"][..., :496], a["q"][..., 496:])), r"q\[0\]"),
    ("q_pe heads", _set("q", lambda a: (a["q"][..., :512], a["q"][:, :2, 512:])), r"q\[1\]"),
    ("q_pe dtype", _set("q", lambda a: (a["q"][..., :512], a["q"][..., 512:].float())), r"q\[1\]"),
    ("cache rank", _set("kv_cache", lambda a: a["kv_cache"][None]), "kv_cache"),
    ("cache dtype", _set("kv_cache", lambda a: a["kv_cache"].float()), "kv_cache"),
    ("cache fp8", _set("kv_cache", lambda a: a["kv_cache"].to(torch.float8_e4m3fn)), "kv_cache"),
    ("cache device", _set("kv_cache", lambda a: a["kv_cache"].to(META)), "kv_cache"),
    ("cache width", _set("kv_cache", lambda a: torch.randn(6, 16, 520, dtype=F64)), "kv_cache"),
    ("cache no rope", _set("kv_cache", lambda a: a["kv_cache"][..., :512]), "kv_cache"),
    ("cache page 0", _set("kv_cache", lambda a: a["kv_cache"][:, :0]), "kv_cache"),
    ("rank 500", _set("kv_lora_rank", lambda a: 500), "kv_lora_rank"),
    ("rank float", _set("kv_lora_rank", lambda a: 512.0), "kv_lora_rank"),
    ("table float", _set("block_table", lambda a: a["block_table"].float()), "block_table"),
    ("table rank", _set("block_table", lambda a: a["block_table"].flatten()), "block_table"),
    ("table rows", _set("block_table", lambda a: a["block_table"][:1]), "block_table"),
    (
        "table past cache",
        _set("block_table", lambda a: torch.tensor([[0, 6, 1], [2, 3, 4]])),
        "block_table",
    ),
    (
        "table negative",
        _set("block_table", lambda a: torch.tensor([[0, 1, 5], [2, -1, 4]])),
        "block_table",
    ),
    ("table device", _set("block_table", lambda a: a["block_table"].to(META)), "block_table"),
    ("lens float", _set("seq_lens", lambda a: a["seq_lens"].float()), "seq_lens"),
    ("lens rank", _set("seq_lens", lambda a: a["seq_lens"][None]), "seq_lens"),
    ("lens batch", _set("seq_lens", lambda a: a["seq_lens"][:1]), "seq_lens"),
    ("lens negative", _set("seq_lens", lambda a: torch.tensor([20, -1])), "seq_lens"),
    ("lens capacity", _set("seq_lens", lambda a: torch.tensor([20, 49])), "seq_lens"),
    ("scale zero", _set("softmax_scale", lambda a: 0.0), "softmax_scale"),
    ("quant", _set("quant", lambda a: {"q": "fp8"}), "quant"),
    ("compute_dtype", _set("compute_dtype", lambda a: torch.bfloat16), "compute_dtype"),
    ("debug", _set("debug", lambda a: "yes"), "debug"),
]


@pytest.mark.parametrize(
    ("edit", "argument"), [c[1:] for c in DECODE_CASES], ids=[c[0] for c in DECODE_CASES]
)
def test_decode_rejects(edit: Edit, argument: str) -> None:
    args = decode_args()
    edit(args)
    with pytest.raises(ValueError, match=rf"^{argument}(:| \()"):
        call_decode(args)


def test_unused_table_entries_are_not_checked() -> None:
    """Entries past a request's last page are never read: any value passes and changes
    nothing; the same value on a page the request uses is refused."""
    args = decode_args()
    args["seq_lens"] = torch.tensor([32, 33], dtype=torch.int32)  # row 0 uses 2 pages
    want = call_decode(args)
    args["block_table"] = torch.tensor([[0, 1, 99], [2, 3, 4]], dtype=torch.int32)
    got = call_decode(args)
    assert isinstance(got, tuple) and isinstance(want, tuple)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    args["seq_lens"] = torch.tensor([33, 33], dtype=torch.int32)  # now row 0 reads page 2
    with pytest.raises(ValueError, match=r"^block_table(:| \()"):
        call_decode(args)


def test_oracle_accepts_what_kernels_may_not() -> None:
    """Any page size, non-contiguous inputs, causal with more queries than keys: each
    gives the result of the same data in the kernels' layout."""
    args = decode_args()
    want = call_decode(args)
    strided = torch.zeros(6, 16, 3, 576, dtype=F64)
    strided[:, :, 1] = args["kv_cache"]
    args["kv_cache"] = strided[:, :, 1]
    assert not args["kv_cache"].is_contiguous()
    got = call_decode(args)
    assert isinstance(got, tuple) and isinstance(want, tuple)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # the same tokens in pages of 4: token t of a request at page t // 4, row t % 4
    # (the rows past a request's length are NaN: never read)
    rows = [_pad(_cache_rows(args, b, n), 4) for b, n in enumerate((20, 33))]
    pages = torch.cat([r.reshape(-1, 4, 576) for r in rows])
    small = dict(args, kv_cache=pages, block_table=_table((5, 9)))
    got = call_decode(small)
    assert isinstance(got, tuple)
    torch.testing.assert_close(got, want)
    args = prefill_args()
    q = torch.randn(4, 12, 64, dtype=F64).transpose(0, 1)
    args["q"] = q
    args["cu_seqlens_q"] = torch.tensor([0, 10, 12], dtype=torch.int32)
    out = call_prefill(args)
    contiguous = call_prefill(dict(args, q=q.contiguous()))
    assert isinstance(out, torch.Tensor) and isinstance(contiguous, torch.Tensor)
    torch.testing.assert_close(out, contiguous, rtol=0, atol=0)
    assert out.shape == (12, 4, 32) and bool(out.isfinite().all())


def _cache_rows(args: dict[str, Any], b: int, n: int) -> torch.Tensor:
    """The first ``n`` latent rows of request ``b`` of ``args`` (pages of 16)."""
    pages = args["block_table"][b].tolist()
    rows = torch.cat([args["kv_cache"][p] for p in pages])
    return rows[:n]


def _pad(rows: torch.Tensor, page: int) -> torch.Tensor:
    fill = -len(rows) % page
    return torch.cat([rows, torch.full((fill, rows.shape[1]), float("nan"), dtype=rows.dtype)])


def _table(pages: tuple[int, ...]) -> torch.Tensor:
    """Consecutive pages for each request, ``pages[b]`` of them, padded with page 0."""
    width = max(pages)
    rows, start = [], 0
    for n in pages:
        rows.append(list(range(start, start + n)) + [0] * (width - n))
        start += n
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize(
    "sparsity",
    [(2, 4), [2, 4], {"n": 2, "m": 4}, "2:4", 2],
    ids=["tuple", "list", "dict", "str", "int"],
)
def test_sparsity_must_be_nmsparsity(sparsity: object) -> None:
    """Anything but None or ``NMSparsity`` is refused, naming ``sparsity``."""
    args = prefill_args()
    args["sparsity"] = sparsity
    with pytest.raises(ValueError, match=r"^sparsity: expected None or mla_formats\.NMSparsity"):
        call_prefill(args)


def test_sparsity_nmsparsity_is_applied() -> None:
    """An ``NMSparsity`` is taken and used: with 1 of every 4 keys kept and no dense
    window the output differs from the dense one, and ``debug["keep"]`` drops keys."""
    args = prefill_args()
    dense = call_prefill(args)
    debug: dict[str, Any] = {}
    sparse = call_prefill(dict(args, sparsity=NMSparsity(1, 4, 0, 0), debug=debug))
    assert isinstance(dense, torch.Tensor) and isinstance(sparse, torch.Tensor)
    assert sparse.shape == dense.shape and bool(sparse.isfinite().all())
    assert not torch.allclose(sparse, dense)
    kept = sum(int(keep.sum()) for keep in debug["keep"])
    visible = sum(int(keep.numel()) for keep in debug["keep"])
    assert 0 < kept < visible
