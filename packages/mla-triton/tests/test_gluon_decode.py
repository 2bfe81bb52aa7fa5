"""The Gluon sm90 decode (``mla_triton.ops.decode.gluon``): compiled on the CPU, run on a GPU.

CPU (CI): Gluon has no interpreter, so every variant the launcher can pick is
compiled for sm_90a (``compile_variant``) and its PTX is checked for properties that
do not depend on the compiler's choices: the dots run as wgmma on the operand types
the recipe implies, ``cp.async`` tile loads, no local memory, shared memory at least
the buffers the kernel allocates and within the 227 KiB of a CTA; ptxas (sm_90a)
reports no spills and no serialized wgmma. The fp8 recipe (q̂, K̂ = V̂, P̂) compiles
for the default and the overlapped variant: float16 MMAs, the hardware E4M3 conversion.
The GPU part: test_gluon_decode_gpu.py.

Calls force an implementation through ``tests/calls.py`` (``tuning.use``): ``"gluon"``
is the Gluon split kernel; the warp-specialized one (``"gluon_ws"``) is
test_gluon_decode_ws.py's.
"""

from __future__ import annotations

import logging
import os
import random
import re
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
from calls import decode, decode_shadow  # the public calls, ``impl``/``config`` forced

from mla_formats import AttentionQuant, OperandQuant
from mla_triton import tuning
from mla_triton.common import device
from mla_triton.common.splitk import DecodeConfig, operand
from mla_triton.ops.decode import dispatch
from mla_triton.ops.decode.gluon import (
    ON_READ_BLOCKS_CONFIG,
    SEPARATE_V_CONFIG,
    UNQUANTIZED,
    VARIANTS,
    GluonDecodeConfig,
    GluonFacts,
    GluonRecipe,
    Unsupported,
    compile_variant,
    gluon_recipe,
    gluon_taken,
    max_shared_bytes,
    recipe_kind,
)


def gluon_unsupported(
    facts: GluonFacts, *, forced: bool = False, rule: Any = gluon_taken, op: str = "decode"
) -> Unsupported | None:
    """Why a Gluon kernel does not run ``facts``: forced, the preconditions (``rule``);
    ``"auto"``, also no row of ``dispatch.TABLE`` (``op``'s) for the recipe and heads."""
    taken = rule(facts)
    if isinstance(taken, Unsupported) or forced:
        return taken if isinstance(taken, Unsupported) else None
    if dispatch.lookup(op, recipe_kind(taken), facts.heads) is not None:
        return None
    if dispatch.lookup(op, recipe_kind(taken)) is None:
        return Unsupported("this shadow recipe is not verified on a GPU yet", False)
    return Unsupported(f"{facts.heads} heads: the Triton kernel is faster up to 32", False)


def choose_impl(impl: str, facts: GluonFacts, rule: Any = gluon_taken, op: str = "decode") -> str:
    """``"gluon"`` where ``dispatch.choose`` runs a Gluon kernel for ``facts`` (``"auto"``)
    or can (``"gluon"``: else its ValueError), else ``"triton"``."""
    if impl == "gluon":
        dispatch.forced_taken(facts, rule)
        return "gluon"
    return "triton" if impl == "triton" or dispatch.auto(op, facts, rule) is None else "gluon"


SCALE = 576**-0.5


def _wgmma_shapes(ptx: str) -> dict[str, int]:
    shapes: dict[str, int] = {}
    for m in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx):
        shapes[m] = shapes.get(m, 0) + 1
    return shapes


FP8 = gluon_recipe(AttentionQuant.uniform("fp8"))
assert isinstance(FP8, GluonRecipe)
# decode_shadow forced to "gluon" on an fp16 fp8 shadow: float16 K̂ tiles, q̂ and P̂ fp8, bf16 out
SHADOW_FP8 = replace(FP8, kv_fp8=False, shadow_f16=True)
# decode_shadow with a V̂ section (V_SEP): nvfp4 Q/K/P/V (the open V block from the raw
# rows), and dynamic fp8 K (per-token scales; rows of 2192 bytes) with fp8 V
SHADOW_NVFP4 = GluonRecipe(q_scaled=True, p_fmt=2, shadow_f16=True, k_fmt=2, v_sep=True,
                           v_f16=True, v_tail=True, q_fmt=2, v_fmt=2)  # fmt: skip
SHADOW_KDYN = replace(SHADOW_NVFP4, p_fmt=1, k_fmt=1, v_tail=False, k_dyn=True, q_fmt=1, v_fmt=1)
COMPILED = [(cfg, UNQUANTIZED) for cfg in VARIANTS] + [(VARIANTS[0], FP8), (VARIANTS[2], FP8)]
COMPILED += [(VARIANTS[0], SHADOW_FP8)]
COMPILED += [(SEPARATE_V_CONFIG, SHADOW_NVFP4), (SEPARATE_V_CONFIG, SHADOW_KDYN)]
# nvfp4 on read: V̂ quantized into its own ring, K̂ in place (V_OWN)
ON_READ_NVFP4 = gluon_recipe(AttentionQuant.uniform("nvfp4"))
assert isinstance(ON_READ_NVFP4, GluonRecipe) and ON_READ_NVFP4.v_own
COMPILED += [(SEPARATE_V_CONFIG, ON_READ_NVFP4)]
# the same with whole blocks a thread (V_OWN == 2, off by default): no shuffles in the QDQ
COMPILED += [(ON_READ_BLOCKS_CONFIG, ON_READ_NVFP4)]


