"""The warp-specialized Gluon sm90 decode (``mla_triton.ops.decode.gluon_ws``).

CPU (CI): the default and the TMA / 4-slot-ring variants compiled for sm_90a (in a
child process without Triton's interpreter, as test_gluon_decode.py does): three
partitions of four warps with the planned register split, the dots on wgmma in the
planned order of barrier waits, ``cp.async`` or TMA boxes and mbarriers, no spills, no
serialized wgmma, shared memory within the limit (no count of the compiler's
instructions); the refusals of ``decode`` forced to a ``WsConfig`` (``tuning.use``,
before any launch) and the launch arguments it passes through the decode core (the TMA
descriptor where the cache allows one). The GPU part: test_gluon_decode_ws_gpu.py.
"""

from __future__ import annotations

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
from test_gluon_decode import _cpu_case, _launched, _plain, as_sm90  # noqa: F401  (a fixture)

import mla_triton.ops.decode.gluon_ws as ws
from mla_formats import AttentionQuant, OperandQuant
from mla_triton.common.splitk import check_call, operand
from mla_triton.ops.decode.dispatch import choose
from mla_triton.ops.decode.gluon import VARIANTS as GLUON_VARIANTS
from mla_triton.ops.decode.gluon import GluonRecipe, max_shared_bytes
from mla_triton.ops.decode.gluon_ws import (
    FP8_SHADOW,
    NVFP4_CONFIG,
    NVFP4_PACKED,
    NVFP4_PACKED_CONFIG,
    NVFP4_SHADOW,
    NVFP4_TMA_CONFIG,
    VARIANTS,
    WsConfig,
    WsFamily,
    compile_ws,
)

SCALE = 576**-0.5
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


COMPILED = (VARIANTS[0], *VARIANTS[3:])
"""The variants the CPU test compiles: the default and the new loads and rings (the
chunked ones, ``[1:3]``: compiled by the GPU script's check; each compile is 3 to 5 s)."""
UNQ = GluonRecipe()
COMPILE_CASES = [(cfg, UNQ) for cfg in COMPILED] + [
    (VARIANTS[0], FP8_SHADOW), (NVFP4_CONFIG, NVFP4_SHADOW), (NVFP4_TMA_CONFIG, NVFP4_SHADOW),
    (NVFP4_PACKED_CONFIG, NVFP4_PACKED),
]  # fmt: skip
"""``(config, recipe)``: recipe none for every compiled variant, fp8 Q/K/P/V through the
float16 shadow (V̂ = K̂) for the default (what ``decode_shadow`` forced to ``WsConfig()`` runs),
nvfp4 Q/K/P/V (its V̂ section, ``V_SEP``) with ``NVFP4_CONFIG`` and ``NVFP4_TMA_CONFIG``,
and the packed nvfp4 shadow with ``NVFP4_PACKED_CONFIG``."""


def _recipe_id(recipe: GluonRecipe) -> str:
    if recipe.packed:
        return "-nvfp4-packed"
    return "-nvfp4-shadow" if recipe.v_sep else ("-fp8-shadow" if recipe.shadow_f16 else "")


