"""The Gluon sm90 decode (``mla_triton.gluon_decode``): compiled on the CPU, run on a GPU.

CPU (CI): Gluon has no interpreter, so every variant the launcher can pick is
compiled for sm_90a (``compile_variant``) and its PTX is checked for what the
design promises: ``S = q Kᵀ`` computed once (36 wgmma ``64 x BLOCK_N/2`` per tile,
512/16 + 64/16, per warpgroup), ``P V`` as ``64 x 256`` wgmma (the two warpgroups
split the 512 features), ``cp.async`` tile loads, no local-memory spills, and
shared memory within the 227 KiB of a CTA; ptxas (sm_90a) reports no spills and no
serialized wgmma. The fp8 recipe (q̂, K̂ = V̂, P̂) compiles for the default and the
overlapped variant: float16 MMAs, the hardware E4M3 conversion.

GPU (skipped without CUDA): bf16 against ``mla_reference.decode`` (float64) with
the bounds of test_decode_gpu.py (P not quantized is rounded to bf16 for the dot:
rows 1.5e-2; P quantized: exact products, rows 4e-3 but for at most 2% of the rows
(a P code next to a rounding midpoint may flip), each below 0.5; LSE 2e-5) and
against ``mla_triton.decode`` (the same algorithm, a different summation order), with
test_decode_gpu.py's inputs, CPU oracle and checks.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from mla_formats import AttentionQuant, OperandQuant
from mla_triton.gluon_decode import (
    UNQUANTIZED,
    VARIANTS,
    GluonDecodeConfig,
    GluonRecipe,
    compile_variant,
    gluon_decode_preferred,
    gluon_decode_supported,
    gluon_recipe,
    max_shared_bytes,
)

SCALE = 576**-0.5


def _wgmma_shapes(ptx: str) -> dict[str, int]:
    shapes: dict[str, int] = {}
    for m in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx):
        shapes[m] = shapes.get(m, 0) + 1
    return shapes


FP8 = gluon_recipe(AttentionQuant.uniform("fp8"))
assert isinstance(FP8, GluonRecipe)
COMPILED = [(cfg, UNQUANTIZED) for cfg in VARIANTS] + [(VARIANTS[0], FP8), (VARIANTS[2], FP8)]

# Under TRITON_INTERPRET=1 (CI) the @triton.jit helpers the kernel calls are interpreter
# functions, which Gluon cannot compile: the compile tests then run in one child pytest
# without the interpreter (test_compile_tests_in_child), and assert there.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
COMPILE_TESTS = "test_compiles_for_sm90a or test_one_split_and_fp16_compile"
compiles_here = pytest.mark.skipif(
    INTERPRETED, reason="compiled in a child process without the interpreter"
)


@pytest.mark.skipif(not INTERPRETED, reason="the compile tests run in this process")
def test_compile_tests_in_child() -> None:
    """Every compile test of this file passes in a child pytest with TRITON_INTERPRET=0."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(
        [*cmd, "-k", COMPILE_TESTS], env=os.environ | {"TRITON_INTERPRET": "0"},
        capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{len(COMPILED) + 1} passed" in done.stdout, done.stdout[-2000:]


