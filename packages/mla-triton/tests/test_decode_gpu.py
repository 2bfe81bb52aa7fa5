"""GPU suite of ``mla_triton.decode``: bf16 at real sizes against ``mla_reference.decode``.

Skipped without a CUDA GPU (CI runs on CPUs; the results of running it on an
H200 are recorded in docs/benchmarks.md). Same checks as test_decode.py,
with the bounds of bf16 (module test_decode's docstring explains the metric):

- P not quantized: P is cast to bf16 for the dot (2^-8 relative): rows 1.5e-2.
- P quantized: exact products; rows 4e-3 (bf16 output rounding). The kernel's
  ``exp2`` (ex2.approx) and fp32 scores differ from the float64 oracle by ulps,
  which can flip a P code next to a rounding midpoint: such rows are counted
  (at most 2% of the rows) and each stays below ``LOOSE = 0.5`` (one flip moves
  ``P̂_j`` by at most a third of its block's maximum, which in a short row of
  small outputs is a large relative change: 0.22 was seen once in 1152 rows).
  A wrong axis, block origin or scale moves nearly every row past 4e-3.
- LSE: 2e-5.

Every test runs through the Triton split kernel (``impl="triton"``, forced with
``tuning.use``) and, on an sm90 GPU, through the Gluon split kernel (``impl="gluon"``)
for the recipes it implements (``ops.decode.gluon.gluon_recipe``) and the
warp-specialized Gluon kernel (``impl="gluon_ws"``) for recipe none: the same bounds,
the same contract.

The oracle runs on the CPU (float64), on copies of the pages the batch uses:
``mla_formats`` on CUDA computes a global scale ``amax / unit_amax`` as
``amax * (1 / unit_amax)`` (PyTorch's CUDA division by a Python scalar multiplies
by the reciprocal), one ulp away from the division docs/numerics.md "Formats and
scales" specifies for about half the values, which moves QDQ codes; the CPU path
divides exactly, as the kernels do.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl
from calls import decode  # mla_triton.decode, with ``impl`` forced through tuning.use

import mla_reference
from mla_formats import AttentionQuant, OperandQuant, e4m3_round, qdq_factored
from mla_triton import decode_workspace_size
from mla_triton.common import qdq as dev
from mla_triton.common.intercept import intercept
from mla_triton.common.splitk_kernels import decode_q_kernel
from mla_triton.ops.decode.gluon import GluonRecipe, gluon_recipe

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
    reason="GPU suite (bf16 at real sizes): needs a CUDA GPU and the compiled Triton path",
)

SCALE = 576**-0.5
TOL_P_BF16 = 1.5e-2
TOL_EXACT_P = 4e-3
LOOSE = 0.5
LSE_TOL = 2e-5


def make_inputs(
    lens: list[int],
    heads: int,
    page: int,
    seed: int,
    *,
    n_blocks: int | None = None,
    high_pages: bool = False,
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    used = [-(-n // page) for n in lens]
    total = sum(used) + 2
    n_blocks = n_blocks or total
    cache = torch.empty(n_blocks, page, 576, device="cuda", dtype=torch.bfloat16)
    if n_blocks == total:
        cache.normal_(generator=None)
    first = n_blocks - total if high_pages else 0  # pages at the top: offsets beyond 2^31
    pages = first + torch.randperm(total, generator=g)
    if n_blocks != total:
        cache[first:].normal_()
    table = torch.zeros(len(lens), max([1, *used]), dtype=torch.int32)
    k = 0
    for b, n in enumerate(used):
        table[b, :n] = pages[k : k + n]
        k += n
    q = (torch.randn(len(lens), heads, 576, generator=g) * 0.5).to("cuda", torch.bfloat16)
    return q, cache, table.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    seq: torch.Tensor,
    quant: AttentionQuant | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mla_reference.decode`` on the CPU over the used pages only; results on the GPU."""
    page = cache.shape[1]
    table_cpu = table.cpu().long()
    lens = seq.cpu().tolist()
    used = sorted({int(p) for b, n in enumerate(lens) for p in table_cpu[b, : -(-n // page)]})
    remap = {p: i for i, p in enumerate(used)}
    compact = torch.zeros_like(table_cpu)
    for b, n in enumerate(lens):
        for j in range(-(-n // page)):
            compact[b, j] = remap[int(table_cpu[b, j])]
    pages = cache[torch.tensor(used or [0], device=cache.device)].cpu()
    out, lse = mla_reference.decode(
        q.cpu(), pages, compact, seq.cpu(), softmax_scale=SCALE, quant=quant
    )
    return out.to(q.device), lse.to(q.device)


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    o, r = out.double(), ref.double()
    return (o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-3)


def check(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    quant: AttentionQuant | None,
) -> None:
    assert torch.isfinite(out).all()
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty] == 0).all()
    full = ~empty
    assert (lse[full].double() - ref_lse[full].double()).abs().max().item() <= LSE_TOL
    err = row_errors(out[full], ref_out[full])
    if quant is None or quant.p.is_identity:
        assert err.max().item() <= TOL_P_BF16, err.max().item()
        return
    allowed = max(1, math.ceil(0.02 * err.numel()))
    assert int((err > TOL_EXACT_P).sum()) <= allowed, int((err > TOL_EXACT_P).sum())
    assert err.max().item() <= LOOSE, err.max().item()


def run_and_check(
    lens: list[int],
    heads: int,
    page: int,
    quant: AttentionQuant | None,
    seed: int = 0,
    impl: str = "triton",
    **kwargs: object,
) -> None:
    q, cache, table, seq = make_inputs(lens, heads, page, seed)
    out, lse = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, impl=impl, **kwargs)  # type: ignore[arg-type]
    ref_out, ref_lse = reference(q, cache, table, seq, quant)
    check(out, lse, ref_out, ref_lse, quant)


RECIPES = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "nvfp4-q": AttentionQuant(q="nvfp4"),
    "nvfp4-k": AttentionQuant(k="nvfp4"),
    "nvfp4-v": AttentionQuant(v="nvfp4"),
    "nvfp4-p": AttentionQuant(p="nvfp4"),
    "fp8-k": AttentionQuant(k="fp8"),
    "fp8-v": AttentionQuant(v="fp8"),
    "fp8-p": AttentionQuant(p="fp8"),
    "k4-v8": AttentionQuant(q="fp8", k="nvfp4", p="nvfp4", v="fp8"),
    "k8-v4": AttentionQuant(q="nvfp4", k="fp8", p="fp8", v="nvfp4"),
    "k-dynamic": AttentionQuant(q="nvfp4", k=OperandQuant("nvfp4", "dynamic"), p="nvfp4"),
    "calibrated": AttentionQuant(
        q=OperandQuant("fp8", 20.0),
        k=OperandQuant("nvfp4", 9.0),
        v=OperandQuant("fp8", 7.0),
        p="fp8",
    ),
}
LENS = [1, 15, 16, 17, 63, 64, 65, 1000, 4097]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def _takes(impl: str, recipe: str) -> bool:
    if impl == "triton":
        return True
    if impl == "gluon_ws":  # the warp-specialized kernel: recipe none
        return SM90 and RECIPES[recipe] is None
    return SM90 and isinstance(gluon_recipe(RECIPES[recipe]), GluonRecipe)


def with_impls(recipes: list[str]) -> list[tuple[str, str]]:
    """``(recipe, impl)``: Triton for each; on sm90 the Gluon split kernel where it takes
    the recipe and the warp-specialized one for recipe none."""
    return [(r, i) for r in recipes for i in ("triton", "gluon", "gluon_ws") if _takes(i, r)]


# the tests that use nvfp4 for the Triton kernel run the Gluon kernels on none and fp8
NVFP4_OR_GLUON = [("nvfp4", "triton")] + (
    [("none", "gluon"), ("none", "gluon_ws"), ("fp8", "gluon")] if SM90 else []
)


@pytest.mark.parametrize(("recipe", "impl"), with_impls(list(RECIPES)))
def test_matches_reference_128_heads(recipe: str, impl: str) -> None:
    run_and_check(LENS, 128, 64, RECIPES[recipe], impl=impl)


@pytest.mark.parametrize("page", [16, 32, 64, 128])
@pytest.mark.parametrize(("recipe", "impl"), with_impls(["none", "nvfp4", "fp8"]))
def test_page_sizes(page: int, recipe: str, impl: str) -> None:
    run_and_check([17, 300, 2049], 128, page, RECIPES[recipe], seed=1, impl=impl, num_splits=3)


@pytest.mark.parametrize("heads", [1, 16, 20, 64, 96])
@pytest.mark.parametrize(("recipe", "impl"), NVFP4_OR_GLUON)
def test_head_counts(heads: int, recipe: str, impl: str) -> None:
    run_and_check([33, 1000], heads, 64, RECIPES[recipe], seed=2, impl=impl)


@pytest.mark.skipif(not SM90, reason="the Gluon kernel needs an sm90 GPU")
def test_auto_runs_the_gluon_kernel_on_sm90() -> None:
    """Without a forced implementation, 128 heads launch the Gluon kernels (none: the
    warp-specialized one; fp8 and nvfp4: the split one); at 16 heads the
    warp-specialized one for recipe none, the Triton one for fp8."""
    seen: list[str] = []

    def spy(run: object, kernel: object, args: object, kwargs: object, grid: object) -> None:
        seen.append(kernel.fn.__name__)  # type: ignore[attr-defined]

    q, cache, table, seq = make_inputs([100, 3000], 128, 64, seed=9)
    with intercept(spy):
        for recipe in ("none", "fp8", "nvfp4"):
            decode(q, cache, table, seq, softmax_scale=SCALE, quant=RECIPES[recipe])
        decode(q[:, :16], cache, table, seq, softmax_scale=SCALE)
        decode(q[:, :16], cache, table, seq, softmax_scale=SCALE, quant=RECIPES["fp8"])
    split = [name for name in seen if name.endswith(("split_kernel", "ws_kernel"))]
    want = ["gluon_decode_ws_kernel", *["gluon_decode_split_kernel"] * 2,
            "gluon_decode_ws_kernel", "decode_split_kernel"]  # fmt: skip
    assert split == want, seen


@pytest.mark.parametrize(("recipe", "impl"), NVFP4_OR_GLUON)
def test_offsets_beyond_2_31_elements(recipe: str, impl: str) -> None:
    """A cache of more than 2^31 elements with the used pages at its top."""
    page = 64
    n_blocks = 2**31 // (page * 576) + 64
    q, cache, table, seq = make_inputs(
        [100, 3000], 16, page, seed=3, n_blocks=n_blocks, high_pages=True
    )
    assert cache.numel() > 2**31 and int(table.max()) * page * 576 > 2**31
    quant = RECIPES[recipe]
    out, lse = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, impl=impl)
    ref = reference(q, cache, table, seq, quant)
    check(out, lse, *ref, quant)


@pytest.mark.parametrize(("recipe", "impl"), with_impls(["none", "nvfp4", "fp8"]))
def test_split_and_batch_invariance(recipe: str, impl: str) -> None:
    quant = RECIPES[recipe]
    q, cache, table, seq = make_inputs([5000, 64, 8191, 5000], 128, 64, seed=4)
    one = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=1, impl=impl)
    many = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=16, impl=impl)
    assert (one[1] - many[1]).abs().max().item() <= 1e-5
    err = row_errors(many[0], one[0])
    assert int((err > 8e-3).sum()) <= max(1, err.numel() // 50) and err.max().item() <= LOOSE
    alone = decode(
        q[2:3], cache, table[2:3], seq[2:3], softmax_scale=SCALE, quant=quant, num_splits=16,
        impl=impl,
    )  # fmt: skip
    assert torch.equal(alone[0][0], many[0][2]) and torch.equal(alone[1][0], many[1][2])


@pytest.mark.parametrize(("recipe", "impl"), NVFP4_OR_GLUON)
def test_poisoned_memory(recipe: str, impl: str) -> None:
    quant = RECIPES[recipe]
    q, cache, table, seq = make_inputs([0, 17, 1000], 128, 64, seed=5)
    want = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=4, impl=impl)
    used = torch.zeros(cache.shape[0], dtype=torch.bool, device="cuda")
    for b, n in enumerate(seq.tolist()):
        pages = table[b, : -(-n // 64)].long()
        used[pages] = True
        if n % 64:
            cache[int(table[b, n // 64]), n % 64 :] = float("nan")
    cache[~used] = float("nan")
    ws = torch.full(
        (decode_workspace_size(3, 128, 1000, num_splits=4),), 255, dtype=torch.uint8, device="cuda"
    )
    out = torch.full_like(want[0], float("nan"))
    lse = torch.full_like(want[1], float("nan"))
    decode(
        q,
        cache,
        table,
        seq,
        softmax_scale=SCALE,
        quant=quant,
        num_splits=4,
        workspace=ws,
        out=out,
        lse=lse,
        impl=impl,
    )
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])


@pytest.mark.parametrize(("recipe", "impl"), NVFP4_OR_GLUON)
def test_cuda_graph_capture_and_replay(recipe: str, impl: str) -> None:
    """No host sync, fixed allocations: capture once, replay with new lengths and data."""
    quant = RECIPES[recipe]
    q, cache, table, seq = make_inputs([900, 2000, 50, 4000], 128, 64, seed=6)
    max_len = table.shape[1] * 64
    ws = torch.empty(decode_workspace_size(4, 128, max_len), dtype=torch.uint8, device="cuda")
    out = torch.empty(4, 128, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(4, 128, device="cuda")

    def step() -> None:
        decode(
            q,
            cache,
            table,
            seq,
            softmax_scale=SCALE,
            quant=quant,
            workspace=ws,
            out=out,
            lse=lse,
            max_seq_len=max_len,
            impl=impl,
        )

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    seq.copy_(torch.tensor([4000, 1, 0, 3333], dtype=torch.int32))
    q.normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(q, cache, table, seq, quant)
    check(out, lse, *ref, quant)


@pytest.mark.parametrize("past", [1, 5000], ids=["one-token-past", "past-the-wide-tensor-row"])
@pytest.mark.parametrize(("recipe", "impl"), NVFP4_OR_GLUON)
def test_seq_len_beyond_the_table_row_reads_nothing_past_it(
    recipe: str, impl: str, past: int
) -> None:
    """A ``seq_lens`` entry beyond its ``block_table`` row (width times page size):
    refused naming ``seq_lens`` with ``check_values=True``; unchecked (``False``, and the
    default for GPU tensors) that request's out and LSE NaN and the other requests
    bit-identical to the same call without it. ``block_table`` is ``big[:, :W]`` of a
    wider tensor whose other columns name a page of huge values: a read past the row
    would change a result."""
    quant = RECIPES[recipe]
    page = 64
    q, cache, table, seq = make_inputs([1024, 700, 50], 128, page, seed=10)
    w = table.shape[1]
    huge = torch.full((1, page, 576), 3e4, dtype=cache.dtype, device="cuda")
    cache = torch.cat([cache, huge])
    big = torch.full((3, 4 * w), cache.shape[0] - 1, dtype=torch.int32, device="cuda")
    big[:, :w] = table
    table = big[:, :w]
    assert table.stride(0) == 4 * w and int(seq[0]) == w * page  # request 0 fills its row
    bad = seq.clone()
    bad[1] = w * page + past  # 5000: past big's row too, into the next one
    keep = [0, 2]
    for splits in (1, 4):
        want = decode(q[keep], cache, table[keep], seq[keep], softmax_scale=SCALE, quant=quant,
                      num_splits=splits, impl=impl)  # fmt: skip
        for check_values in (False, None):
            out, lse = decode(q, cache, table, bad, softmax_scale=SCALE, quant=quant,
                              num_splits=splits, check_values=check_values, impl=impl)  # fmt: skip
            assert out[1].isnan().all() and lse[1].isnan().all(), (splits, check_values)
            assert torch.equal(out[keep], want[0]) and torch.equal(lse[keep], want[1])
    check(*want, *reference(q[keep], cache, table[keep], seq[keep], quant), quant)
    with pytest.raises(ValueError, match=r"^seq_lens: "):
        decode(q, cache, table, bad, softmax_scale=SCALE, quant=quant, check_values=True,
               impl=impl)  # fmt: skip


@triton.jit
def _e4m3_hw_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, dev.e4m3_round_hw(tl.load(x_ptr + offs), True))


def test_hardware_e4m3_matches_reference() -> None:
    """The fp8 conversion the kernel uses on sm89+ rounds like mla_formats (saturating)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    x = bits.float()
    x = torch.cat([x[torch.isfinite(x)], torch.tensor([500.0, -1e6, 464.0, -448.5])]).cuda()
    x = x[: (x.numel() // 1024) * 1024]
    y = torch.empty_like(x)
    for i in range(0, x.numel(), 1024):
        _e4m3_hw_kernel[(1,)](x[i : i + 1024], y[i : i + 1024], 1024)
    assert torch.equal(y, e4m3_round(x))


@triton.jit
def _fast_cols_kernel(x_ptr, y_ptr, gs, inv_6gs, ROWS: tl.constexpr, COLS: tl.constexpr):
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(x_ptr + offs).to(tl.float32)
    tl.store(y_ptr + offs, dev.nvfp4_qdq_fast(x, gs, inv_6gs, ROWS, COLS, 0, True, True))


def test_fast_nvfp4_with_hardware_block_scale_is_exact() -> None:
    x = (torch.randn(64, 512, device="cuda") * 3).to(torch.bfloat16).float()
    y = torch.empty_like(x)
    _fast_cols_kernel[(1,)](x, y, 1.0, 1.0 / 6.0, 64, 512)
    assert torch.equal(y, qdq_factored(x, "nvfp4", axis=0)[0])


@pytest.mark.parametrize(("fmt", "code"), [("fp8", 1), ("nvfp4", 2)])
def test_q_kernel_matches_reference(fmt: str, code: int) -> None:
    """q̂ and its dynamic global scales, bit for bit (the split kernel's input)."""
    q = (torch.randn(3, 128, 576, device="cuda") * 0.5).to(torch.bfloat16)
    q_hat = torch.empty(3, 128, 576, device="cuda", dtype=torch.float16)
    q_gs = torch.empty(3, 128, device="cuda")
    decode_q_kernel[(128, 3)](
        q,
        q[..., 512:],
        q_hat,
        q_gs,
        q.stride(0),
        q.stride(1),
        q.stride(0),
        q.stride(1),
        128,
        1.0,
        D1=512,
        D2=64,
        Q_FMT=code,
        Q_DYN=True,
    )
    want, gs = qdq_factored(q.cpu(), fmt, axis=-1, amax="dynamic")  # CPU: exact division
    assert torch.equal(q_gs.cpu(), gs[..., 0])
    assert torch.equal(q_hat.float().cpu(), want)