def _label(recipe: GluonRecipe) -> str:
    if recipe.v_own:
        return "on-read-nvfp4"
    if recipe.v_sep:
        return "shadow-kdyn" if recipe.k_dyn else "shadow-nvfp4"
    return "shadow-fp8" if recipe.shadow_f16 else "fp8" if recipe.kv_fp8 else "none"


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
    ids=[f"{c.name}-{_label(r)}" for c, r in COMPILED],
)
def test_compiles_for_sm90a(config: GluonDecodeConfig, recipe: GluonRecipe) -> None:
    """Each variant (several splits: the workspace epilogue) compiles for sm_90a with the
    properties the design needs (none counts the compiler's instruction choices)."""
    c = compile_variant(config, num_splits=2, recipe=recipe)
    assert c.num_warps == 8
    assert 0 < c.shared <= max_shared_bytes(), c.shared
    # the ring(s), q and P alone take this much: a smaller figure means a buffer went missing
    tile = config.block_n * (576 + (512 if recipe.separate_v else 0)) * 2
    p_bufs = 2 if config.overlap else 1
    assert c.shared >= config.stages * tile + 64 * 576 * 2 + p_bufs * 64 * config.block_n * 2
    # the dots run on the tensor cores (wgmma), every one on the recipe's operand types
    shapes = _wgmma_shapes(c.ptx)
    assert shapes, "no wgmma"
    operands = "f16.f16" if recipe.mma_f16 else "bf16.bf16"
    typed = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{operands}", c.ptx)
    assert len(typed) == sum(shapes.values())
    if recipe.kv_fp8 or recipe.p_fmt:  # K̂ = V̂ on read, or P̂ (nvfp4: its block scales)
        assert "cvt.rn.satfinite.e4m3x2.f32" in c.ptx
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
    assert 0 < c.shared <= max_shared_bytes()
    assert _wgmma_shapes(c.ptx) and "f32.f16.f16" in c.ptx and "bf16" not in c.ptx
    assert "0 bytes spill stores, 0 bytes spill loads" in c.ptxas_info, c.ptxas_info


SM90 = GluonFacts(
    device_type="cuda", capability=(9, 0), interpreting=False, api_missing=None,
    dtype=torch.bfloat16, quant=None, heads=128, kv_lora_rank=512, rope=64,
    kv_strides=(64 * 576, 576), kv_aligned=True,
)  # fmt: skip
"""The facts of a call the Gluon kernel takes (an H200, DeepSeek's widths)."""


def test_dispatch_takes_the_covered_calls() -> None:
    """None (the Gluon kernel) for every recipe of ``gluon_recipe``, both 16-bit dtypes."""
    for quant in (None, AttentionQuant(), AttentionQuant.uniform("fp8"),
                  AttentionQuant(q="fp8", p="fp8"), AttentionQuant(k="fp8", v="fp8")):  # fmt: skip
        for dtype in (torch.bfloat16, torch.float16):
            assert gluon_unsupported(replace(SM90, quant=quant, dtype=dtype)) is None, quant
    want = GluonRecipe(q_scaled=True, kv_fp8=True, p_fmt=1, p_gs=FP8.p_gs, k_fmt=1, q_fmt=1,
                       v_fmt=1)  # fmt: skip
    assert want == FP8
    kv8 = gluon_recipe(AttentionQuant(k="fp8", v="fp8"))
    assert FP8.mma_f16 and isinstance(kv8, GluonRecipe) and not kv8.mma_f16


@pytest.mark.parametrize(
    ("change", "needle", "covered"),
    [
        ({"device_type": "cpu", "capability": None}, "tensors on cpu", False),
        ({"capability": (8, 0)}, "capability (8, 0)", False),
        ({"capability": (10, 0)}, "capability (10, 0)", False),
        ({"interpreting": True}, "interpreter", True),
        ({"api_missing": "Triton 3.9.0: ..."}, "Triton 3.9.0", True),
        ({"dtype": torch.float32}, "16-bit only", True),
        ({"kv_lora_rank": 256}, "kv_lora_rank 256", True),
        ({"rope": 32}, "rope 32", True),
        ({"kv_strides": (64 * 584, 584)}, "strides", True),
        ({"kv_aligned": False}, "aligned", True),
        ({"quant": AttentionQuant(k="fp8")}, "K quantized with V not", False),
        ({"quant": AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="fp8")}, "dynamic", False),
        ({"quant": AttentionQuant(k=OperandQuant("nvfp4", "dynamic"), v="nvfp4")}, "dynamic",
         False),
        ({"heads": 32, "quant": AttentionQuant.uniform("fp8")}, "32 heads", False),
        ({"heads": 16, "quant": AttentionQuant.uniform("fp8")}, "16 heads", False),
    ],
)  # fmt: skip
def test_dispatch_refusals(change: dict[str, Any], needle: str, covered: bool) -> None:
    """Each fact that rules the Gluon kernel out, with its reason; the head count only
    under ``"auto"`` (``"gluon"`` runs any head count)."""
    facts = replace(SM90, **change)
    why = gluon_unsupported(facts)
    assert why is not None and needle in why.reason and why.covered == covered, why
    forced = gluon_unsupported(facts, forced=True)
    assert (forced is None) == ("heads" in change), forced
    assert choose_impl("auto", facts) == "triton" and choose_impl("triton", SM90) == "triton"
    if forced is not None:
        with pytest.raises(ValueError, match=rf"^impl: .*{re.escape(needle)}"):
            choose_impl("gluon", facts)
    assert choose_impl("auto", SM90) == choose_impl("gluon", SM90) == "gluon"


