"""The Gluon sm90 prefill: every variant compiles for sm_90a (CPU; every tiling the
dispatcher picks included), its coverage (``unsupported``), TMA views and the
arguments ``prefill`` launches it with (CPU). The kernel against ``mla_reference`` on a
Hopper GPU: test_gluon_prefill_gpu.py; the dispatch itself: test_prefill_dispatch.py.

Compiling needs no GPU (Triton's ptxas is bundled); the numbers themselves come
from ``benchmarks/prefill.py`` on a Hopper GPU.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
import triton
from calls import prefill  # mla_triton.prefill, with ``impl``/``config`` forced (tuning.use)

from mla_formats import AttentionQuant, NMSparsity
from mla_triton.common import device as dev
from mla_triton.ops.prefill import gluon as gp
from mla_triton.ops.prefill.core import LOG2E, Recipe

SMEM_LIMIT = 227 * 1024  # bytes of shared memory a block may use on sm90
_CUOBJDUMP = Path(str(triton.__file__)).parent / "backends/nvidia/bin/cuobjdump"

# (dtype, Dqk, Dv, config, causal, return_lse, quant): the default tiling, head dims
# 128/64, the other tilings the benchmark sweeps (fp16, not causal, without LSE), and
# every tiling prefill's dispatcher picks (gp.AUTO_CONFIGS: P none warp specialized,
# P fp8 / nvfp4 with dynamic Q (and K) scales and fp16 P V; with N:M: nvfp4 + 2:4 with
# dense sink / recent keys), and the ping-pong tilings (two consumer warpgroups; 64-key
# tiles plain, 128-key tiles with nvfp4 P and 4:8); then the schedule options: K released
# after Q K^T (early_k) at 128-key ping-pong, FA3's head-dim-192 schedule (128 x 128 x 2,
# two consumers without turns, early_k) with nvfp4 P, early_k on the warp-specialized
# 128 x 64 tiling with 2:4, and the ping-pong 128 x 64 tiling (not causal); 2:4's rank by
# pair maxima and
# minima (nm_pairs) with NaN scores kept by their rank (nm_nan_rank) on the
# warp-specialized 128 x 128 x 2 early_k tiling.
DEFAULT = gp.GluonPrefillConfig()
AUTO = gp.AUTO_CONFIGS
FP8 = {"q_dynamic": True, "k_dynamic": True, "p_fmt": 1}
NVFP4 = {"q_dynamic": True, "p_fmt": 2}
NM24 = {"nm_n": 2, "nm_m": 4, "nm_dense": True}
PP64 = gp.GluonPrefillConfig(128, 64, 3, warp_specialize=True, pingpong=True)
PP128 = gp.GluonPrefillConfig(128, 128, 2, warp_specialize=True, pingpong=True)
VARIANTS: list[tuple[torch.dtype, int, int, gp.GluonPrefillConfig, bool, bool, dict[str, Any]]]
VARIANTS = [
    (torch.bfloat16, 192, 128, DEFAULT, True, True, {}),
    (torch.bfloat16, 128, 64, DEFAULT, True, False, {}),
    (torch.float16, 192, 128, gp.GluonPrefillConfig(128, 128, 2), False, True, {}),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(64, 64, 3), False, False, {}),
    (torch.float16, 192, 128, AUTO["fp8"], True, True, FP8),
    (torch.float16, 192, 128, AUTO["nvfp4"], True, True, NVFP4),
    (torch.bfloat16, 192, 128, AUTO["none"], True, True, {}),
    (torch.float16, 192, 128, AUTO["nvfp4+nm"], True, True, NVFP4 | NM24),
    (torch.bfloat16, 192, 128, PP64, True, True, {}),
    (torch.float16, 192, 128, PP128, True, False, NVFP4 | {"nm_n": 4, "nm_m": 8}),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(
        128, 128, 2, True, True, early_k=True), True, True, {}),
    (torch.float16, 192, 128, gp.GluonPrefillConfig(
        128, 128, 2, True, True, turns=False, early_k=True), True, True, NVFP4),
    (torch.float16, 192, 128, gp.GluonPrefillConfig(
        128, 64, 3, True, early_k=True), True, True, NVFP4 | NM24),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(
        128, 64, 3, True, True), False, True, {}),
    (torch.float16, 192, 128, gp.GluonPrefillConfig(
        128, 128, 2, True, early_k=True, nm_pairs=True, nm_nan_rank=True), True, True,
     NVFP4 | NM24),
    # Q's QDQ in the kernel (q_in_kernel), bf16 Q and fp16 K, P and V: dynamic fp8 Q on
    # AUTO fp8's tiling, static nvfp4 Q by the reciprocal path on AUTO nvfp4's, static
    # nvfp4 Q by division with 2:4 on AUTO nvfp4+nm's and on the warp-specialized
    # 128 x 64 early_k tiling
    (torch.bfloat16, 192, 128, replace(AUTO["fp8"], q_in_kernel=True), True, True,
     FP8 | {"q_fmt": 1}),
    (torch.bfloat16, 192, 128, replace(AUTO["nvfp4"], q_in_kernel=True), True, True,
     {"p_fmt": 2, "q_fmt": 2, "q_fast": True}),
    (torch.bfloat16, 192, 128, replace(AUTO["nvfp4+nm"], q_in_kernel=True), True, True,
     {"p_fmt": 2, "q_fmt": 2} | NM24),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(
        128, 64, 3, True, early_k=True, q_in_kernel=True), True, True,
     {"p_fmt": 2, "q_fmt": 2} | NM24),
]  # fmt: skip
Q_IN_KERNEL = {15: 4, 16: 5, 17: 7, 18: 12}  # variant: its twin with Q's pass (fp16 Q)


def _resources(cubin: bytes) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of a cubin: REG, STACK, LOCAL, ..."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(_CUOBJDUMP), "--dump-resource-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", text.splitlines()[-1])}


def compile_stats() -> list[dict[str, Any]]:
    """Compile every variant for sm_90a; what the tests check of each (PTX, resources)."""
    stats = []
    for dtype, dim, dim_v, config, causal, lse, quant in VARIANTS:
        # Q's QDQ in the kernel (a Q format given): Q raw (bf16), K, P and V factored in fp16
        half = torch.float16 if quant.get("q_fmt") else None
        variant = gp.Variant(causal, lse, **quant)
        kernel: Any = gp.compile_sm90(dtype, dim, dim_v, config, variant, half, half)
        ptx: str = kernel.asm["ptx"]
        stats.append({
            "sm_90a": ".target sm_90a" in ptx, "wgmma": ptx.count("wgmma.mma_async"),
            "tma": "cp.async.bulk.tensor.2d" in ptx, "mbarrier": "mbarrier.try_wait" in ptx,
            "shared": kernel.metadata.shared,
            "lse_store": "st.global.b32" in ptx or "st.global.f32" in ptx,
            "fp8_cvt": "cvt.rn.satfinite.e4m3x2.f32" in ptx,
            "fp8_cvts": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
            "fences": ptx.count("fence.proxy.async.shared::cta"),
            "setmaxnreg": "setmaxnreg" in ptx, "num_warps": kernel.metadata.num_warps,
            "mbarrier_init": ptx.count("mbarrier.init"),
        } | _resources(kernel.asm["cubin"]))  # fmt: skip
    return stats


def test_every_variant_compiles_for_sm90a() -> None:
    """Under ``TRITON_INTERPRET=1`` (CI) Triton's reductions are interpreter functions,
    which Gluon cannot compile: the variants then compile in one child process."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        code = "import json, test_gluon_prefill as t; print(json.dumps(t.compile_stats()))"
        env = os.environ | {"TRITON_INTERPRET": "0"}
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-4000:]
        stats = json.loads(done.stdout.strip().splitlines()[-1])
    else:
        stats = compile_stats()
    for (_, dim, _, config, _, lse, quant), got in zip(VARIANTS, stats, strict=True):
        variant = (dim, config, lse, quant)
        assert got["sm_90a"] and got["tma"] and got["mbarrier"], variant
        # wgmma: Q K^T over Dqk / 16 k-steps and P V over block_n / 16, per warpgroup
        # (ping-pong: two consumer code paths)
        steps = dim // 16 + config.block_n // 16
        assert got["wgmma"] >= steps * (1 + config.pingpong), variant
        assert 0 < got["shared"] <= SMEM_LIMIT, variant
        assert got["lse_store"] == lse, variant  # LSE stores only if asked
        # P's QDQ: fp8 codes, or the nvfp4 block scales (E4M3 too)
        assert got["fp8_cvt"] == (quant.get("p_fmt", 0) > 0), variant
        assert got["REG"] <= 255, variant
        # warp specialized: a producer warpgroup beside the compute warps, registers moved
        assert got["setmaxnreg"] == config.warp_specialize, variant
        assert got["num_warps"] == config.total_warps, variant
        assert got["LOCAL"] == 0, variant  # no local-memory spills
        # mbarriers: Q; K, V and the slot releases per stage; K's own releases (early_k);
        # the ping-pong turns (without turns: each stage's "V checked" hand-over); "Q empty"
        stages = config.num_stages
        want = 1 + 3 * stages + stages * config.early_k
        want += config.pingpong * (2 if config.turns else stages)
        assert got["mbarrier_init"] == want, variant
    # Q's QDQ in the kernel: a fence for the async proxy before the first Q K^T (each
    # consumer), and by the conversion instruction (fp8 codes, or nvfp4 block scales by
    # the reciprocal path) E4M3 conversions beside P's
    for index, twin in Q_IN_KERNEL.items():
        assert stats[index]["fences"] > stats[twin]["fences"], index
        if VARIANTS[index][6].get("q_fmt") == 1 or VARIANTS[index][6].get("q_fast"):
            assert stats[index]["fp8_cvts"] > stats[twin]["fp8_cvts"], index
    # every tiling the dispatcher picks is compiled above, for its P format
    picked = {(c, q.get("p_fmt", 0), "nm_n" in q) for _, _, _, c, _, _, q in VARIANTS}
    assert {(AUTO[f], i, False) for i, f in enumerate(("none", "fp8", "nvfp4"))} <= picked
    assert (AUTO["nvfp4+nm"], 2, True) in picked


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sparsity": NMSparsity(2, 128)}, "sparsity"),
        ({"dtype": torch.float32}, "q"),
        ({"dim": 160}, "q"),
        ({"dim": 320}, "q"),
        ({"dim_v": 96}, "v"),
    ],
)
def test_unsupported_names_the_argument(kwargs: dict[str, Any], name: str) -> None:
    shape = {"dtype": torch.bfloat16, "dim": 192, "dim_v": 128, "sparsity": None} | kwargs
    reason = gp.unsupported(shape["dtype"], shape["dim"], shape["dim_v"], shape["sparsity"])
    assert reason is not None and reason.startswith(f"{name}: ")