@pytest.mark.skipif(not INTERPRETED, reason="the compile test runs in this process")
def test_compile_test_in_child() -> None:
    """The compile test passes in a child pytest with TRITON_INTERPRET=0 (Gluon cannot
    compile the interpreter's functions)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(
        [*cmd, "-k", "test_compiles_for_sm90a"], env=os.environ | {"TRITON_INTERPRET": "0"},
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{len(COMPILE_CASES)} passed" in done.stdout, done.stdout[-2000:]


@pytest.mark.skipif(INTERPRETED, reason="compiled in a child process without the interpreter")
@pytest.mark.parametrize(
    ("cfg", "recipe"), COMPILE_CASES,
    ids=[c.name + _recipe_id(r) for c, r in COMPILE_CASES],
)  # fmt: skip
def test_compiles_for_sm90a(cfg: WsConfig, recipe: GluonRecipe) -> None:
    """Each compiled variant (several splits: the workspace epilogue; page 64) compiles to
    the plan: the dots on wgmma (S on ``64 x BLOCK_N``, P V on 256 features) on the
    recipe's operand types in the planned order of waits, its loads (TMA: nine boxes a
    tile on one expect-tx barrier, no ``cp.async``), no spills, no serialized wgmma, the
    ring within the shared-memory limit. The fp8 shadow: the same schedule on float16
    operands (q̂, K̂ = V̂, P̂) and P̂'s E4M3 rounding; recipe none converts nothing to
    E4M3. The nvfp4 shadow (32-token tiles, two slots): a V̂ ring beside the K̂ ring, its
    rows copied by the producer (``NVFP4_TMA_CONFIG``: K̂'s nine boxes and V̂'s eight, each
    on an expect-tx barrier of its own), P̂'s and the open V block's E4M3 block scales.
    The packed shadow: ``cp.async`` of every 16-row unit's bytes (16-byte pieces of its
    codes) into the staging buffers, at most one 4-byte word spilled (a thread index the
    worker's entry computes for the producer, live across its ``setmaxnreg``; the
    registers it uses are far below 104), shared memory within the limit."""
    assert not cfg.chunked
    c = compile_ws(cfg, num_splits=2, recipe=recipe)
    assert c.num_warps == 12  # the default partition and two workers of four warps
    # q [64, 576] and the ring's slots of 576 features (P lives in the slots' rope part)
    ring = cfg.stages * cfg.block_n * 576 * 2
    v_ring = cfg.stages * cfg.block_n * 512 * 2 if recipe.v_sep else 0
    assert 64 * 576 * 2 + ring + v_ring <= c.shared <= max_shared_bytes(), c.shared
    # every ring holds 144 KiB; the nvfp4 shadow's two of 32-token K̂ and V̂ tiles 136 KiB
    assert ring + v_ring == (2 * 32 * 1088 * 2 if recipe.v_sep else 2 * 64 * 576 * 2)
    shapes: dict[str, int] = {}
    mma = "f16" if recipe.shadow_f16 else "bf16"
    for m in re.findall(rf"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k16)\.f32\.{mma}\.", c.ptx):
        shapes[m] = shapes.get(m, 0) + 1
    # S in 64 x BLOCK_N tiles and P V on 256 features, every wgmma on the recipe's types
    assert set(shapes) == {f"m64n{cfg.block_n}k16", "m64n256k16"}, shapes
    assert sum(shapes.values()) == len(re.findall(r"wgmma\.mma_async", c.ptx))
    # the other's P V waited for with S's first chunk in flight (then its slot is free)
    assert "wgmma.wait_group.sync.aligned 1;" in c.ptx
    # the order of each warpgroup's loop (run lengths aside): pready wait, the other's
    # P V, landed wait, S with the wait for that P V inside; early_s: landed wait, S,
    # pready wait, P V, the wait for S alone
    order = re.sub(r"[SV]\d+", lambda m: m.group(0)[0], _wgmma_trace(c.ptx))
    loop = "WSWVw1" if cfg.early_s else "WVWSw1S"
    assert loop in order, order
    regs = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", c.ptx)
    asked = {int(n) for _, n in regs}
    assert {cfg.math_regs, cfg.producer_regs, 504 - cfg.math_regs - cfg.producer_regs} <= asked
    cp_async = "cp.async.cg.shared.global" in c.ptx or "cp.async.ca.shared.global" in c.ptx
    boxes = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global\.mbarrier", c.ptx)
    expects = re.findall(r"mbarrier\.arrive\.expect_tx\.shared::cta\.b64 _, \[%r\d+\], (\d+);",
                         c.ptx)  # fmt: skip
    if cfg.tma and recipe.v_sep:  # K̂'s nine boxes on one barrier, then V̂'s eight on another
        assert len(boxes) == 17 and not cp_async
        assert expects == [str(9 * cfg.block_n * 128), str(8 * cfg.block_n * 128)], expects
    elif cfg.tma:  # 8 kv_c boxes and k_pe's, the tile's bytes expected on one barrier
        assert len(boxes) == 9 and not cp_async
        assert expects == [str(9 * cfg.block_n * 64 * 2)], expects
    elif recipe.packed:  # each unit's bytes by cp.async, 16 bytes a piece
        assert cp_async and not boxes and not expects
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10,", c.ptx)
    else:
        assert cp_async and not boxes and not expects
    assert "mbarrier.try_wait" in c.ptx and "mbarrier.arrive" in c.ptx
    # whole tile: the producer waits for its copies and arrives on the tile's barrier
    assert "cp.async.mbarrier.arrive.noinc.shared.b64" not in c.ptx
    assert not re.search(r"\b(ld|st)\.local\b", c.ptx)
    assert "ttg.warp_specialize" in c.ttgir
    spilled = re.search(r"(\d+) bytes spill stores", c.ptxas_info)
    assert spilled is not None, c.ptxas_info
    if recipe.packed:  # one hoisted thread-index word (measured 4)
        assert int(spilled.group(1)) <= 4, c.ptxas_info
    else:
        assert "0 bytes spill stores, 0 bytes spill loads" in c.ptxas_info, c.ptxas_info
    assert "C7515" not in c.ptxas_info, c.ptxas_info
    e4m3 = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", c.ptx))
    assert (e4m3 > 0) == (recipe.p_fmt != 0), e4m3  # P̂ (nvfp4: its block scales) only


def _wgmma_trace(ptx: str) -> str:
    """The PTX's mbarrier waits (``W``), runs of wgmma (``S<n>``: ``64 x BLOCK_N``, ``V<n>``:
    ``64 x 256``) and wgmma waits (``w<n>``), in text order."""
    events = []
    for line in ptx.splitlines():
        if "mbarrier.try_wait" in line:
            events.append("W")
        elif "wgmma.mma_async" in line:
            events.append("V" if "n256k16" in line else "S")
        elif "wgmma.wait_group" in line:
            events.append("w" + line.split()[-1].rstrip(";"))
    return re.sub(r"([SV])\1*", lambda m: f"{m.group(1)}{len(m.group())}", "".join(events))


def test_config_checks() -> None:
    assert [c.name for c in VARIANTS] == [
        "ws-r232-p40-tile", "ws-r232-p40", "ws-r224-p56", "ws-r232-p40-tile-tma",
        "ws-r232-p40-tile-tma-es", "ws-r232-p40-tile-tma-n32s4-es",
    ]  # fmt: skip
    # each new variant equals one with a feature fewer bit for bit (the GPU checks)
    first = ws.twin(VARIANTS[5])
    assert first is not None and first.name == "ws-r232-p40-tile-tma-n32s4"
    second = ws.twin(first)
    assert second is not None and second.name == "ws-r232-p40-tile-n32s4"
    assert ws.twin(VARIANTS[4]) == VARIANTS[3] and ws.twin(VARIANTS[3]) == VARIANTS[0]
    assert ws.twin(VARIANTS[0]) is None and not WsConfig().early_s
    early = replace(NVFP4_TMA_CONFIG, early_s=True)
    assert early.name == "ws-r232-p40-tile-tma-n32s2-es"
    assert ws.twin(early) == NVFP4_TMA_CONFIG  # then tma
    assert ws.twin(NVFP4_TMA_CONFIG) == NVFP4_CONFIG
    assert NVFP4_PACKED_CONFIG.name == "ws-r200-p104-tile-n32s2"
    assert WsConfig() == VARIANTS[0]  # the default: whole-tile barriers (fastest measured)
    assert (WsConfig().tma, WsConfig().block_n, WsConfig().stages) == (False, 64, 2)
    with pytest.raises(ValueError, match=r"^config\.block_n: expected 32 or 64, got 16"):
        WsConfig(block_n=16)
    with pytest.raises(ValueError, match=r"^config\.stages: .* got 4 with block_n 64"):
        WsConfig(stages=4)
    with pytest.raises(ValueError, match=r"^config\.stages: .* got 3 with block_n 32"):
        WsConfig(block_n=32, stages=3)
    with pytest.raises(ValueError, match=r"^config\.math_regs"):
        WsConfig(math_regs=260)
    with pytest.raises(ValueError, match=r"^config\.producer_regs"):
        WsConfig(producer_regs=44)


def test_refusals_before_any_launch() -> None:
    """``decode`` forced to ``WsConfig()`` or ``"gluon_ws"``: a quantized recipe, CPU
    tensors (no sm90 GPU) and bad input are a ValueError naming the argument; an object
    that is no tuning config is refused by ``tuning.use``; ``decode_shadow`` with a
    WsConfig: the same platform rule (its own refusals: ``test_shadow_refusals``);
    nothing launches."""
    from mla_triton import allocate_shadow
    from mla_triton.precompile import record_keys

    q, cache, table, seq = _cpu_case(128)
    fp8 = AttentionQuant.uniform("fp8")
    ws_cfg = WsConfig()
    with record_keys() as keys:
        with pytest.raises(ValueError, match=r"^quant: the warp-specialized .* recipe none"):
            decode(q, cache, table, seq, softmax_scale=SCALE, quant=fp8, config=ws_cfg)
        with pytest.raises(ValueError, match=r"^use: expected"):
            decode(q, cache, table, seq, softmax_scale=SCALE, config=1)
        with pytest.raises(ValueError, match=r"^impl: the warp-specialized .*tensors on cpu"):
            decode(q, cache, table, seq, softmax_scale=SCALE, config=ws_cfg)
        with pytest.raises(ValueError, match=r"^impl: .*tensors on cpu"):
            decode(q, cache, table, seq, softmax_scale=SCALE, impl="gluon_ws")
        with pytest.raises(ValueError, match=r"^softmax_scale"):
            decode(q, cache, table, seq, softmax_scale=float("nan"), config=ws_cfg)
        shadow = allocate_shadow(7, 64, fp8)
        with pytest.raises(ValueError, match=r"^impl: the warp-specialized .*tensors on cpu"):
            decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE, quant=fp8,
                          config=ws_cfg)  # fmt: skip
    assert not keys


@pytest.mark.usefixtures("as_sm90")
def test_launch_arguments() -> None:
    """Through the decode core: the ws kernel with exactly its parameters, 64 heads and
    64 tokens a CTA, 4 warps, the config's registers, then the merge (several splits)."""
    from mla_triton.common.intercept import intercept
    from mla_triton.ops.decode.gluon_ws_kernels import gluon_decode_ws_kernel

    seen: list[tuple[str, dict[str, Any], Any]] = []

    def action(run: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> None:
        seen.append((kernel.fn.__name__, kwargs, grid))

    q, cache, table, seq = _cpu_case(128)
    with intercept(action):
        decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=3, config=VARIANTS[2])
    assert [n for n, _, _ in seen] == ["gluon_decode_ws_kernel", "decode_merge_kernel"]
    _, args, grid = seen[0]
    assert set(args) == set(gluon_decode_ws_kernel.arg_names) | {"num_warps"}
    assert grid == (2 * 3 * 3,)  # head groups x splits x requests
    assert args["num_warps"] == 4 and args["SHAPE"] == (512, 64, 64, 64, 64, 2, 64)
    assert args["num_splits"] == 3 and args["MULTI_SPLIT"]
    assert (args["MATH_REGS"], args["PRODUCER_REGS"], args["CHUNKED"]) == (224, 56, True)
    assert args["split"][1][0] is cache and args["out_scale"] == 1.0
    assert args["split"][12] == pytest.approx(SCALE * 1.4426950408889634)
    seen.clear()
    with intercept(action):
        decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=1, config=WsConfig())
    assert [n for n, _, _ in seen] == ["gluon_decode_ws_kernel"]
    one = seen[0][1]
    assert not one["MULTI_SPLIT"]
    assert (one["MATH_REGS"], one["PRODUCER_REGS"], one["CHUNKED"]) == (232, 40, False)
    assert (one["STAGES"], one["TMA"], one["kv_desc"]) == (2, False, None)