ON_READ_TAKEN = {
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "kv-nvfp4": AttentionQuant(k="nvfp4", v="nvfp4"),
    "p-nvfp4": AttentionQuant(p="nvfp4"),
    "q-nvfp4": AttentionQuant(q="nvfp4"),
    "fp8-scale-3": AttentionQuant(k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0)),
    "k-fp8-v-nvfp4": AttentionQuant(q="fp8", k="fp8", v="nvfp4", p="fp8"),
    "k-none-v-fp8": AttentionQuant(v="fp8"),
}


@pytest.mark.parametrize("name", list(ON_READ_TAKEN))
def test_on_read_recipes_taken(name: str) -> None:
    """nvfp4 q or P and V quantized into its own tiles on read: ``"gluon"`` and
    ``"auto"`` take them, with the recipe's kernel flags."""
    facts = replace(SM90, quant=ON_READ_TAKEN[name])
    assert gluon_unsupported(facts) is None and gluon_unsupported(facts, forced=True) is None
    assert choose_impl("auto", facts) == "gluon" and choose_impl("gluon", facts) == "gluon"
    recipe = gluon_recipe(ON_READ_TAKEN[name])
    assert isinstance(recipe, GluonRecipe)
    # V̂ of its own unless only q or P is nvfp4 (K and V none: the raw rows)
    assert recipe.v_own == (name not in ("p-nvfp4", "q-nvfp4")) and not recipe.kv_fp8
    if name == "fp8-scale-3":
        assert recipe.k_exact and recipe.v_exact and recipe.k_fmt == recipe.v_fmt == 1
    if name == "nvfp4":
        assert recipe == replace(ON_READ_NVFP4) and recipe.mma_f16 and recipe.q_fmt == 2


def test_fallback_logged_once_per_reason(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On sm90, a platform or tensor reason is logged once; the recipe, the head count
    and another GPU are not logged."""
    monkeypatch.setattr(dispatch, "_logged", set())
    caplog.set_level(logging.INFO, logger="mla_triton")
    for _ in range(3):
        choose_impl("auto", replace(SM90, kv_aligned=False))
        choose_impl("auto", replace(SM90, api_missing="no Gluon here"))
        choose_impl("auto", replace(SM90, heads=16, quant=AttentionQuant.uniform("fp8")))
        choose_impl("auto", replace(SM90, quant=AttentionQuant.uniform("nvfp4")))
        choose_impl("auto", replace(SM90, capability=(8, 0)))
    logged = [r.getMessage() for r in caplog.records if r.name == "mla_triton"]
    assert len(logged) == 2 and "aligned" in logged[0] and "no Gluon here" in logged[1], logged


def test_impl_values_checked() -> None:
    """``tuning.use`` takes decode's implementations by name and refuses others."""
    assert tuning.IMPLS["decode"] == ("triton", "gluon", "gluon_ws")
    for name in tuning.IMPLS["decode"]:
        with tuning.use(name):
            pass
    for bad in ("Gluon", "", "auto"):
        with pytest.raises(ValueError, match=r"^impl: expected one of"), tuning.use(bad):
            pass
    with pytest.raises(ValueError, match=r"^use: expected"), tuning.use(1):  # type: ignore[arg-type]
        pass


def test_triton_release_checked_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """This Triton (3.8) has the API; another release is a reason, cached and warned once,
    naming the version and the path taken."""
    import triton

    caplog.set_level(logging.WARNING, logger="mla_triton")
    device.gluon_api_missing.cache_clear()
    try:
        assert device.gluon_api_missing() is None
        device.gluon_api_missing.cache_clear()
        monkeypatch.setattr(triton, "__version__", "3.9.0")
        why = device.gluon_api_missing()
        assert why is not None and "Triton 3.9.0" in why
        monkeypatch.setattr(triton, "__version__", "3.8.0")
        assert device.gluon_api_missing() == why  # cached
        warned = [r.getMessage() for r in caplog.records if r.name == "mla_triton"]
        assert len(warned) == 1 and "Triton 3.9.0" in warned[0] and "Triton kernels" in warned[0]
    finally:
        device.gluon_api_missing.cache_clear()


def _cpu_case(heads: int) -> tuple[torch.Tensor, ...]:
    q = torch.zeros(3, heads, 576, dtype=torch.float16)
    cache = torch.zeros(7, 64, 576, dtype=torch.float16)
    table = torch.zeros(3, 2, dtype=torch.int32)
    return q, cache, table, torch.tensor([5, 0, 128], dtype=torch.int32)


def test_decode_impl_refused_before_any_launch() -> None:
    """A bad ``impl``, or a Gluon kernel where it cannot run (here: on the CPU; the
    shadow), is a ValueError naming ``impl`` and nothing launches; a config that is no
    tuning config is refused by ``tuning.use``; unforced, the Triton kernel runs here."""
    from mla_triton import allocate_shadow
    from mla_triton.precompile import record_keys

    q, cache, table, seq = _cpu_case(128)
    fp8 = AttentionQuant.uniform("fp8")
    shadow = allocate_shadow(7, 64, fp8)
    calls = {
        "decode": lambda impl: decode(q, cache, table, seq, softmax_scale=SCALE, impl=impl),
        "shadow": lambda impl: decode_shadow(
            q, cache, shadow, table, seq, softmax_scale=SCALE, quant=fp8, impl=impl
        ),
    }
    with record_keys() as keys:
        for call in calls.values():
            with pytest.raises(ValueError, match=r"^impl: expected one of"):
                call("flashmla")
            for impl in ("gluon", "gluon_ws"):
                with pytest.raises(ValueError, match=r"^impl: .*tensors on cpu"):
                    call(impl)
        with pytest.raises(ValueError, match=r"^use: expected"):
            decode(q, cache, table, seq, softmax_scale=SCALE, config=DecodeConfig)
    assert not keys
    with record_keys() as keys:
        decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=2)
    assert {k.rsplit(".", 1)[1] for k, _ in keys} == {"decode_split_kernel", "decode_merge_kernel"}