def test_every_recipe_and_the_deepseek_shapes_are_covered() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        for dim, dim_v in ((192, 128), (64, 64), (256, 128), (128, 64)):
            assert gp.unsupported(dtype, dim, dim_v, None) is None
    for sparsity in (NMSparsity(2, 4), NMSparsity(1, 2, 16, 64), NMSparsity(32, 64)):
        assert gp.unsupported(torch.bfloat16, 192, 128, sparsity) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("block_m", 32),
        ("block_n", 256),
        ("num_stages", 1),
        ("num_stages", 5),
        ("warp_specialize", 1),
        ("pingpong", 1),
        ("turns", 0),
        ("early_k", 1),
        ("nm_pairs", 1),
        ("nm_nan_rank", "no"),
    ],
)
def test_config_rejects(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"config.{field}"):
        gp.GluonPrefillConfig(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs", [{"block_m": 64}, {"warp_specialize": False}], ids=["block_m", "no-ws"]
)
def test_pingpong_needs_two_warpgroups_and_a_producer(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"^config\.pingpong: needs warp_specialize"):
        gp.GluonPrefillConfig(**({"warp_specialize": True, "pingpong": True} | kwargs))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"turns": False}, r"^config\.turns: False needs pingpong=True"),
        ({"warp_specialize": True, "turns": False}, r"^config\.turns: False needs pingpong"),
        ({"early_k": True}, r"^config\.early_k: needs warp_specialize=True"),
    ],
)
def test_schedule_options_need_their_schedule(kwargs: dict[str, Any], message: str) -> None:
    """``turns=False`` only means something for two consumer warpgroups, ``early_k``
    with a producer partition (the one that waits for the K releases)."""
    with pytest.raises(ValueError, match=message):
        gp.GluonPrefillConfig(**kwargs)