@pytest.mark.usefixtures("as_sm90")
def test_tma_and_ring_arguments() -> None:
    """``tma``: a descriptor of the cache's ``[blocks * page, 576]`` rows in ``[block_n,
    64]`` boxes where a page holds whole tiles and pages lie back to back, else
    ``cp.async`` (``TMA`` off, no descriptor); ``block_n`` and ``stages`` reach ``SHAPE``
    and ``STAGES``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from mla_triton.common.intercept import intercept

    seen: list[dict[str, Any]] = []

    def action(run: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> None:
        if kernel.fn.__name__ == "gluon_decode_ws_kernel":
            seen.append(kwargs)

    q, cache, table, seq = _cpu_case(128)  # 7 pages of 64 tokens
    wide = torch.zeros(7, 64, 640, dtype=cache.dtype)[..., :576]  # rows of 640: still TMA
    gapped = torch.zeros(7, 65, 576, dtype=cache.dtype)[:, :64]  # a row between pages: not
    page16 = torch.zeros(28, 16, 576, dtype=cache.dtype)
    ring = WsConfig(block_n=32, stages=4)  # cp.async
    cases = [(VARIANTS[3], cache, table), (VARIANTS[5], cache, table), (VARIANTS[3], wide, table),
             (VARIANTS[3], gapped, table), (VARIANTS[5], page16, table.repeat(1, 4)),
             (ring, cache, table)]  # fmt: skip
    with intercept(action):
        for cfg, kv, tab in cases:
            decode(q, kv, tab, seq, softmax_scale=SCALE, num_splits=2, config=cfg)
    descs = [a["kv_desc"] for a in seen]
    assert [a["TMA"] for a in seen] == [True, True, True, False, False, False]
    assert descs[3] is None and descs[4] is None and descs[5] is None
    for d, kv, n in zip(descs[:3], (cache, cache, wide), (64, 32, 64), strict=True):
        assert isinstance(d, TensorDescriptor) and d.base is kv
        assert (list(d.shape), list(d.strides), list(d.block_shape)) == (
            [7 * 64, 576],
            [kv.stride(1), 1],
            [n, 64],
        )
    rings = [(64, 2), (32, 4), (64, 2), (64, 2), (32, 4), (32, 4)]
    assert [(a["SHAPE"][4], a["STAGES"]) for a in seen] == rings
    assert seen[4]["SHAPE"][2] == 16  # page 16: cp.async
    assert [a["EARLY_S"] for a in seen] == [False, True, False, False, True, False]
    flat = torch.zeros(7 * 64 * 576 + 8, dtype=cache.dtype)
    assert ws.tma_descriptor(flat[8:].view(7, 64, 576), 64) is not None  # 16-byte aligned
    assert ws.tma_descriptor(flat[4:-4].view(7, 64, 576), 64) is None  # 8 bytes off
    assert ws.tma_descriptor(torch.zeros(0, 64, 576, dtype=cache.dtype), 64) is None
    assert ws.tma_descriptor(torch.zeros(7, 64, 576), 64) is None  # float32


def _split(call: Any) -> str:
    """The split kernel ``call()`` launches (none run)."""
    names = [n for n, _, _ in _launched(call) if n != "decode_q_kernel"]
    assert len(names) == 2 and names[1] == "decode_merge_kernel", names  # two splits
    return names[0]


@pytest.mark.usefixtures("as_sm90")
def test_recipe_none_dispatches_the_ws_kernel() -> None:
    """On sm90, recipe none unforced and forced to ``"gluon_ws"``, at any head count,
    launches the warp-specialized kernel (``WsFamily``, ``DEFAULT_CONFIG``) with the very
    arguments of ``decode`` forced to ``DEFAULT_CONFIG``; ``"gluon"`` (the Gluon split
    kernel), a ``GluonDecodeConfig``, fp8 (128 heads: the Gluon split kernel; 20 heads:
    the Triton one) and the fp8 shadow forced to ``"gluon"`` keep theirs."""
    from mla_triton import allocate_shadow

    q, cache, table, seq = _cpu_case(128)
    q20, *_ = _cpu_case(20)
    fp8 = AttentionQuant.uniform("fp8")
    shadow = allocate_shadow(7, 64, fp8)

    def call(q: torch.Tensor = q, **kw: Any) -> Any:
        return lambda: decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=2, **kw)

    def family(impl: str, quant: AttentionQuant | None = None) -> object:
        c = check_call(q, cache, table, seq, SCALE, 512, quant, None)
        return choose(c, cache, quant, 512, (impl, None))[0]

    plain = {"auto": call(), "gluon_ws": call(impl="gluon_ws"),
             "none": call(quant=AttentionQuant()), "h20": call(q20, impl="gluon_ws"),
             "h20-auto": call(q20)}  # fmt: skip
    for name, c in plain.items():
        assert _split(c) == "gluon_decode_ws_kernel", name
    kept = {"gluon": call(impl="gluon"), "config": call(config=GLUON_VARIANTS[0]),
            "fp8": call(quant=fp8), "h20-fp8": call(q20, quant=fp8),
            "shadow": lambda: decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE,
                                            quant=fp8, num_splits=2, impl="gluon")}  # fmt: skip
    assert {name: _split(c) for name, c in kept.items()} == {
        "gluon": "gluon_decode_split_kernel", "config": "gluon_decode_split_kernel",
        "fp8": "gluon_decode_split_kernel", "h20-fp8": "decode_split_kernel",
        "shadow": "gluon_decode_split_kernel",
    }  # fmt: skip
    assert family("auto") is family("gluon_ws") is ws.ws_family(ws.DEFAULT_CONFIG)
    assert not isinstance(family("gluon"), WsFamily)
    assert not isinstance(family("auto", fp8), WsFamily)
    direct = _launched(call(config=ws.DEFAULT_CONFIG))
    assert [(n, _plain(a), g) for n, a, g in _launched(plain["auto"])] == [
        (n, _plain(a), g) for n, a, g in direct
    ]


@pytest.mark.usefixtures("as_sm90")
def test_warmup_compiles_what_recipe_none_launches() -> None:
    """An sm90 engine of recipe none: ``warmup_decode`` records the warp-specialized
    kernel's keys (one split and several) and exactly the keys a serving sweep of batches
    and lengths launches (record_keys, sm_90)."""
    from test_warmup import decode_keys

    from mla_triton.ops.decode import gluon_kernels, gluon_ws_kernels

    # warmup_decode's split policy reads the CTA's heads: the same for both Gluon kernels
    assert gluon_ws_kernels.BLOCK_H == gluon_kernels.BLOCK_H
    warmed, served = decode_keys(None)
    launched = {kernel.rsplit(".", 1)[1] for kernel, _ in served}
    assert launched == {"gluon_decode_ws_kernel", "decode_merge_kernel"}, launched
    assert len({key for kernel, key in warmed if kernel.endswith("gluon_decode_ws_kernel")}) == 2
    assert warmed == served, (sorted(served - warmed)[:3], sorted(warmed - served)[:3])


@pytest.mark.usefixtures("as_sm90")
@pytest.mark.parametrize(
    ("recipe", "heads", "storage"),
    [("none", 16, "fp16"), ("nvfp4", 16, "fp16"), ("fp8", 16, "fp16"), ("nvfp4", 16, "packed"),
     ("nvfp4", 128, "packed")],
)  # fmt: skip
def test_warmup_covers_the_ws_kernel(
    recipe: str, heads: int, storage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the unforced dispatch runs the warp-specialized kernel on sm90 (16 heads, TP8
    DeepSeek: recipe none, the nvfp4 and fp8 shadows, the packed one; the packed shadow at
    128 heads), the warm-up records every key a serving sweep launches (its split policy
    sees the kernel's head groups)."""
    import test_warmup as tw

    monkeypatch.setattr(tw, "HEADS", heads)
    quant = {"none": None, "nvfp4": tw.NVFP4, "fp8": tw.FP8}[recipe]
    engine = tw.make_engine(quant, quant is not None, blocks=37, width=35, max_rows=40,
                            max_seq_len=2176, dtype=torch.float16, device="cpu")  # fmt: skip
    engine.storage = storage
    warmed = tw._keys(lambda: tw.warm(engine, prefill_too=False))
    served = tw._keys(lambda: tw.sweep(engine, random.Random(0), prefill_too=False))
    names = {kernel.rsplit(".", 1)[1] for kernel, _ in served}
    assert {n for n in names if "split" in n or "ws" in n} == {"gluon_decode_ws_kernel"}, names
    assert served <= warmed, sorted(served - warmed)[:3]