@pytest.fixture
def as_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode`` dispatches CPU tensors as on an H200 (launches must be intercepted)."""
    import mla_triton.ops.decode.gluon as gd

    real = gd.gluon_facts

    def facts(*args: Any) -> GluonFacts:
        f = real(*args)
        return replace(f, device_type="cuda", capability=(9, 0), interpreting=False,
                       api_missing=None)  # fmt: skip

    monkeypatch.setattr(gd, "gluon_facts", facts)


def _launched(call: Any) -> list[tuple[str, dict[str, Any], Any]]:
    """The ``(kernel, keyword arguments, grid)`` of every launch ``call()`` makes (none run)."""
    from mla_triton.common.intercept import intercept

    seen: list[tuple[str, dict[str, Any], Any]] = []

    def action(run: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> None:
        seen.append((kernel.fn.__name__, kwargs, grid))

    with intercept(action):
        call()
    return seen


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The launch arguments with each tensor (also inside a tuple) as its dtype and shape,
    a TMA descriptor as its base's, its shape, strides and block."""

    def plain(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return (v.dtype, tuple(v.shape))
        if hasattr(v, "block_shape") and hasattr(v, "base"):
            return (plain(v.base), *(tuple(x) for x in (v.shape, v.strides, v.block_shape)))
        return tuple(plain(x) for x in v) if isinstance(v, tuple) else v

    return {k: plain(v) for k, v in kwargs.items()}


@pytest.mark.parametrize("recipe", ["none", "fp8"])
def test_dispatch_launches_the_gluon_kernel(recipe: str, as_sm90: None) -> None:
    """On sm90 ``decode`` forced to ``"gluon"`` launches q̂ (fp8), the Gluon split kernel
    with exactly its parameters (``split_kernel_args`` filtered, plus its own) and the
    merge; at 20 heads ``"auto"`` keeps the Triton kernel; at 128 heads ``"auto"`` takes
    the Gluon split kernel for fp8 and the warp-specialized one for recipe none."""
    from mla_triton.ops.decode.gluon_kernels import gluon_decode_split_kernel

    quant = AttentionQuant.uniform("fp8") if recipe == "fp8" else None
    q, cache, table, seq = _cpu_case(20)
    names = ["decode_q_kernel"] if quant is not None else []

    def call(impl: str, config: GluonDecodeConfig | None = None) -> Any:
        return lambda: decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant,
                              num_splits=3, impl=impl, config=config)  # fmt: skip

    auto = _launched(call("auto"))  # 20 heads: the Triton kernel, or recipe none's ws kernel
    at_20 = "gluon_decode_ws_kernel" if quant is None else "decode_split_kernel"
    assert [n for n, _, _ in auto] == [*names, at_20, "decode_merge_kernel"]
    seen = _launched(call("gluon", VARIANTS[2]))
    assert [n for n, _, _ in seen] == [*names, "gluon_decode_split_kernel", "decode_merge_kernel"]
    implied = _launched(call("auto", VARIANTS[2]))  # a Gluon config forces "gluon"
    assert [(n, _plain(a)) for n, a, _ in implied] == [(n, _plain(a)) for n, a, _ in seen]
    _, args, grid = seen[-2]
    assert set(args) == set(gluon_decode_split_kernel.arg_names) | {"num_warps"}
    assert grid == (1 * 3 * 3,)  # head groups x splits x requests
    # SHAPE = (D1, D2, PAGE, BLOCK_H, BLOCK_N, HEAD_GROUPS, SPLIT_ALIGN_)
    assert args["num_warps"] == 8 and args["SHAPE"] == (512, 64, 64, 64, 32, 1, 64)
    assert args["num_splits"] == 3 and args["MULTI_SPLIT"]
    assert (args["STAGES"], args["OVERLAP"]) == (4, True)
    split = args["split"]  # common.kernels.split_program's tuple
    assert len(split) == 13 and split[1][0] is cache and split[11] == (20, 128)
    assert args["num_blocks"] == 7  # its own unspecialized argument, not in the tuple
    assert args["Q_SCALED"] == args["KV_FP8"] == (quant is not None)
    assert args["P_FMT"] == (1 if quant is not None else 0)
    assert split[12] == pytest.approx(SCALE * 1.4426950408889634)
    p_gs = FP8.p_gs if quant is not None else 1.0
    assert args["p_scales"][1] == pytest.approx(1.0 / p_gs) and args["out_scale"] == p_gs
    assert not args["V_SEP"] and not args["V_TAIL"] and not args["K_DYN"]
    assert split[0][0].dtype == torch.float16
    default = _launched(call("gluon"))[-2][1]  # the default configuration
    assert (default["SHAPE"][4], default["STAGES"], default["OVERLAP"]) == (64, 2, False)
    q128, *_ = _cpu_case(128)
    big = _launched(lambda: decode(q128, cache, table, seq, softmax_scale=SCALE, quant=quant))
    kernel = "gluon_decode_split_kernel" if quant is not None else "gluon_decode_ws_kernel"
    assert [n for n, _, _ in big] == [*names, kernel]  # one split