def test_pingpong_warps_and_q_block() -> None:
    """Ping-pong: a warpgroup per 64 rows (the kernel's num_warps is one of them), Q's
    TMA block one warpgroup's rows, the producer padded to a warpgroup."""
    assert (PP64.num_warps, PP64.q_rows, PP64.total_warps) == (4, 64, 12)
    ws = gp.GluonPrefillConfig(warp_specialize=True)
    assert (ws.num_warps, ws.q_rows, ws.total_warps) == (8, 128, 12)
    assert (DEFAULT.num_warps, DEFAULT.q_rows, DEFAULT.total_warps) == (8, 128, 8)


def test_descriptor_views_a_strided_tensor() -> None:
    """V as a slice of a wider tensor (vLLM's kv split): the 2-d view keeps its strides."""
    wide = torch.zeros(10, 3, 256, dtype=torch.bfloat16)
    v = wide[:, :, 128:]
    desc: Any = gp._descriptor(gp._tma_ready(v), [64, 128])
    assert desc.base.data_ptr() == v.data_ptr()
    assert list(desc.shape) == [10, 2 * 256 + 128] and list(desc.strides) == [3 * 256, 1]
    # element (t, h, d) sits at row t, column h * stride_h + d of the view
    t, h, d = 7, 2, 5
    flat = desc.base.as_strided((10, desc.shape[1]), (3 * 256, 1))
    v[t, h, d] = 3.0
    assert float(flat[t, h * 256 + d]) == 3.0