@compiles_here
@pytest.mark.parametrize(
    ("config", "recipe"),
    COMPILED,
    ids=[f"{c.name}-{'fp8' if r.kv_fp8 else 'none'}" for c, r in COMPILED],
)
def test_compiles_for_sm90a(config: GluonDecodeConfig, recipe: GluonRecipe) -> None:
    """Each variant (several splits: the workspace epilogue) compiles to the planned PTX."""
    c = compile_variant(config, num_splits=2, recipe=recipe)
    assert c.num_warps == 8
    assert 0 < c.shared <= max_shared_bytes(), c.shared
    # the ring, q and P alone take this much: a smaller figure means a buffer went missing
    tile = config.block_n * 576 * 2
    p_bufs = 2 if config.overlap else 1
    assert c.shared >= config.stages * tile + 64 * 576 * 2 + p_bufs * 64 * config.block_n * 2
    # S: 512/16 + 64/16 wgmma a tile (twice in the code with overlap: prologue and loop)
    shapes = _wgmma_shapes(c.ptx)
    operands = "f16.f16" if recipe.mma_f16 else "bf16.bf16"
    typed = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{operands}", c.ptx)
    assert len(typed) == sum(shapes.values())
    if recipe.kv_fp8:
        assert "cvt.rn.satfinite.e4m3x2.f32" in c.ptx
    s_count = 36 * (2 if config.overlap else 1)
    assert shapes == {f"m64n{config.block_n // 2}k16": s_count, "m64n256k16": config.block_n // 16}
    if config.overlap:  # the softmax runs while P V is in flight
        assert "wgmma.wait_group.sync.aligned 1;" in c.ptx
    assert "cp.async.cg.shared.global" in c.ptx or "cp.async.ca.shared.global" in c.ptx
    assert not re.search(r"\b(ld|st)\.local\b", c.ptx)
    assert "ttng.warp_group_dot" in c.ttgir
    # ptxas: no spills, and no serialized wgmma (C7515: an accumulator written by other
    # instructions inside a wgmma pipeline stage, e.g. an async one across the loop's edge)
    assert "0 bytes spill stores, 0 bytes spill loads" in c.ptxas_info, c.ptxas_info
    assert "C7515" not in c.ptxas_info, c.ptxas_info


@compiles_here
def test_one_split_and_fp16_compile() -> None:
    """The one-split epilogue (out and LSE) and fp16 inputs compile too."""
    c = compile_variant(VARIANTS[0], dtype="fp16", num_splits=1, page=16, index_dtype="i64")
    assert c.shared <= max_shared_bytes()
    assert _wgmma_shapes(c.ptx) == {"m64n32k16": 36, "m64n256k16": 4}
    assert "f32.f16.f16" in c.ptx


def test_supported() -> None:
    assert gluon_decode_supported(torch.bfloat16, None, 512, 64) is None
    assert gluon_decode_supported(torch.float16, AttentionQuant(), 512, 64) is None
    assert gluon_decode_supported(torch.bfloat16, AttentionQuant.uniform("fp8"), 512, 64) is None
    assert gluon_decode_supported(torch.bfloat16, AttentionQuant(q="fp8", p="fp8"), 512, 64) is None
    for bad in (
        AttentionQuant(k="fp8"),  # V not quantized: K̂ and V̂ differ
        AttentionQuant(k="nvfp4", v="nvfp4"),
        AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="fp8"),
        AttentionQuant(k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0)),  # not 2^k
    ):
        assert gluon_decode_supported(torch.bfloat16, bad, 512, 64) is not None, bad
    assert GluonRecipe(q_scaled=True, kv_fp8=True, p_fmt=1, p_gs=FP8.p_gs) == FP8
    kv8 = gluon_recipe(AttentionQuant(k="fp8", v="fp8"))
    assert FP8.mma_f16 and isinstance(kv8, GluonRecipe) and not kv8.mma_f16
    assert gluon_decode_supported(torch.float32, None, 512, 64) is not None
    assert gluon_decode_supported(torch.bfloat16, None, 256, 64) is not None