def test_on_read_nvfp4_launches(as_sm90: None) -> None:
    """``decode`` forced to ``"gluon"`` with nvfp4 Q/K/P/V on read launches q̂ and the
    Gluon kernel with V̂ of its own in whole-block layouts (``ON_READ_BLOCKS_CONFIG``:
    ``V_OWN`` 2, 32-token tiles, 2 stages, the static scales); ``"auto"`` takes it too;
    ``SEPARATE_V_CONFIG`` and the other schedules differ from it in ``V_OWN`` only; V
    alone nvfp4 keeps ``SEPARATE_V_CONFIG`` (``V_OWN`` True); another Gluon tiling is a
    ValueError before any launch."""
    from mla_triton.precompile import record_keys

    q, cache, table, seq = _cpu_case(128)
    nv = AttentionQuant(q="nvfp4", k="nvfp4", v=OperandQuant("nvfp4", 3.0), p="nvfp4")

    def call(impl: str, config: GluonDecodeConfig | None = None) -> Any:
        return lambda: decode(q, cache, table, seq, softmax_scale=SCALE, quant=nv,
                              num_splits=2, impl=impl, config=config)  # fmt: skip

    assert [n for n, _, _ in _launched(call("auto"))][1] == "gluon_decode_split_kernel"
    seen = _launched(call("gluon"))
    assert [n for n, _, _ in seen][1] == "gluon_decode_split_kernel"
    a = seen[1][1]
    assert _gluon_default(nv) == ON_READ_BLOCKS_CONFIG
    assert (a["V_OWN"], a["V_SEP"], a["KV_FP8"], a["OVERLAP"]) == (2, False, False, False)
    assert a["SHAPE"][4] == 32 and a["STAGES"] == 2 and (a["K_FMT"], a["V_FMT"]) == (2, 2)
    assert not a["K_EXACT"] and a["V_EXACT"]  # the default K scale is 2^k, V's 3 / 2688 not
    gs_k, gs_v = operand(nv.k).gs, operand(nv.v).gs
    assert a["k_scales"] == pytest.approx((gs_k, 1 / gs_k, 1 / (6 * gs_k)))
    assert a["v_scales"] == pytest.approx((gs_v, 1 / gs_v, 1 / (6 * gs_v)))
    assert a["split"][1][0] is cache and a["split"][0][0].dtype == torch.float16
    vb = _launched(call("gluon", ON_READ_BLOCKS_CONFIG))[1][1]
    assert _plain(vb) == _plain(a)
    # one thread a row: SEPARATE_V_CONFIG, V_OWN True
    same = _launched(call("gluon", SEPARATE_V_CONFIG))[1][1]
    assert same["V_OWN"] is True and _plain(same | {"V_OWN": 2}) == _plain(a)
    v_only = AttentionQuant(v="nvfp4", p="fp8")
    assert _gluon_default(v_only) == VARIANTS[0]
    own = _launched(lambda: decode(q, cache, table, seq, softmax_scale=SCALE, quant=v_only,
                                   num_splits=2, impl="gluon"))[-2][1]  # fmt: skip
    assert own["V_OWN"] is True and own["SHAPE"][4] == 32
    want = r"^config: V quantized into its own tiles .*bn32-st2"
    with record_keys() as keys, pytest.raises(ValueError, match=want):
        call("gluon", VARIANTS[2])()
    assert not keys
    with record_keys() as keys, pytest.raises(ValueError, match=r"^config: bn32-st2-vb is for"):
        decode(q, cache, table, seq, softmax_scale=SCALE, impl="gluon",
               config=ON_READ_BLOCKS_CONFIG)  # fmt: skip
    assert not keys


def _gluon_default(quant: AttentionQuant) -> Any:
    """The tiles ``decode`` runs the Gluon split kernel with for ``quant``, given none."""
    taken = gluon_recipe(quant)
    assert isinstance(taken, GluonRecipe)
    row = dispatch.lookup("decode", recipe_kind(taken), impl="gluon")
    return row.config if row is not None else VARIANTS[0]


SHADOW_TAKEN = {
    "fp8": (AttentionQuant.uniform("fp8"), "fp16", torch.bfloat16),
    "fp8-q-none-fp16": (AttentionQuant(k="fp8", v="fp8", p="fp8"), "fp16", torch.float16),
    "fp8-scale-3": (
        AttentionQuant(q="fp8", k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0), p="fp8"),
        "fp16",
        torch.bfloat16,
    ),
    "kv-none": (AttentionQuant(q="fp8", p="fp8"), "packed", torch.bfloat16),  # raw rows
    # a V̂ section (V_SEP): nvfp4, dynamic K, K and V of different scales or formats
    "nvfp4": (AttentionQuant.uniform("nvfp4"), "fp16", torch.bfloat16),
    "fp8-kdyn": (
        AttentionQuant(q="fp8", k=OperandQuant("fp8", "dynamic"), v="fp8", p="fp8"),
        "fp16",
        torch.bfloat16,
    ),
    "fp8-k2-v": (
        AttentionQuant(q="fp8", k=OperandQuant("fp8", 2.0), v="fp8"),
        "fp16",
        torch.bfloat16,
    ),
    "k-none-v-nvfp4": (AttentionQuant(v="nvfp4", p="nvfp4"), "fp16", torch.bfloat16),
    "kdyn-nvfp4-vfp8": (
        AttentionQuant(q="fp8", k=OperandQuant("nvfp4", "dynamic"), v="fp8", p="nvfp4"),
        "fp16",
        torch.bfloat16,
    ),
}