def test_tma_ready_copies_an_unaligned_token_stride() -> None:
    wide = torch.zeros(10, 1, 200, dtype=torch.bfloat16)[:, :, :196]  # 400-byte rows: ok
    assert gp._tma_ready(wide) is wide
    odd = torch.zeros(10, 1, 196 + 4, dtype=torch.bfloat16).view(-1)[4:].as_strided(
        (9, 1, 192), (196, 196, 1)
    )  # fmt: skip
    ready = gp._tma_ready(odd)  # 392-byte rows (not a multiple of 16) and an offset base
    assert ready is not odd and ready.is_contiguous() and torch.equal(ready, odd)


class _Capture:
    """Stands in for ``gluon_prefill_kernel``: records the grid and arguments of a launch."""

    def __init__(self) -> None:
        self.grid: Any = None
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}

    def __getitem__(self, grid: Any) -> Any:
        self.grid = grid

        def run(*args: Any, **kwargs: Any) -> None:
            self.args, self.kwargs = args, kwargs

        return run


def as_sm90(monkeypatch: pytest.MonkeyPatch, capture: _Capture) -> None:
    """``prefill`` dispatches CPU tensors as on an H200 (the Gluon kernel captured, not
    run; the Q and K/V passes keep the interpreter's E4M3 conversions)."""
    monkeypatch.setattr(gp, "gluon_prefill_kernel", capture)
    monkeypatch.setattr(dev, "capability", lambda device: (9, 0))
    monkeypatch.setattr(dev, "hw_fp8", lambda device: False)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the K/V pass on CPU")