@pytest.mark.parametrize("recipe", ["none", "fp8"])
def test_kernel_args_bind_every_parameter(recipe: str) -> None:
    """The launch's keyword arguments (``decode.split_kernel_args`` filtered, plus the
    kernel's own) are exactly the kernel's parameters, with the recipe's values."""
    from mla_triton.decode import _check
    from mla_triton.gluon_decode import launch_gluon_decode
    from mla_triton.kernels.gluon_decode import gluon_decode_split_kernel

    quant = AttentionQuant.uniform("fp8") if recipe == "fp8" else None
    q = torch.zeros(3, 20, 576, dtype=torch.bfloat16)
    cache = torch.zeros(7, 64, 576, dtype=torch.bfloat16)
    table = torch.zeros(3, 2, dtype=torch.int32)
    seq = torch.tensor([5, 0, 128], dtype=torch.int32)
    c = _check(q, cache, table, seq, SCALE, 512, quant, None)
    out = torch.empty(3, 20, 512, dtype=torch.bfloat16)
    lse = torch.empty(3, 20)
    q_hat = q.to(torch.float16) if quant is not None else q
    queries = (q_hat[..., :512], q_hat[..., 512:], lse)
    args = launch_gluon_decode(
        c, cache, table, seq, out, lse, (lse, lse), queries, quant=quant, num_splits=3,
        config=VARIANTS[2], launch=False,
    )  # fmt: skip
    assert set(args) == set(gluon_decode_split_kernel.arg_names) | {"num_warps"}
    assert args["num_warps"] == 8 and args["HEAD_GROUPS"] == 1 and args["NUM_SPLITS"] == 3
    assert (args["BLOCK_N"], args["STAGES"], args["OVERLAP"]) == (32, 4, True)
    assert (args["PAGE"], args["D1"], args["D2"], args["capacity"]) == (64, 512, 64, 128)
    assert args["Q_SCALED"] == args["KV_FP8"] == (quant is not None)
    assert args["P_FMT"] == (1 if quant is not None else 0)
    assert args["score_scale"] == pytest.approx(SCALE * 1.4426950408889634)
    p_gs = FP8.p_gs if quant is not None else 1.0
    assert args["p_inv_gs"] == pytest.approx(1.0 / p_gs) and args["out_scale"] == p_gs
    assert args["qn_ptr"].dtype == (torch.float16 if quant is not None else torch.bfloat16)


def test_preferred() -> None:
    """The Triton kernel up to 32 heads (measured faster at 16), the Gluon one above."""
    assert not gluon_decode_preferred(16) and not gluon_decode_preferred(32)
    assert gluon_decode_preferred(33) and gluon_decode_preferred(128)


def test_config_checks() -> None:
    with pytest.raises(ValueError, match=r"config\.block_n"):
        GluonDecodeConfig(block_n=16, stages=2)
    with pytest.raises(ValueError, match=r"config\.stages"):
        GluonDecodeConfig(block_n=64, stages=5)
    with pytest.raises(ValueError, match=r"config\.overlap"):
        GluonDecodeConfig(block_n=32, stages=2, overlap=True)


# ------------------------------------------------------------------------------ GPU


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


gpu = pytest.mark.skipif(not _sm90(), reason="GPU suite: needs an sm90 CUDA GPU")
GPU_RECIPES = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "kv8": AttentionQuant(k="fp8", v="fp8"),
}


@gpu
@pytest.mark.parametrize("recipe", list(GPU_RECIPES))
@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    ("lens", "heads", "page", "splits"),
    [
        ([1, 15, 64, 65, 1000, 4097], 128, 64, 1),
        ([0, 17, 300, 2049], 128, 64, 3),
        ([33, 1000, 8191], 16, 64, 4),
        ([15, 16, 300, 2049], 20, 16, 3),
    ],
)
def test_matches_reference(
    recipe: str, config: GluonDecodeConfig, lens: list[int], heads: int, page: int, splits: int
) -> None:
    """Against the oracle (test_decode_gpu's inputs, CPU oracle and bounds) and against
    ``mla_triton.decode`` with the same bounds."""
    from test_decode_gpu import check, make_inputs, reference

    from mla_triton.decode import decode
    from mla_triton.gluon_decode import gluon_decode

    quant = GPU_RECIPES[recipe]
    q, cache, table, seq = make_inputs(lens, heads, page, seed=len(lens) + heads)
    out, lse = gluon_decode(
        q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=splits, config=config
    )
    check(out, lse, *reference(q, cache, table, seq, quant), quant)
    tri, tlse = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=splits)
    check(out, lse, tri, tlse, quant)