# the shadow recipes of ``AUTO_GLUON_SHADOWS`` (``"auto"`` runs them through Gluon)
SHADOW_VERIFIED = ("fp8", "fp8-scale-3", "nvfp4", "kdyn-nvfp4-vfp8")
# those ``"auto"`` runs through the warp-specialized kernel, at any head count
WS_AT_16 = ("fp8", "fp8-scale-3", "nvfp4")


def test_shadow_dispatch_takes() -> None:
    """``gluon_shadow_unsupported``: ``"gluon"`` takes every fp16 shadow of
    ``gluon_shadow_recipe`` (V̂ = K̂, a V̂ section) and K/V none; ``"auto"`` (above 32
    heads, and at any head count where the warp-specialized kernel takes it) those of
    ``AUTO_GLUON_SHADOWS`` only (``gluon_shadow_verified``), the others with a reason."""
    from functools import partial

    import mla_triton.ops.shadow as sh

    for name, (quant, storage, dtype) in SHADOW_TAKEN.items():
        lay = sh.shadow_layout(quant, storage=storage)
        f = replace(SM90, quant=quant, dtype=dtype)
        rule = partial(sh.gluon_shadow_taken, layout=lay)
        op = "decode_shadow"
        assert gluon_unsupported(f, forced=True, rule=rule, op=op) is None, name
        why = gluon_unsupported(f, rule=rule, op=op)
        assert choose_impl("gluon", f, rule, op) == "gluon"
        if name in SHADOW_VERIFIED:
            assert why is None and choose_impl("auto", f, rule, op) == "gluon", (name, why)
            why16 = gluon_unsupported(replace(f, heads=16), rule=rule, op=op)
            if name in WS_AT_16:  # the ws kernel: faster at 16 heads too
                assert why16 is None, why16
            else:
                assert why16 is not None and "16 heads" in why16.reason, name
        else:
            assert why is not None and "not verified on a GPU" in why.reason, (name, why)
            assert not why.covered and choose_impl("auto", f, rule, op) == "triton", name
    fp8 = AttentionQuant.uniform("fp8")
    assert sh.gluon_shadow_recipe(fp8, sh.shadow_layout(fp8), torch.bfloat16) == SHADOW_FP8
    scaled, lay3 = SHADOW_TAKEN["fp8-scale-3"][0], sh.shadow_layout(SHADOW_TAKEN["fp8-scale-3"][0])
    r3 = sh.gluon_shadow_recipe(scaled, lay3, torch.bfloat16)
    assert isinstance(r3, GluonRecipe) and r3.shadow_f16 and r3.mma_f16
    assert r3.k_gs == r3.v_gs == pytest.approx(3.0 / 448)
    none = sh.gluon_shadow_recipe(
        AttentionQuant(), sh.shadow_layout(AttentionQuant()), torch.bfloat16
    )
    assert none == UNQUANTIZED
    nv = AttentionQuant.uniform("nvfp4")
    rn = sh.gluon_shadow_recipe(nv, sh.shadow_layout(nv), torch.bfloat16)
    assert isinstance(rn, GluonRecipe), rn
    assert rn == replace(SHADOW_NVFP4, k_gs=rn.k_gs, v_gs=rn.v_gs, p_gs=rn.p_gs), rn
    assert rn.mma_f16 and not rn.v_exact  # the default static nvfp4 scale is a power of two
    kdyn = SHADOW_TAKEN["fp8-kdyn"][0]
    rk = sh.gluon_shadow_recipe(kdyn, sh.shadow_layout(kdyn), torch.bfloat16)
    assert isinstance(rk, GluonRecipe), rk
    assert rk == replace(SHADOW_KDYN, v_gs=rk.v_gs, p_gs=rk.p_gs) and rk.k_gs == 1.0, rk
    # K none, V nvfp4: raw K tiles in the input dtype, V̂ float16, S on bf16 operands
    kn = SHADOW_TAKEN["k-none-v-nvfp4"][0]
    rv = sh.gluon_shadow_recipe(kn, sh.shadow_layout(kn), torch.bfloat16)
    assert isinstance(rv, GluonRecipe) and rv.v_sep and rv.v_tail and not rv.shadow_f16
    assert not rv.mma_f16 and rv.k_fmt == 0 and rv.p_fmt == 2
    v3 = AttentionQuant(q="fp8", k="fp8", v=OperandQuant("nvfp4", 3.0))  # gs not 2^k
    r3v = sh.gluon_shadow_recipe(v3, sh.shadow_layout(v3), torch.bfloat16)
    assert isinstance(r3v, GluonRecipe) and r3v.v_exact and r3v.v_tail