@pytest.mark.parametrize("k_amax", ["dynamic", 896.0])
def test_launch_passes_factored_operands_and_scales(
    monkeypatch: pytest.MonkeyPatch, k_amax: Literal["dynamic"] | float
) -> None:
    """fp8 (dynamic Q, K dynamic or static, static P and V) with Q's pass (``q_in_kernel``
    off; ``test_q_in_kernel_launches_raw_q`` has it on): the kernel gets Q, K and V
    factored by the pass, the dynamic per-token scales, the static ones folded in."""
    from mla_formats import OperandQuant, qdq_factored

    capture = _Capture()
    as_sm90(monkeypatch, capture)
    gen = torch.Generator().manual_seed(0)
    lens = [3, 18]
    q = torch.randn(21, 2, 192, generator=gen).half()
    k = torch.randn(21, 1, 192, generator=gen).half()
    v = torch.randn(21, 1, 128, generator=gen).half()
    cu = torch.tensor([0, 3, 21], dtype=torch.int32)
    quant = AttentionQuant(
        q="fp8", k=OperandQuant("fp8", k_amax), p=OperandQuant("fp8", 2.0),
        v=OperandQuant("fp8", 3.0),
    )  # fmt: skip
    # auto's tiling for P fp8 with Q's pass (sm90 patched in above)
    config = replace(gp.AUTO_CONFIGS["fp8"], q_in_kernel=False)
    prefill(q, k, v, cu, cu, softmax_scale=0.1, causal=True, return_lse=True, quant=quant,
            max_seqlen_q=max(lens), max_seqlen_k=max(lens), config=config)  # fmt: skip
    q_desc, k_desc, v_desc, _, _, qs, ks = capture.args[:7]
    q_ref, q_gs = qdq_factored(q, quant.q)
    k_ref, k_gs = qdq_factored(k, quant.k)
    v_ref, v_gs = qdq_factored(v, quant.v, axis=0)  # static: per-tensor, any axis
    assert q_desc.base.dtype == torch.float16 and v_desc.base.dtype == torch.float16
    torch.testing.assert_close(q_desc.base.float(), q_ref, atol=0, rtol=0)
    torch.testing.assert_close(k_desc.base.float(), k_ref, atol=0, rtol=0)
    torch.testing.assert_close(v_desc.base.float(), v_ref, atol=0, rtol=0)
    torch.testing.assert_close(qs, q_gs[..., 0], atol=0, rtol=0)
    dynamic = k_amax == "dynamic"
    if dynamic:
        torch.testing.assert_close(ks, k_gs[..., 0], atol=0, rtol=0)
    qk_scale, p_gs, p_inv_gs, out_scale = capture.args[11:15]
    assert p_gs == pytest.approx(2.0 / 448.0)
    # dynamic scales stay per token, static ones are folded in (K: 896 / 448)
    assert qk_scale == pytest.approx(0.1 * LOG2E * (1.0 if dynamic else 2.0))
    assert p_inv_gs == pytest.approx(448.0 / 2.0) and out_scale == pytest.approx(
        2.0 / 448.0 * float(v_gs.flatten()[0])
    )  # fmt: skip
    assert capture.kwargs["Q_DYNAMIC"] and capture.kwargs["K_DYNAMIC"] == dynamic
    assert capture.kwargs["P_FMT"] == 1
    assert capture.grid == (1, 2, 2)
    # auto's tiling for P fp8 (AUTO_CONFIGS)
    assert capture.kwargs["BLOCK_N"] == gp.AUTO_CONFIGS["fp8"].block_n
    assert capture.kwargs["WARP_SPEC"] == gp.AUTO_CONFIGS["fp8"].warp_specialize


def _sort_keys(s: torch.Tensor) -> torch.Tensor:
    """The kernels' unique int32 sort keys of float32 scores ``s [R, N]`` (``_nm_keep``:
    float order as int order, the low two bits ``3 - member``: ties to the lower index)."""
    bits = s.view(torch.int32)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    member = torch.arange(s.shape[1], dtype=torch.int32) % 4
    return (key & -4) | (3 - member)


def test_nm_pairs_keeps_the_two_largest_of_four() -> None:
    """``nm_pairs``' rule (``gluon_kernels._keep_2_of_4``, on the same sort keys):
    the group's second largest is ``max(min(max a b, max c d), max(min a b, min c d))``,
    every key at or above it kept. The same mask as the general rank (``_nm_keep``: two
    rounds of group maxima) on every group of four drawn from seven scores with exact
    ties, ``-inf`` and both zeros (7^4 groups) and on random ones; the same keys as
    ``mla_reference.nm_keep`` (2:4, every key visible) where no group holds both zeros
    (the sort keys rank -0 below +0, the reference ties them)."""
    from mla_reference import nm_keep

    values = torch.tensor([float("-inf"), -2.0, -0.5, -0.0, 0.0, 0.75, 3.0])
    index = torch.cartesian_prod(*[torch.arange(7)] * 4)  # [2401, 4]
    gen = torch.Generator().manual_seed(5)
    rand = torch.randn(4096, 4, generator=gen).round(decimals=1) + 0.0  # ties, no -0
    for s in (values[index], rand):
        key = _sort_keys(s)
        key4 = key.reshape(-1, 2, 2)
        second = torch.maximum(key4.amax(2).amin(1), key4.amin(2).amax(1))
        keep = (key4 >= second[:, None, None]).reshape(-1, 4)
        first = key.amax(1, keepdim=True)  # the general rank's two rounds
        general = key >= torch.where(key < first, key, -(2**31)).amax(1, keepdim=True)
        assert keep.sum(1).eq(2).all() and torch.equal(keep, general)
        zeros = (s == 0).any(1) & s.signbit().logical_and(s == 0).any(1)
        zeros &= (s == 0).logical_and(~s.signbit()).any(1)  # both -0 and +0 in the group
        want = nm_keep(s[None].double(), torch.ones_like(keep), torch.full((s.shape[0],), 10**6),
                       NMSparsity(2, 4))[0]  # fmt: skip
        assert torch.equal(keep[~zeros], want[~zeros]) and (~zeros).sum() > 1000