# ------------------------------------------------------- fp8 through the shadow (CPU)

FP8_3 = AttentionQuant(q="fp8", k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0), p="fp8")
"""fp8 Q/K/P/V, K and V under one static scale (3: not a power of two), so V̂ = K̂."""


@pytest.mark.usefixtures("as_sm90")
def test_shadow_launch_arguments() -> None:
    """``decode_shadow`` forced to ``WsConfig()`` through the decode core: q̂ (``decode_q_kernel``),
    the ws kernel with exactly its parameters reading the shadow's float16 K̂ view (its
    pointer, page and row strides; TMA: a descriptor of that view), q̂ float16 with its
    scales, ``Q_SCALED`` / ``K_FMT`` / ``P_FMT``, P̂'s scales, K's scale in the score scale,
    ``gs_p gs_v`` on the output, then the merge; recipe none passes no P̂ scales."""
    from mla_triton import allocate_shadow
    from mla_triton.ops.decode.gluon_ws_kernels import gluon_decode_ws_kernel

    q, cache, table, seq = _cpu_case(128)
    shadow = allocate_shadow(7, 64, FP8_3)

    def call(cfg: WsConfig) -> Any:
        return lambda: decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE,
                                     quant=FP8_3, num_splits=2, config=cfg)  # fmt: skip

    launched = _launched(call(WsConfig()))
    assert [n for n, _, _ in launched] == [
        "decode_q_kernel", "gluon_decode_ws_kernel", "decode_merge_kernel",
    ]  # fmt: skip
    _, args, grid = launched[1]
    assert set(args) == set(gluon_decode_ws_kernel.arg_names) | {"num_warps"}
    assert grid == (2 * 2 * 3,) and args["num_warps"] == 4 and args["MULTI_SPLIT"]
    split = args["split"]
    (tiles,) = split[1]
    assert tiles.dtype == torch.float16 and tuple(tiles.shape) == (7, 64, 576)
    assert tiles.data_ptr() == shadow.data_ptr() and split[7] == (64 * 576, 576)
    assert split[0][0].dtype == split[0][1].dtype == torch.float16  # q̂
    assert split[0][2].dtype == torch.float32 and split[0][2].numel() >= 3 * 128  # its scales
    ko, vo, po = (operand(x) for x in (FP8_3.k, FP8_3.v, FP8_3.p))
    assert (args["Q_SCALED"], args["K_FMT"], args["P_FMT"]) == (True, 1, 1)
    assert args["p_hat_scales"] == (po.gs, 1.0 / po.gs, 1.0 / (6.0 * po.gs))
    assert args["out_scale"] == po.gs * vo.gs
    assert split[12] == pytest.approx(SCALE * 1.4426950408889634 * ko.gs)
    assert (args["TMA"], args["kv_desc"], args["STAGES"]) == (False, None, 2)
    tma = _launched(call(VARIANTS[3]))[1][1]
    desc = tma["kv_desc"]
    assert tma["TMA"] and desc.base.data_ptr() == shadow.data_ptr()
    assert desc.base.dtype == torch.float16
    assert (list(desc.shape), list(desc.strides)) == ([7 * 64, 576], [576, 1])
    none = _launched(lambda: decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=2,
                                    config=WsConfig()))[0][1]  # fmt: skip
    assert none["p_hat_scales"] is None and (none["Q_SCALED"], none["P_FMT"]) == (False, 0)