@pytest.mark.parametrize(
    ("quant", "storage", "change", "needle"),
    [
        (AttentionQuant(q="fp8", k="fp8"), "fp16", {}, "K quantized with V not"),
        (AttentionQuant.uniform("fp8"), "packed", {}, "storage 'packed'"),
        (AttentionQuant(q="fp8", k="nvfp4", v="fp8"), "packed", {}, "storage 'packed'"),
        (AttentionQuant(k="fp8", v="fp8"), "fp16", {}, "no cast"),
        (AttentionQuant(k="nvfp4", v="nvfp4"), "fp16", {}, "no cast"),
        (AttentionQuant.uniform("fp8"), "fp16", {"device_type": "cpu", "capability": None},
         "tensors on cpu"),
        (AttentionQuant.uniform("fp8"), "fp16", {"kv_strides": (64 * 580, 580)}, "strides"),
    ],
)  # fmt: skip
def test_shadow_dispatch_refusals(
    quant: AttentionQuant,
    storage: str,
    change: dict[str, Any],
    needle: str,
) -> None:
    """What ``decode_shadow``'s Gluon path refuses, with the reason; ``"gluon"`` there is
    a ValueError naming ``impl``, ``"auto"`` the Triton kernel for the same reason."""
    from functools import partial

    from mla_triton.ops.shadow import gluon_shadow_taken, shadow_layout

    lay = shadow_layout(quant, storage=storage)
    facts = replace(SM90, quant=quant, **change)
    rule = partial(gluon_shadow_taken, layout=lay)
    why = gluon_unsupported(facts, forced=True, rule=rule, op="decode_shadow")
    assert why is not None and needle in why.reason, why
    assert choose_impl("auto", facts, rule, "decode_shadow") == "triton"
    with pytest.raises(ValueError, match=rf"^impl: .*{re.escape(needle)}"):
        choose_impl("gluon", facts, rule, "decode_shadow")
    auto = gluon_unsupported(facts, rule=rule, op="decode_shadow")
    assert auto is not None and needle in auto.reason, auto


def test_shadow_dispatch_launches(as_sm90: None) -> None:
    """On sm90 ``decode_shadow`` forced to ``"gluon"`` launches q̂, the Gluon split kernel
    on the shadow's float16 K̂ section (no QDQ in the kernel, K's scale in the scores, P's
    and V's on the output) and the merge; ``"auto"`` runs this recipe of
    ``AUTO_GLUON_SHADOWS`` through the warp-specialized kernel (its arguments:
    test_gluon_decode_ws.py) and one not in the table through the Triton shadow kernel;
    a refused shadow launches nothing."""
    import mla_triton.ops.shadow as sh_mod
    from mla_triton import allocate_shadow
    from mla_triton.ops.decode.gluon_kernels import gluon_decode_split_kernel
    from mla_triton.precompile import record_keys

    q, cache, table, seq = _cpu_case(128)
    fp8 = AttentionQuant.uniform("fp8")
    shadow = allocate_shadow(7, 64, fp8)

    def call(impl: str, config: Any = None, quant: AttentionQuant = fp8, sh: Any = shadow) -> Any:
        return lambda: decode_shadow(q, cache, sh, table, seq, softmax_scale=SCALE, quant=quant,
                                     num_splits=3, impl=impl, config=config)  # fmt: skip

    names = ["decode_q_kernel", "shadow_decode_split_kernel", "decode_merge_kernel"]
    seen = _launched(call("gluon"))
    assert [n for n, _, _ in seen] == [names[0], "gluon_decode_split_kernel", names[2]]
    auto = [n for n, _, _ in _launched(call("auto"))]
    assert auto == [names[0], "gluon_decode_ws_kernel", names[2]]
    _, args, grid = seen[1]
    assert set(args) == set(gluon_decode_split_kernel.arg_names) | {"num_warps"}
    assert grid == (2 * 3 * 3,) and args["SHAPE"] == (512, 64, 64, 64, 64, 2, 64)
    assert (args["Q_SCALED"], args["KV_FP8"], args["P_FMT"]) == (True, False, 1)
    split = args["split"]
    tiles = split[1][0]  # the shadow's K̂ section: float16 [7, 64, 576] in the shadow's bytes
    assert tiles.dtype == torch.float16 and tuple(tiles.shape) == (7, 64, 576)
    assert tiles.data_ptr() == shadow.data_ptr() and split[7] == (64 * 576, 576)
    assert split[0][0].dtype == torch.float16 and split[11] == (128, 128)
    assert args["num_blocks"] == 7
    assert split[12] == pytest.approx(SCALE * 1.4426950408889634 * FP8.k_gs)
    assert args["out_scale"] == pytest.approx(FP8.p_gs * FP8.v_gs)
    implied = _launched(call("auto", VARIANTS[2]))[1][1]  # a Gluon config forces "gluon"
    assert (implied["STAGES"], implied["OVERLAP"]) == (4, True)
    kv_none = AttentionQuant(q="fp8", p="fp8")
    raw = _launched(call("gluon", quant=kv_none, sh=allocate_shadow(7, 64, kv_none)))[1][1]
    assert raw["split"][1][0] is cache and not raw["KV_FP8"]
    # a V̂ section: nvfp4 (the open V block from the raw rows), 32-token tiles, 2 stages
    nvfp4 = AttentionQuant.uniform("nvfp4")
    nv_shadow = allocate_shadow(7, 64, nvfp4)
    kh, _, vh = sh_mod.shadow_layout(nvfp4).views(nv_shadow)
    assert kh is not None and vh is not None
    nv = _launched(call("gluon", quant=nvfp4, sh=nv_shadow))
    assert [n for n, _, _ in nv] == [names[0], "gluon_decode_split_kernel", names[2]]
    a = nv[1][1]
    assert (a["V_SEP"], a["V_TAIL"], a["KV_FP8"], a["K_DYN"], a["P_FMT"]) == (
        True, True, False, False, 2
    )  # fmt: skip
    assert a["SHAPE"][4] == 32 and (a["STAGES"], a["OVERLAP"]) == (2, False)
    k_t, v_t, raw_t, ks_t = a["split"][1]
    assert k_t.data_ptr() == kh.data_ptr() and v_t.data_ptr() == vh.data_ptr()
    assert raw_t is cache and ks_t is cache and tuple(v_t.shape) == (7, 64, 512)
    row = sh_mod.shadow_layout(nvfp4).token_bytes // 2
    assert a["split"][7] == (64 * row, row, 64 * row, row, *cache.stride()[:2], *cache.stride()[:2])
    assert a["v_scales"][0] == pytest.approx(operand(nvfp4.v).gs) and not a["V_EXACT"]
    same = _launched(call("gluon", config=SEPARATE_V_CONFIG, quant=nvfp4, sh=nv_shadow))[1][1]
    assert _plain(same) == _plain(a)
    # dynamic K: its per-token scales are the fourth pointer
    kdyn = SHADOW_TAKEN["fp8-kdyn"][0]
    kd_shadow = allocate_shadow(7, 64, kdyn)
    _, ks, _ = sh_mod.shadow_layout(kdyn).views(kd_shadow)
    assert ks is not None
    kd = _launched(call("gluon", quant=kdyn, sh=kd_shadow))[1][1]
    assert [n for n, _, _ in _launched(call("auto", quant=kdyn, sh=kd_shadow))] == names
    assert kd["K_DYN"] and kd["V_SEP"] and not kd["V_TAIL"]
    assert (
        kd["split"][1][3].data_ptr() == ks.data_ptr() and kd["split"][1][3].dtype == torch.float32
    )
    assert kd["split"][12] == pytest.approx(SCALE * 1.4426950408889634)  # K's scale per token
    with record_keys() as keys:
        with pytest.raises(ValueError, match=r"^config: a shadow with a V̂ section .* bn32-st2"):
            call("gluon", config=VARIANTS[0], quant=nvfp4, sh=nv_shadow)()
        packed = allocate_shadow(7, 64, nvfp4, storage="packed")
        with pytest.raises(ValueError, match=r"^config: a packed shadow runs the warp-spec"):
            decode_shadow(q, cache, packed, table, seq, softmax_scale=SCALE, quant=nvfp4,
                          storage="packed", config=SEPARATE_V_CONFIG)  # fmt: skip
    assert not keys