def test_positive_nan_sort_keys_rank_first() -> None:
    """``nm_nan_rank``'s premise: the sort key of a positive NaN (the kernel's NaN constant
    0x7FC00000, the GPU's arithmetic NaN 0x7FFFFFFF) is above that of every non-NaN score
    at every member position, so N:M keeps it while it is among the group's N largest."""
    nans = torch.tensor([0x7FC00000, 0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    others = torch.tensor([float("inf"), 3.4e38, 1.0, 0.0, -0.0, -1.0, float("-inf")])
    lowest_nan = _sort_keys(nans.repeat_interleave(4).reshape(2, 4)).min()
    assert lowest_nan > _sort_keys(others.repeat_interleave(4).reshape(-1, 4)).max()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the K/V pass on CPU")
@pytest.mark.parametrize("q_amax", ["dynamic", 5.0])
def test_q_in_kernel_launches_raw_q(
    monkeypatch: pytest.MonkeyPatch, q_amax: Literal["dynamic"] | float
) -> None:
    """``q_in_kernel``: Q reaches the kernel raw (no pass over it) with its format code and
    static scale, K and V factored by the pass as before; nvfp4 Q with a dynamic amax keeps
    the pass. ``auto`` without a config: fp8 Q in the kernel, nvfp4 Q through the pass
    (``AUTO_CONFIGS``)."""
    from mla_formats import OperandQuant

    capture = _Capture()
    as_sm90(monkeypatch, capture)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(21, 2, 192, generator=gen).bfloat16()
    k = torch.randn(21, 1, 192, generator=gen).bfloat16()
    v = torch.randn(21, 1, 128, generator=gen).bfloat16()
    cu = torch.tensor([0, 3, 21], dtype=torch.int32)
    for fmt, code in (("fp8", 1), ("nvfp4", 2)):
        quant = AttentionQuant(q=OperandQuant(fmt, q_amax), k=fmt, p=fmt, v=fmt)
        config = replace(gp.auto_config(Recipe.of(quant)), q_in_kernel=True)
        prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, config=config,
                max_seqlen_q=18, max_seqlen_k=18)  # fmt: skip
        q_desc, k_desc = capture.args[:2]
        q_gs, q_inv = capture.args[15:17]
        in_kernel = q_amax != "dynamic" or fmt == "fp8"
        assert capture.kwargs["Q_FMT"] == (code if in_kernel else 0), fmt
        assert (q_desc.base is q) == in_kernel, fmt
        assert k_desc.base.dtype == torch.float16, fmt
        if q_amax != "dynamic":
            unit = 448.0 if fmt == "fp8" else 2688.0
            assert q_gs == pytest.approx(5.0 / unit), fmt
            assert q_inv == pytest.approx(unit / 5.0 / (6.0 if fmt == "nvfp4" else 1.0)), fmt
            assert not capture.kwargs["Q_FAST"]  # 5 / unit: not a power of two
        # auto, no config: AUTO_CONFIGS' choice (in the kernel for fp8, the pass for nvfp4
        # P's tiling), as q_qdq_in_kernel says
        prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, max_seqlen_q=18,
                max_seqlen_k=18)  # fmt: skip
        auto_in_kernel = fmt == "fp8"
        assert gp.q_qdq_in_kernel(gp.auto_config(Recipe.of(quant)),
                                  Recipe.of(quant)) == auto_in_kernel  # fmt: skip
        assert capture.kwargs["Q_FMT"] == (code if auto_in_kernel else 0), fmt
        assert (capture.args[0].base is q) == auto_in_kernel, fmt