@pytest.mark.usefixtures("as_sm90")
def test_nvfp4_shadow_launch_arguments() -> None:
    """``decode_shadow`` forced to ``NVFP4_CONFIG`` on an nvfp4 shadow (bf16 raw rows): the ws
    kernel with its exact parameters, ``V_SEP`` on, the cache pointers ``(K̂, V̂, raw rows,
    raw rows)`` (the shadow's float16 K̂ ``[7, 64, 576]`` and V̂ section ``[7, 64, 512]``,
    their page and row strides), 32-token tiles and two slots, q̂ float16, ``K_FMT`` and
    ``P_FMT`` 2, P̂'s and the open V block's scale triples, ``gs_p gs_v``; then the merge.
    Unforced, ``decode_shadow`` launches the very same arguments."""
    from mla_triton import allocate_shadow
    from mla_triton.ops.decode.gluon_ws_kernels import gluon_decode_ws_kernel

    q, cache, table, seq = _cpu_case(128)
    nvfp4 = AttentionQuant.uniform("nvfp4")
    shadow = allocate_shadow(7, 64, nvfp4)

    def call(**kw: Any) -> Any:
        return lambda: decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE,
                                     quant=nvfp4, num_splits=2, **kw)  # fmt: skip

    launched = _launched(call(config=NVFP4_CONFIG))
    assert [n for n, _, _ in launched] == [
        "decode_q_kernel", "gluon_decode_ws_kernel", "decode_merge_kernel",
    ]  # fmt: skip
    _, args, grid = launched[1]
    assert set(args) == set(gluon_decode_ws_kernel.arg_names) | {"num_warps"}
    assert grid == (2 * 2 * 3,) and args["MULTI_SPLIT"] and args["V_SEP"]
    assert (args["STAGES"], args["SHAPE"][4], args["TMA"], args["kv_desc"]) == (2, 32, False, None)
    kh, vh, raw, ks = args["split"][1]
    assert kh.dtype == vh.dtype == torch.float16 and kh.data_ptr() == shadow.data_ptr()
    assert (tuple(kh.shape), tuple(vh.shape)) == ((7, 64, 576), (7, 64, 512))
    assert raw is cache and ks is cache  # no K scales: the raw rows' pointer stands in
    strides = (kh.stride(0), kh.stride(1), vh.stride(0), vh.stride(1))
    assert args["split"][7] == (*strides, *cache.stride()[:2], *cache.stride()[:2])
    assert args["split"][0][0].dtype == torch.float16  # q̂
    assert (args["Q_SCALED"], args["K_FMT"], args["P_FMT"]) == (True, 2, 2)
    vo, po = operand(nvfp4.v), operand(nvfp4.p)
    assert args["p_hat_scales"] == (po.gs, 1.0 / po.gs, 1.0 / (6.0 * po.gs))
    assert args["v_tail_scales"] == (vo.gs, 1.0 / vo.gs, 1.0 / (6.0 * vo.gs))
    assert args["out_scale"] == po.gs * vo.gs
    assert [(n, _plain(a), g) for n, a, g in _launched(call())] == [
        (n, _plain(a), g) for n, a, g in launched
    ]
    # NVFP4_TMA_CONFIG: a descriptor of the K̂ view and one of the V̂ section, each over
    # the shadow's own rows ([7 * 64, width], its row stride), 32-token boxes; all else as
    # NVFP4_CONFIG's launch
    tma_args = _launched(call(config=NVFP4_TMA_CONFIG))[1][1]
    kd, vd = tma_args["kv_desc"]
    assert tma_args["TMA"] and (kd.base, vd.base) == tma_args["split"][1][:2]
    assert (kd.base.data_ptr(), vd.base.data_ptr()) == (kh.data_ptr(), vh.data_ptr())
    for d, view in ((kd, kh), (vd, vh)):
        assert (list(d.shape), list(d.strides), list(d.block_shape)) == (
            [7 * 64, view.shape[2]], [view.stride(1), 1], [32, 64],
        )  # fmt: skip
    assert vh.data_ptr() + (7 * 64 - 1) * vh.stride(1) * 2 + 1024 <= (
        shadow.data_ptr() + shadow.numel()
    )  # the V̂ descriptor's last row ends inside the shadow
    assert {k: v for k, v in _plain(tma_args).items() if k not in ("TMA", "kv_desc")} == {
        k: v for k, v in _plain(args).items() if k not in ("TMA", "kv_desc")
    }