def test_warmup_covers_the_gluon_keys(as_sm90: None) -> None:
    """``warmup_decode`` on an sm90 engine compiles the Gluon split kernel for the split
    counts serving reaches (one key for one split, one for several): the keys of a
    serving sweep (record_keys, sm_90) are all warmed. fp8 (recipe none runs the
    warp-specialized kernel: test_gluon_decode_ws.py)."""
    from test_warmup import make_engine, sweep, warm

    from mla_triton.precompile import decode_split_counts, record_keys

    for quant in (AttentionQuant.uniform("fp8"),):
        engine = make_engine(quant, False, blocks=37, width=35, max_rows=40, max_seq_len=2176,
                             dtype=torch.float16, device="cpu")  # fmt: skip
        with record_keys() as warmed:
            warm(engine, prefill_too=False)
        with record_keys() as served:
            sweep(engine, random.Random(0), prefill_too=False)
        gluon = {key for kernel, key in warmed if kernel.endswith("gluon_decode_split_kernel")}
        # 8 split counts reachable, 2 keys: one split and several (a runtime count)
        assert len(decode_split_counts(40, 128, 2176, block_h=64)) == 8 and len(gluon) == 2
        names = {kernel.rsplit(".", 1)[1] for kernel, _ in served}
        split = {name for name in names if "split_kernel" in name}
        assert split == {"gluon_decode_split_kernel"}, split  # 128 heads on sm90: Gluon only
        missing = set(served) - set(warmed)
        assert not missing, sorted(missing)[:3]


def test_preferred() -> None:
    """The Triton kernel up to 32 heads for a quantized recipe (the split kernel measured
    slower at 16), the Gluon one above; recipe none the warp-specialized one at any."""
    fp8 = recipe_kind(FP8)
    assert dispatch.lookup("decode", fp8, 16) is None and dispatch.lookup("decode", fp8, 32) is None
    for heads in (33, 128):
        row = dispatch.lookup("decode", fp8, heads)
        assert row is not None and row.impl == "gluon"
    for heads in (1, 16, 128):
        row = dispatch.lookup("decode", UNQUANTIZED, heads)
        assert row is not None and row.impl == "gluon_ws"


def test_config_checks() -> None:
    with pytest.raises(ValueError, match=r"config\.block_n"):
        GluonDecodeConfig(block_n=16, stages=2)
    with pytest.raises(ValueError, match=r"config\.stages"):
        GluonDecodeConfig(block_n=64, stages=5)
    with pytest.raises(ValueError, match=r"config\.overlap"):
        GluonDecodeConfig(block_n=32, stages=2, overlap=True)
    with pytest.raises(ValueError, match=r"config\.on_read"):
        GluonDecodeConfig(block_n=32, stages=4, on_read=2)
    assert ON_READ_BLOCKS_CONFIG.name == "bn32-st2-vb"
    for bad in (0, 3, 4, True):
        with pytest.raises(ValueError, match=r"config\.on_read"):
            GluonDecodeConfig(block_n=32, stages=2, on_read=bad)