@pytest.mark.usefixtures("as_sm90")
def test_packed_shadow_launch_arguments() -> None:
    """``decode_shadow`` on the packed nvfp4 shadow (``storage="packed"``): without a config
    and with ``NVFP4_PACKED_CONFIG``, the ws kernel with ``PACKED`` and ``V_SEP`` on, its
    register split, no TMA, the cache pointers ``(K̂ bytes, V̂ bytes, raw rows, raw rows)``
    (uint8 views of the shadow at the sections' offsets, one stride pair in bytes); every
    other argument as ``NVFP4_CONFIG``'s launch on the fp16 shadow. A config with TMA or
    chunked loads names ``config``; unforced, the dispatch runs it too (it is in
    ``AUTO_GLUON_SHADOWS``)."""
    from mla_triton import allocate_shadow, shadow_layout

    q, cache, table, seq = _cpu_case(128)
    nvfp4 = AttentionQuant.uniform("nvfp4")
    lay = shadow_layout(nvfp4, storage="packed")
    packed = allocate_shadow(7, 64, nvfp4, storage="packed")
    fp16 = allocate_shadow(7, 64, nvfp4)

    def call(shadow: torch.Tensor, storage: str, **kw: Any) -> Any:
        return lambda: decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE,
                                     quant=nvfp4, num_splits=2, storage=storage, **kw)  # fmt: skip

    launched = _launched(call(packed, "packed", impl="gluon_ws"))
    assert [n for n, _, _ in launched] == [
        "decode_q_kernel", "gluon_decode_ws_kernel", "decode_merge_kernel",
    ]  # fmt: skip
    args = launched[1][1]
    assert args["PACKED"] and args["V_SEP"] and not args["TMA"] and args["kv_desc"] is None
    assert (args["MATH_REGS"], args["PRODUCER_REGS"]) == (
        NVFP4_PACKED_CONFIG.math_regs, NVFP4_PACKED_CONFIG.producer_regs,
    )  # fmt: skip
    kb, vb, raw, ks = args["split"][1]
    assert kb.dtype == vb.dtype == torch.uint8 and raw is cache and ks is cache
    assert kb.data_ptr() == packed.data_ptr() + lay.k_offset
    assert vb.data_ptr() == packed.data_ptr() + lay.v_offset
    assert (kb.shape[2], vb.shape[2]) == (lay.k_bytes, lay.v_bytes)
    rows = (lay.token_bytes * 64, lay.token_bytes)
    assert args["split"][7] == (*rows, *rows, *cache.stride()[:2], *cache.stride()[:2])
    assert [(n, _plain(a), g) for n, a, g in _launched(
        call(packed, "packed", config=NVFP4_PACKED_CONFIG))] == [
        (n, _plain(a), g) for n, a, g in launched
    ]  # fmt: skip
    ref = _launched(call(fp16, "fp16", config=NVFP4_CONFIG))[1][1]
    differ = {"PACKED", "MATH_REGS", "PRODUCER_REGS", "split"}
    assert {k: v for k, v in _plain(ref).items() if k not in differ} == {
        k: v for k, v in _plain(args).items() if k not in differ
    }
    for cfg in (replace(NVFP4_PACKED_CONFIG, tma=True), replace(NVFP4_PACKED_CONFIG, chunked=True)):
        with pytest.raises(ValueError, match=r"^config: a packed shadow is decoded"):
            call(packed, "packed", config=cfg)()
    assert _split(call(packed, "packed")) == "gluon_decode_ws_kernel"  # auto: verified


@pytest.mark.usefixtures("as_sm90")
def test_shadow_refusals() -> None:
    """``decode_shadow`` forced to ``WsConfig()`` on a shadow the kernel does not read (a
    V̂ section with an exact V scale or a dynamic K, the packed storage, K and V none,
    nvfp4 P with V̂ = K̂, bf16 q not quantized beside K̂) is a ValueError naming
    ``quant``; an nvfp4 V̂ section with another ring than ``NVFP4_CONFIG``'s or chunked
    TMA names ``config``; nothing launches. ``compile_ws`` refuses such a recipe naming
    ``recipe``."""
    from test_shadow import RECIPES as TEST_SHADOW_RECIPES

    from mla_triton import allocate_shadow
    from mla_triton.common.intercept import intercept
    from mla_triton.ops.shadow import gluon_shadow_recipe, shadow_layout

    q, cache, table, seq = _cpu_case(128)
    nvfp4 = AttentionQuant.uniform("nvfp4")
    exact_v = replace(nvfp4, v=OperandQuant("nvfp4", 3.0))
    kdyn = TEST_SHADOW_RECIPES["kdyn-nvfp4-vfp8"][0]
    kv_only = AttentionQuant(k="fp8", v="fp8")
    p_nvfp4 = AttentionQuant(q="fp8", k="fp8", v="fp8", p="nvfp4")
    cases = [  # quant, storage, q, what the message says
        (exact_v, "fp16", q, "static power-of-two scale"),
        (AttentionQuant.uniform("fp8"), "packed", q, "storage 'packed'"),
        (AttentionQuant(), "fp16", q, "float16 shadow's K̂ only"),
        (kdyn, "fp16", q, "dynamic K"),
        (p_nvfp4, "fp16", q, "fp8 only with V̂ = K̂"),
        (kv_only, "fp16", q.bfloat16(), "not quantized"),
    ]
    seen: list[str] = []

    def action(run: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> None:
        seen.append(kernel.fn.__name__)

    with intercept(action):
        for quant, storage, qq, says in cases:
            shadow = allocate_shadow(7, 64, quant, storage=storage)
            with pytest.raises(ValueError, match=rf"^quant: .*{re.escape(says)}"):
                decode_shadow(qq, cache.to(qq.dtype), shadow, table, seq, softmax_scale=SCALE,
                              quant=quant, storage=storage, config=WsConfig())  # fmt: skip
        # nvfp4 (a V̂ section): NVFP4_CONFIG's ring only, cp.async loads
        shadow = allocate_shadow(7, 64, nvfp4)
        for cfg in (WsConfig(), replace(NVFP4_TMA_CONFIG, chunked=True), VARIANTS[5]):
            with pytest.raises(ValueError, match=r"^config: a V̂ section .*block_n=32, stages=2"):
                decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE, quant=nvfp4,
                              config=cfg)  # fmt: skip
    assert not seen
    sep = gluon_shadow_recipe(exact_v, shadow_layout(exact_v), torch.float16)
    assert isinstance(sep, GluonRecipe) and not isinstance(ws.ws_shadow_kind(sep), GluonRecipe)
    with pytest.raises(ValueError, match=r"^recipe: .*static power-of-two scale"):
        compile_ws(NVFP4_CONFIG, recipe=sep)
    nv = gluon_shadow_recipe(nvfp4, shadow_layout(nvfp4), torch.bfloat16)
    assert isinstance(nv, GluonRecipe) and ws.ws_shadow_kind(nv) == nv
    assert replace(nv, k_gs=1.0, v_gs=1.0, p_gs=1.0) == NVFP4_SHADOW  # what the CPU compiles
    fp8 = gluon_shadow_recipe(FP8_3, shadow_layout(FP8_3), torch.bfloat16)
    assert isinstance(fp8, GluonRecipe)
    assert replace(fp8, k_gs=1.0, v_gs=1.0, p_gs=1.0) == FP8_SHADOW  # what the CPU compiles


@pytest.mark.usefixtures("as_sm90")
def test_shadow_dispatches_the_ws_kernel() -> None:
    """``decode_shadow`` of fp8 V̂ = K̂, unforced and forced to ``"gluon_ws"``, at any head
    count, launches the warp-specialized kernel with the very arguments of a call forced
    to ``DEFAULT_CONFIG``; forced to ``"gluon"`` or a ``GluonDecodeConfig``, the Gluon
    split kernel; ``decode`` with fp8 on read keeps the Gluon split kernel."""
    from mla_triton import allocate_shadow

    q, cache, table, seq = _cpu_case(128)
    q20, *_ = _cpu_case(20)
    shadow = allocate_shadow(7, 64, FP8_3)

    def call(q: torch.Tensor = q, **kw: Any) -> Any:
        return lambda: decode_shadow(q, cache, shadow, table, seq, softmax_scale=SCALE,
                                     quant=FP8_3, num_splits=2, **kw)  # fmt: skip

    plain = {"auto": call(), "gluon_ws": call(impl="gluon_ws"),
             "h20": call(q20, impl="gluon_ws"), "h20-auto": call(q20)}  # fmt: skip
    for name, c in plain.items():
        assert _split(c) == "gluon_decode_ws_kernel", name
    kept = {"gluon": call(impl="gluon"), "config": call(config=GLUON_VARIANTS[0]),
            "on-read": lambda: decode(q, cache, table, seq, softmax_scale=SCALE, num_splits=2,
                                      quant=FP8_3)}  # fmt: skip
    for name, c in kept.items():
        assert _split(c) == "gluon_decode_split_kernel", name
    direct = _launched(call(config=ws.DEFAULT_CONFIG))
    assert [(n, _plain(a), g) for n, a, g in _launched(plain["auto"])] == [
        (n, _plain(a), g) for n, a, g in direct
    ]


@pytest.mark.usefixtures("as_sm90")
def test_shadow_warmup_compiles_what_the_shadow_launches() -> None:
    """An sm90 engine of fp8 through the shadow (raw rows and
    shadow bytes in one row, 128 heads): ``warmup_decode`` and ``warmup_update_cache``
    record the warp-specialized kernel's keys (one split and several) and exactly the keys
    a serving sweep of batches, lengths and cache writes launches."""
    import random

    from test_warmup import _keys, make_engine, sweep, warm

    engine = make_engine(AttentionQuant.uniform("fp8"), True, blocks=37, width=35, max_rows=40,
                         max_seq_len=2176, dtype=torch.float16, device="cpu")  # fmt: skip
    warmed = _keys(lambda: warm(engine, prefill_too=False))
    served = _keys(lambda: sweep(engine, random.Random(0), prefill_too=False))
    launched = {kernel.rsplit(".", 1)[1] for kernel, _ in served}
    assert {"gluon_decode_ws_kernel", "decode_q_kernel", "decode_merge_kernel"} <= launched
    assert "gluon_decode_split_kernel" not in launched, launched
    assert len({key for kernel, key in warmed if kernel.endswith("gluon_decode_ws_kernel")}) == 2
    assert warmed == served, (sorted(served - warmed)[:3], sorted(warmed - served)[:3])
