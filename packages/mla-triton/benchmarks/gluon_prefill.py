"""The Gluon (sm90) prefill on an H200: correctness, then timing against the Triton prefill.

Run on a Hopper GPU from the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/gluon_prefill.py --out OUTDIR [--fa3]

Correctness (bf16, recipe none): ``mla_triton.prefill(..., impl="gluon")`` against
``mla_reference.prefill`` (float32 on the GPU) and against ``mla_triton.prefill``
on varlen batches (lengths 1, 17, 128, 1000, 4096), H 16 and 128, causal and not,
chunked context (fewer queries than keys), GQA, a strided V (a slice of a wider
tensor), and the NaN rule (non-finite V and K in and next to a sequence). Each
case prints the max abs error and the relative L2 error of out, the max abs error
of the finite LSEs, and whether the NaN / -inf positions agree.

Then the quantized recipes (fp8 and nvfp4 on all four operands, fp8 or nvfp4 P
alone, nvfp4 Q/K/V with fp8 P: Q, K and V by the pre-pass, P in the kernel)
against both, at h16.

Timing: ``triton.testing.do_bench`` medians (rep 200 ms) of the Gluon kernel (a
few tilings) and of ``mla_triton.prefill`` (its default tiling), causal, queries
= keys, at b4 h128 L4096, b1 h16 L16384 and a varlen batch of 16384 tokens;
useful TFLOP/s count ``2 Lq Lk (192 + 128)`` per head, halved for causal; then
the fp8 and nvfp4 recipes the same way (the Gluon times include their Q and K/V
passes). Last, the warp-specialized tilings (a producer warp issuing the TMA loads)
are checked and timed, after an ablation (the kernel without its softmax: what
hiding the softmax could reach at most). With
``--fa3``, FlashAttention-3 from the vLLM wheel
(``vllm.vllm_flash_attn.flash_attn_varlen_func(..., fa_version=3)``) is timed in
the same process. ``--dispatch`` times only what ``prefill`` runs by default
(``impl="auto"``) against ``impl="triton"`` (and, with ``--fa3``, FA3 bf16) for the
recipes none, fp8 and nvfp4. ``--sweep`` times every Gluon tiling of ``SWEEP_TILINGS``
(plain, warp-specialized, ping-pong) with every recipe of ``SWEEP_RECIPES`` (none,
fp8, nvfp4, nvfp4 + 2:4) beside the Triton kernel and FA3 bf16 at b4 h128 L4096, b1
h16 L16384 and a mixed varlen batch (``SWEEP_SHAPE_DEFS``: six sequences of 690 to 6164
tokens, 16384 in all, h128; FA3 on the same ``cu_seqlens``), causal with LSE as vLLM
calls it, and prints each time's ratio to FA3 and the
fastest tiling per recipe (``AUTO_CONFIGS``' candidates; ``--no-pingpong`` leaves the
ping-pong tilings out, ``--tilings a,b`` times those of ``SWEEP_TILINGS`` or
``SWEEP_NEXT``, the schedule options ``early_k``, ``turns=False``, ``row_inf_check`` and
``persistent``).
Every Gluon and Triton time is of a ``prefill`` call (its checks on preallocated ``out``,
no host sync: ``max_seqlen_*`` given).
Results: ``OUTDIR/gluon-prefill.json`` (``--sweep``: ``gluon-prefill-sweep.json``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

# one benchmark dataset: the shapes of benchmarks/prefill.py (this script's folder)
from prefill import DQK, DV, SHAPES, fa3

from mla_formats import AttentionQuant, NMSparsity

CHECK_LENS = [1, 17, 128, 1000, 4096]
QUANTS: dict[str, AttentionQuant | None] = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "p-fp8": AttentionQuant(p="fp8"),
    "nvfp4-qkv+p-fp8": AttentionQuant(q="nvfp4", k="nvfp4", p="fp8", v="nvfp4"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "p-nvfp4": AttentionQuant(p="nvfp4"),
}
# (block_m, block_n, num_stages)
Tiling = tuple[int, int, int] | tuple[int, int, int, bool]  # GluonPrefillConfig's fields
CONFIGS: list[Tiling] = [
    (128, 64, 3), (128, 128, 2), (128, 64, 4), (128, 64, 2), (64, 64, 3),
]  # fmt: skip
# warp specialized (a producer warp issues the TMA loads): checked and timed last, so
# that a hang there (a barrier protocol never run on a GPU before) costs only itself
WS_CONFIGS: list[Tiling] = [
    (128, 64, 3, True), (128, 128, 2, True), (128, 64, 4, True),
]  # fmt: skip


def _tiling(bm: int, bn: int, stages: int, ws: bool = False, pp: bool = False,
            **options: bool) -> dict[str, Any]:  # fmt: skip
    """``GluonPrefillConfig``'s keyword arguments: the tiling, warp specialization,
    ping-pong, and the schedule options (``turns``, ``early_k``, ``row_inf_check``,
    ``fma_inf_check``, ``persistent``, ...)."""
    return {"block_m": bm, "block_n": bn, "num_stages": stages, "warp_specialize": ws,
            "pingpong": pp, **options}  # fmt: skip


# --sweep: GluonPrefillConfig keywords by name, recipes (quant, sparsity), shapes
SWEEP_TILINGS: dict[str, dict[str, Any]] = {
    "plain-128x64x3": _tiling(128, 64, 3),
    "plain-128x128x2": _tiling(128, 128, 2),
    "ws-128x64x3": _tiling(128, 64, 3, True),
    "ws-128x128x2": _tiling(128, 128, 2, True),
    "pp-128x64x3": _tiling(128, 64, 3, True, True),
    "pp-128x64x2": _tiling(128, 64, 2, True, True),
    "pp-128x128x2": _tiling(128, 128, 2, True, True),
}
# Issue 17's third step (benchmarks/gpu/prefill_next.sh times these with --tilings):
# "ek" early_k (K released after Q K^T, loaded a tile ahead of V), "nt" two consumer
# warpgroups without turns (FA3's head-dim-192 schedule), "ri" row_inf_check, "per"
# persistent (one program an SM looping over the query tiles)
SWEEP_NEXT: dict[str, dict[str, Any]] = {
    "pp-128x64x3-ek": _tiling(128, 64, 3, True, True, early_k=True),
    "pp-128x64x3-ri": _tiling(128, 64, 3, True, True, row_inf_check=True),
    "pp-128x128x2-ek": _tiling(128, 128, 2, True, True, early_k=True),
    "pp-128x128x2-ek-ri": _tiling(128, 128, 2, True, True, early_k=True, row_inf_check=True),
    "nt-128x64x3": _tiling(128, 64, 3, True, True, turns=False),
    "nt-128x128x2-ek": _tiling(128, 128, 2, True, True, turns=False, early_k=True),
    "nt-128x128x2-ek-ri": _tiling(
        128, 128, 2, True, True, turns=False, early_k=True, row_inf_check=True
    ),
    "ws-128x64x3-ek": _tiling(128, 64, 3, True, early_k=True),
    "ws-128x128x2-ek": _tiling(128, 128, 2, True, early_k=True),
    "pp-128x64x3-per": _tiling(128, 64, 3, True, True, persistent=True),
    "pp-128x128x2-ek-per": _tiling(128, 128, 2, True, True, early_k=True, persistent=True),
    "ws-128x64x3-ek-per": _tiling(128, 64, 3, True, early_k=True, persistent=True),
}
# Issue 17, sitting 8 (benchmarks/gpu/prefill_sit8.sh): the combinations sitting 7's sweep
# pointed at but did not have ("nt" + "ek" + "ri" for nvfp4, "ws" + "ri" for 2:4) and "np"
# (nm_pairs: 2:4's rank by pair maxima and minima) on the fastest 2:4 tilings, "nr" with it
# (nm_nan_rank: NaN scores kept by their rank alone)
SWEEP_SIT8: dict[str, dict[str, Any]] = {
    "nt-128x64x3-ek-ri": _tiling(
        128, 64, 3, True, True, turns=False, early_k=True, row_inf_check=True
    ),
    "nt-128x64x3-ri": _tiling(128, 64, 3, True, True, turns=False, row_inf_check=True),
    "ws-128x128x2-ek-ri": _tiling(128, 128, 2, True, early_k=True, row_inf_check=True),
    "ws-128x128x2-ek-np": _tiling(128, 128, 2, True, early_k=True, nm_pairs=True),
    "ws-128x128x2-ek-ri-np": _tiling(
        128, 128, 2, True, early_k=True, row_inf_check=True, nm_pairs=True
    ),
    "ws-128x64x3-ek-np": _tiling(128, 64, 3, True, early_k=True, nm_pairs=True),
    "ws-128x128x2-ek-np-nr": _tiling(
        128, 128, 2, True, early_k=True, nm_pairs=True, nm_nan_rank=True
    ),
    "ws-128x64x3-ek-np-nr": _tiling(
        128, 64, 3, True, early_k=True, nm_pairs=True, nm_nan_rank=True
    ),
}
# Issue 17, sitting 13 (benchmarks/gpu/sit13.sh): "fi" fma_inf_check (the NaN rule's -inf
# check in the exponent, one fma a score) on AUTO_CONFIGS' tilings of P none / fp8 and nvfp4
SWEEP_SIT13: dict[str, dict[str, Any]] = {
    "pp-128x128x2-ek-fi": _tiling(128, 128, 2, True, True, early_k=True, fma_inf_check=True),
    "nt-128x64x3-fi": _tiling(128, 64, 3, True, True, turns=False, fma_inf_check=True),
}
# what --tilings and benchmarks/gpu/prefill_smoke.py name
TILINGS = SWEEP_TILINGS | SWEEP_NEXT | SWEEP_SIT8 | SWEEP_SIT13
SWEEP_RECIPES: dict[str, tuple[AttentionQuant | None, NMSparsity | None]] = {
    "none": (None, None),
    "fp8": (AttentionQuant.uniform("fp8"), None),
    "nvfp4": (AttentionQuant.uniform("nvfp4"), None),
    "nvfp4+2:4": (AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4)),
}


def mixed_lens(seed: int = 4, total: int = 16384, lo: int = 256, hi: int = 8192) -> list[int]:
    """Sequence lengths of a vLLM-like mixed prefill batch: drawn uniformly from ``[lo,
    hi]`` by ``random.Random(seed)`` while they fit in ``total`` tokens, the remainder
    as the last sequence when it has at least ``lo`` tokens (the default: 2189, 2740,
    1101, 6164, 3500, 690; 16384 tokens, none a multiple of 64: every sequence has a
    tail tile)."""
    gen, lens = random.Random(seed), []
    while (n := gen.randint(lo, hi)) <= total - sum(lens):
        lens.append(n)
    if total - sum(lens) >= lo:
        lens.append(total - sum(lens))
    return lens


# --sweep's shapes: benchmarks/prefill.py's two of issue 17's table, and the varlen batch
# of its targets (h128, FA3 on the same cu_seqlens)
SWEEP_SHAPE_DEFS: dict[str, tuple[list[int], int]] = {
    "b4-h128-L4096": SHAPES["b4-h128-L4096"],
    "b1-h16-L16384": SHAPES["b1-h16-L16384"],
    "varlen-mixed-h128": (mixed_lens(), 128),
}
SWEEP_SHAPES = tuple(SWEEP_SHAPE_DEFS)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()


def _rand(tokens: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(tokens, heads, dim, device="cuda", generator=gen, dtype=torch.bfloat16)


def _gluon(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_q: list[int], lens_k: list[int],
    causal: bool, config: Tiling | None = None, quant: AttentionQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from mla_triton.gluon_prefill import GluonPrefillConfig

    return _prefill(q, k, v, lens_q, lens_k, causal, quant, "gluon",
                    GluonPrefillConfig(*config) if config else None)  # fmt: skip


def _triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_q: list[int], lens_k: list[int],
    causal: bool, quant: AttentionQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return _prefill(q, k, v, lens_q, lens_k, causal, quant, "triton")


def _prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_q: list[int], lens_k: list[int],
    causal: bool, quant: AttentionQuant | None, impl: str, config: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    from mla_triton import prefill

    return prefill(
        q, k, v, _cu(lens_q), _cu(lens_k), softmax_scale=q.shape[2] ** -0.5, causal=causal,
        return_lse=True, quant=quant, impl=impl, config=config,
        max_seqlen_q=max(lens_q, default=0), max_seqlen_k=max(lens_k, default=0),
    )  # fmt: skip


def _oracle(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens_q: list[int], lens_k: list[int],
    causal: bool, quant: AttentionQuant | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    import mla_reference

    return mla_reference.prefill(
        q, k, v, _cu(lens_q), _cu(lens_k), softmax_scale=q.shape[2] ** -0.5, causal=causal,
        return_lse=True, compute_dtype=torch.float32, quant=quant,
    )  # fmt: skip


def _compare(name: str, got: tuple[torch.Tensor, torch.Tensor],
             ref: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:  # fmt: skip
    out, lse = got[0].float(), got[1].float()
    ref_out, ref_lse = ref[0].float(), ref[1].float()
    nan_same = bool(torch.equal(out.isnan(), ref_out.isnan()))
    lse_nan_same = bool(torch.equal(lse.isnan(), ref_lse.isnan()))
    ninf_same = bool(torch.equal(lse == float("-inf"), ref_lse == float("-inf")))
    ok = ~ref_out.isnan() & ~out.isnan()
    diff = (out - ref_out)[ok]
    rel_l2 = float(diff.norm() / ref_out[ok].norm().clamp_min(1e-30)) if diff.numel() else 0.0
    fin = torch.isfinite(lse) & torch.isfinite(ref_lse)
    lse_err = float((lse - ref_lse)[fin].abs().max()) if fin.any() else 0.0
    return {
        "vs": name, "max_abs": float(diff.abs().max()) if diff.numel() else 0.0,
        "rel_l2": rel_l2, "lse_max_abs": lse_err, "nan_same": nan_same,
        "lse_nan_same": lse_nan_same, "neg_inf_same": ninf_same,
    }  # fmt: skip


def _case(name: str, fn: Callable[[], list[dict[str, Any]]], result: dict[str, Any],
          tol: float = 1e-2) -> None:  # fmt: skip
    t0 = time.time()
    try:
        rows = fn()
        for row in rows:
            row["case"] = name
            result["checks"].append(row)
            if "error" in row:
                row["pass"] = False
                print(f"ERROR {name} vs {row['vs']}: {row['error']}", flush=True)
                continue
            ok = (row["rel_l2"] < tol and row["nan_same"] and row["lse_nan_same"]
                  and row["neg_inf_same"] and row["lse_max_abs"] < tol)  # fmt: skip
            row["pass"] = ok
            print(f"{'PASS' if ok else 'FAIL'} {name:34s} vs {row['vs']:8s} max_abs "
                  f"{row['max_abs']:.3e} rel_l2 {row['rel_l2']:.3e} lse {row['lse_max_abs']:.3e} "
                  f"nan {row['nan_same']} lse_nan {row['lse_nan_same']} "
                  f"-inf {row['neg_inf_same']}  ({time.time() - t0:.1f}s)", flush=True)  # fmt: skip
    except Exception as exc:
        traceback.print_exc()
        result["checks"].append({"case": name, "error": repr(exc), "pass": False})
        print(f"ERROR {name}: {exc!r}", flush=True)


def _check_case(
    lens_q: list[int], lens_k: list[int], heads: int, kv_heads: int, causal: bool,
    strided_v: bool = False, config: Tiling | None = None,
    poison: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None,
    oracle: bool = True, quant: AttentionQuant | None = None,
) -> Callable[[], list[dict[str, Any]]]:  # fmt: skip
    def run() -> list[dict[str, Any]]:
        gen = torch.Generator(device="cuda").manual_seed(sum(lens_q) + heads)
        q = _rand(sum(lens_q), heads, DQK, gen)
        k = _rand(sum(lens_k), kv_heads, DQK, gen)
        if strided_v:  # V as a slice of a [Tk, Hkv, 2 * DV] tensor (vLLM's kv split)
            v = _rand(sum(lens_k), kv_heads, 2 * DV, gen)[:, :, DV:]
        else:
            v = _rand(sum(lens_k), kv_heads, DV, gen)
        if poison is not None:
            poison(q, k, v)
        got = _gluon(q, k, v, lens_q, lens_k, causal, config, quant)
        rows = [_compare("triton", got, _triton(q, k, v, lens_q, lens_k, causal, quant))]
        if oracle:
            try:
                ref = _oracle(q, k, v, lens_q, lens_k, causal, quant)
                rows.append(_compare("oracle", got, ref))
            except Exception as exc:  # e.g. out of memory at H 128, L 4096
                traceback.print_exc()
                rows.append({"vs": "oracle", "error": repr(exc)})
        return rows

    return run


def _nan_v_inside(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    v[90, 0, 5] = float("nan")  # seq 0 (100 keys): rows at or after key 90 see it
    k[100 + 30, 1, 7] = float("inf")  # seq 1: rows at or after key 30 see it (q and lse)


def _nan_v_outside(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    v[100, 0, 3] = float("nan")  # first key of seq 1: must not reach seq 0's last tile
    v[100 + 50 - 1, 0, 3] = float("inf")  # last key of seq 1: visible to its last row only


def checks_quant(result: dict[str, Any]) -> None:
    """Quantized recipes (Q/K/V by the pre-pass, P fp8 in the kernel) at h16."""
    for name, quant in QUANTS.items():
        if quant is None:
            continue
        for causal in (True, False) if name in ("fp8", "nvfp4") else (True,):
            tag = f"{name} varlen h16 {'causal' if causal else 'full'}"
            _case(tag, _check_case(CHECK_LENS, CHECK_LENS, 16, 16, causal, quant=quant),
                  result, tol=2e-2)  # fmt: skip
    _case("fp8 gqa h16/kv2 chunked full",
          _check_case([1, 200, 64], [300, 1000, 64], 16, 2, False,
                      quant=QUANTS["fp8"]), result, tol=2e-2)  # fmt: skip


def checks_ws(result: dict[str, Any]) -> None:
    """The warp-specialized tilings: varlen causal and not, the NaN rule, fp8."""
    for config in WS_CONFIGS:
        _case(
            f"ws {config} h16 causal",
            _check_case(CHECK_LENS, CHECK_LENS, 16, 16, True, config=config),
            result,
        )
        _case(
            f"ws {config} h16 full",
            _check_case(CHECK_LENS, CHECK_LENS, 16, 16, False, config=config),
            result,
        )
    ws = WS_CONFIGS[0]
    _case(
        f"ws {ws} nan rule outside full",
        _check_case([100, 50], [100, 50], 4, 4, False, config=ws, poison=_nan_v_outside),
        result,
    )
    _case(f"ws {ws} fp8 h16 causal", _check_case(
        CHECK_LENS, CHECK_LENS, 16, 16, True, config=ws, quant=QUANTS["fp8"]), result,
        tol=2e-2)  # fmt: skip


def checks(result: dict[str, Any]) -> None:
    """Correctness cases, recipe none (see the module doc)."""
    for heads in (16, 128):
        for causal in (True, False):
            tag = f"varlen h{heads} {'causal' if causal else 'full'}"
            _case(tag, _check_case(CHECK_LENS, CHECK_LENS, heads, heads, causal), result)
    _case("chunked-context h16 full", _check_case([1, 200, 64], [300, 1000, 64], 16, 16, False),
          result)  # fmt: skip
    _case("suffix causal h16 (Lq < Lk)",
          _check_case([1, 200, 64], [300, 1000, 64], 16, 16, True), result)  # fmt: skip
    _case("gqa h16/kv2 causal", _check_case(CHECK_LENS, CHECK_LENS, 16, 2, True), result)
    _case("strided v h16 causal",
          _check_case(CHECK_LENS, CHECK_LENS, 16, 16, True, strided_v=True), result)  # fmt: skip
    _case("empty k sequence h16", _check_case([5, 7, 9], [0, 7, 20], 16, 16, True), result)
    _case("nan rule inside h4", _check_case([100, 50], [100, 50], 4, 4, True,
                                            poison=_nan_v_inside), result)  # fmt: skip
    _case("nan rule outside h4 causal", _check_case([100, 50], [100, 50], 4, 4, True,
                                                    poison=_nan_v_outside), result)  # fmt: skip
    _case("nan rule outside h4 full", _check_case([100, 50], [100, 50], 4, 4, False,
                                                  poison=_nan_v_outside), result)  # fmt: skip
    for config in CONFIGS[1:]:
        _case(f"config {config} h16 causal",
              _check_case(CHECK_LENS, CHECK_LENS, 16, 16, True, config=config), result)  # fmt: skip


def _bench(fn: Callable[[], Any]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _tflops(lens: list[int], heads: int, ms: float) -> float:
    flop = sum(2.0 * n * n * (DQK + DV) / 2 for n in lens) * heads
    return flop / (ms * 1e-3) / 1e12


def _time_shape(shape: str, lens: list[int], heads: int, fa3: bool, result: dict[str, Any],
                recipe: str = "none", ws: bool = False, ablate: bool = False,
                dispatch: bool = False) -> None:  # fmt: skip
    from mla_triton import prefill
    from mla_triton.gluon_prefill import GluonPrefillConfig

    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    q, k, v = _rand(total, heads, DQK, gen), _rand(total, heads, DQK, gen), _rand(
        total, heads, DV, gen)  # fmt: skip
    cu = _cu(lens)
    out = torch.empty(total, heads, DV, dtype=q.dtype, device="cuda")
    quant = QUANTS[recipe]

    def call(impl: str, config: Any = None) -> Callable[[], Any]:
        return lambda: prefill(
            q, k, v, cu, cu, softmax_scale=DQK**-0.5, causal=True, quant=quant, out=out,
            max_seqlen_q=max(lens), max_seqlen_k=max(lens), impl=impl, config=config,
        )  # fmt: skip

    def gluon(c: Tiling) -> Callable[[], Any]:
        return call("gluon", GluonPrefillConfig(*c))

    fns: dict[str, Callable[[], Any]] = {"triton": call("triton")}
    if dispatch:  # what prefill runs by default, beside the Triton kernel and FA3
        fns["auto"] = call("auto")
    elif ablate:
        fns = {f"no-softmax{c}": gluon(c) for c in CONFIGS[:2]}
    elif ws:
        fns = {f"gluon{c}": gluon(c) for c in WS_CONFIGS}
    else:
        fns |= {f"gluon{c}": gluon(c) for c in (CONFIGS if recipe == "none" else CONFIGS[:2])}
    if fa3 and (recipe == "none" or dispatch) and not ws and not ablate:
        fns["fa3"] = fa3(q, k, v, cu, max(lens))  # bf16, the reference of every recipe
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            ms = min(_bench(fn), _bench(fn))
            row = {"shape": shape, "recipe": recipe, "impl": name, "ms": ms,
                   "tflops": _tflops(lens, heads, ms)}  # fmt: skip
            result["timings"].append(row)
            print(f"{shape:16s} {recipe:6s} {name:22s} {ms:8.3f} ms {row['tflops']:7.1f} "
                  "TFLOP/s", flush=True)  # fmt: skip
        except Exception as exc:
            traceback.print_exc()
            result["timings"].append({"shape": shape, "recipe": recipe, "impl": name,
                                      "error": repr(exc)})  # fmt: skip
    if dispatch:  # auto's speed as ratios: to the Triton kernel and to FA3 (bf16)
        ms = {r["impl"]: r["ms"] for r in result["timings"]
              if r.get("shape") == shape and r.get("recipe") == recipe and "ms" in r}  # fmt: skip
        if "auto" in ms:
            ratios = {f"auto_vs_{b}": ms[b] / ms["auto"] for b in ("triton", "fa3") if b in ms}
            result.setdefault("ratios", []).append({"shape": shape, "recipe": recipe} | ratios)
            print(f"{shape:16s} {recipe:6s} " + "  ".join(
                f"{k} {v:.3f}x" for k, v in ratios.items()), flush=True)  # fmt: skip


def timings(result: dict[str, Any], fa3: bool, recipe: str = "none", ws: bool = False,
            dispatch: bool = False) -> None:  # fmt: skip
    """Timing rows (see the module doc)."""
    for shape, (lens, heads) in SHAPES.items():
        try:
            _time_shape(shape, lens, heads, fa3, result, recipe, ws, dispatch=dispatch)
        except Exception as exc:
            traceback.print_exc()
            result["timings"].append({"shape": shape, "error": repr(exc)})
        torch.cuda.empty_cache()


# The ablation: the kernel with the softmax step replaced by P = S (no max, exp2 or
# sums; every MMA, load, mask and the NaN handling kept). Its outputs are meaningless;
# its time bounds what hiding the softmax (ping-pong) could reach.
_SOFTMAX = "m_new, alpha, p, l_i = common.softmax_step(m_i, l_i, s, row_scale, True, True)"
_NO_SOFTMAX = "m_new, alpha, p, l_i = m_i, gl.full_like(m_i, 1.0), s, l_i"
# the masked tiles' V check of the NaN rule (_sanitize_v), never taken (compiled still)
_V_CHECK = "    if start_n >= mid:\n        bad_layout"
_NO_V_CHECK = "    if start_n < 0:\n        bad_layout"
ABLATIONS: dict[str, tuple[str, str]] = {
    "no-softmax": (_SOFTMAX, _NO_SOFTMAX),
    "no-v-check": (_V_CHECK, _NO_V_CHECK),
}
"""``--ablate``'s kernel edits: the text of the kernel module replaced, and by what."""


def _ablated_kernel(name: str = "no-softmax") -> Any:
    """``gluon_prefill_kernel`` compiled from a copy of its module with ``ABLATIONS[name]``
    applied (``no-softmax``: without the softmax step; ``no-v-check``: masked tiles' V
    rows neither checked nor zeroed)."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from mla_triton.kernels import gluon_prefill as kmod

    text = Path(str(kmod.__file__)).read_text()
    old, new = ABLATIONS[name]
    if text.count(old) != 1:
        raise RuntimeError(f"the step to ablate ({name}) is not in the kernel module once")
    module_name = "gluon_prefill_" + name.replace("-", "_")
    path = Path(tempfile.mkdtemp(prefix="gluon-ablation-")) / f"{module_name}.py"
    path.write_text(text.replace(old, new))
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gluon_prefill_kernel


def ablation(result: dict[str, Any]) -> None:
    """Timing rows of the kernel without its softmax (``impl`` "no-softmax...")."""
    from mla_triton.kernels import gluon_prefill as kmod

    real = kmod.gluon_prefill_kernel
    try:
        kmod.gluon_prefill_kernel = _ablated_kernel()
        for shape, (lens, heads) in SHAPES.items():
            try:
                _time_shape(shape, lens, heads, False, result, ablate=True)
            except Exception as exc:
                traceback.print_exc()
                result["timings"].append({"shape": shape, "impl": "no-softmax", "error": repr(exc)})
            torch.cuda.empty_cache()
    finally:
        kmod.gluon_prefill_kernel = real


def _sweep_shape(
    shape: str, tilings: dict[str, Any], rep: int, shard: tuple[int, int] | None = None,
    rows: list[dict[str, Any]] | None = None, flush: Callable[[], None] = lambda: None,
    ablated: str | None = None, rounds: int = 1, only: str | None = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """``--sweep``'s rows at one shape: FA3 first, then per recipe Triton and the tilings,
    appended to ``rows`` (a new list by default), ``flush()`` after each (a cut-off run
    keeps what it timed). ``shard (i, n)``: only compile (one call each) the Triton and
    Gluon calls ``i, i + n, ...`` (``--warm``: several processes fill Triton's cache side
    by side). ``ablated``: an ``ABLATIONS`` name, the Gluon kernel in place is that ablation
    (``_ablated_kernel``): recipe none only, rows labelled ``none-<name>``, no Triton.
    ``only``: these ``SWEEP_RECIPES`` names (comma-separated; ``--recipes``), else all.
    Every call is compiled and run once first, then timed ``rounds`` times round robin
    (``do_bench`` medians of ``rep`` ms each); a row's ``ms`` is the median of its rounds."""
    import triton

    from mla_triton import prefill
    from mla_triton.gluon_prefill import GluonPrefillConfig

    lens, heads = SWEEP_SHAPE_DEFS[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(lens)
    q, k = _rand(total, heads, DQK, gen), _rand(total, heads, DQK, gen)
    v = _rand(total, heads, DV, gen)
    cu = _cu(lens)
    out = torch.empty(total, heads, DV, dtype=q.dtype, device="cuda")

    def call(quant: Any, sparsity: Any, impl: str, config: Any) -> Callable[[], Any]:
        return lambda: prefill(
            q, k, v, cu, cu, softmax_scale=DQK**-0.5, causal=True, quant=quant,
            sparsity=sparsity, out=out, return_lse=True, max_seqlen_q=max(lens),
            max_seqlen_k=max(lens), impl=impl, config=config,
        )  # fmt: skip

    fns: list[tuple[str, str, Callable[[], Any]]] = []
    recipes = {f"none-{ablated}": (None, None)} if ablated else {
        n: r for n, r in SWEEP_RECIPES.items() if only is None or n in only.split(",")
    }  # fmt: skip
    for recipe, (quant, sparsity) in recipes.items():
        if not ablated:
            fns.append((recipe, "triton", call(quant, sparsity, "triton", None)))
        for name, t in tilings.items():
            fns.append((recipe, name, call(quant, sparsity, "gluon", GluonPrefillConfig(**t))))
    if shard is not None:
        for recipe, impl, fn in fns[shard[0] :: shard[1]]:
            t0 = time.time()
            try:
                fn()
                torch.cuda.synchronize()
                print(f"warm {recipe} {impl}: {time.time() - t0:.1f}s", flush=True)
            except Exception as exc:
                print(f"warm {recipe} {impl}: {exc!r}", flush=True)
        return []
    rows = [] if rows is None else rows
    entries: list[tuple[str, str, Callable[[], Any] | None]] = [("-", "fa3", None), *fns]
    ready: list[tuple[dict[str, Any], Callable[[], Any]]] = []
    for recipe, impl, fn in entries:  # compile and warm every call first
        row: dict[str, Any] = {"shape": shape, "recipe": recipe, "impl": impl}
        try:
            if fn is None:  # FA3: vLLM's wheel imported here, a missing one costs this row
                fn = fa3(q, k, v, cu, max(lens))
            fn()
            torch.cuda.synchronize()
            ready.append((row, fn))
        except Exception as exc:
            traceback.print_exc()
            row["error"] = repr(exc)
            rows.append(row)
    times: list[list[float]] = [[] for _ in ready]
    for _ in range(rounds):  # round robin: a drift in clocks reaches every call alike
        for i, (_, fn) in enumerate(ready):
            times[i].append(
                float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))
            )  # fmt: skip
    fa3_ms = None
    for (row, _), ms_rounds in zip(ready, times, strict=True):
        ms = statistics.median(ms_rounds)
        fa3_ms = ms if row["impl"] == "fa3" else fa3_ms
        row |= {"ms": ms, "tflops": _tflops(lens, heads, ms)}
        if rounds > 1:
            row["ms_rounds"] = ms_rounds
        if fa3_ms is not None:
            row["vs_fa3"] = fa3_ms / ms
        spread = f" (rounds {min(ms_rounds):.3f}-{max(ms_rounds):.3f})" if rounds > 1 else ""
        print(f"{shape:17s} {row['recipe']:10s} {row['impl']:16s} {ms:8.3f} ms "
              f"{row['tflops']:7.1f} TFLOP/s {row.get('vs_fa3', 0.0):6.3f}x FA3{spread}",
              flush=True)  # fmt: skip
        rows.append(row)
        flush()
    return rows


def _sweep_tilings(pingpong: bool, names: str | None) -> dict[str, dict[str, Any]]:
    """``SWEEP_TILINGS`` without the ping-pong ones unless ``pingpong``; with ``names``
    (``--tilings``, comma-separated) those of ``TILINGS`` instead (an unknown one raises)."""
    wanted = SWEEP_TILINGS if names is None else {n: TILINGS[n] for n in names.split(",")}
    return {n: t for n, t in wanted.items() if pingpong or not t["pingpong"]}


def sweep(
    result: dict[str, Any], pingpong: bool, rep: int, out: str, names: str | None = None,
    ablate: str | None = None, rounds: int = 1, only: str | None = None,
) -> None:  # fmt: skip
    """``--sweep``: every tiling x recipe at ``SWEEP_SHAPES`` with the Triton kernel and
    FA3 (bf16) in the same process; rows ``{shape, recipe, impl, ms, tflops, vs_fa3}``,
    then ``result["best"]``: the fastest Gluon tiling per shape and recipe. Written to
    ``out/gluon-prefill-sweep.json`` after each row (a cut-off run keeps its rows).
    ``names``: ``--tilings``. ``ablate`` (``--ablate``, ``ABLATIONS`` names, comma-separated;
    by default none): then the same tilings with each ablation, recipe none, beside FA3
    again (``no-softmax``: without the softmax step, the bound of each schedule's MMA issue
    pattern, what hiding the softmax completely could reach; ``no-v-check``: the masked
    tiles' V check skipped, what it costs). ``rounds`` (``--rounds``) and
    ``only`` (``--recipes``): ``_sweep_shape``'s."""
    from mla_triton.kernels import gluon_prefill as kmod

    tilings = _sweep_tilings(pingpong, names)
    rows: list[dict[str, Any]] = result["timings"]
    result["shapes"] = {n: {"lens": lens, "heads": h} for n, (lens, h) in SWEEP_SHAPE_DEFS.items()}

    def flush() -> None:
        _write(out, result, "gluon-prefill-sweep.json")

    for shape in SWEEP_SHAPES:
        _sweep_shape(shape, tilings, rep, rows=rows, flush=flush, rounds=rounds, only=only)
        torch.cuda.empty_cache()
    ablations = ablate.split(",") if ablate else []
    for name in ablations:
        real = kmod.gluon_prefill_kernel
        try:
            kmod.gluon_prefill_kernel = _ablated_kernel(name)
            for shape in SWEEP_SHAPES:
                _sweep_shape(
                    shape, tilings, rep, rows=rows, flush=flush, ablated=name, rounds=rounds
                )  # fmt: skip
                torch.cuda.empty_cache()
        finally:
            kmod.gluon_prefill_kernel = real
    best: list[dict[str, Any]] = []
    for shape in SWEEP_SHAPES:
        for recipe in [*SWEEP_RECIPES, *(f"none-{name}" for name in ablations)]:
            timed = [r for r in rows if r["shape"] == shape and r["recipe"] == recipe
                     and "ms" in r and r["impl"] != "triton"]  # fmt: skip
            if timed:
                top = min(timed, key=lambda r: float(r["ms"]))
                best.append({"shape": shape, "recipe": recipe, "tiling": top["impl"],
                             "vs_fa3": top.get("vs_fa3")})  # fmt: skip
    result["best"] = best
    print("\nfastest Gluon tiling (ratio to FA3 bf16), per shape and recipe:")
    for b in best:
        print(f"  {b['shape']:17s} {b['recipe']:10s} {b['tiling']:16s} {b['vs_fa3'] or 0:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=".", help="folder for gluon-prefill.json / .txt")
    parser.add_argument("--fa3", action="store_true", help="also time FlashAttention-3 (vLLM)")
    parser.add_argument("--no-check", action="store_true", help="timings only")
    parser.add_argument("--no-bench", action="store_true", help="correctness only")
    parser.add_argument("--no-quant", action="store_true", help="recipe none only")
    parser.add_argument("--no-ws", action="store_true", help="no warp-specialized tilings")
    parser.add_argument(
        "--sweep", action="store_true",
        help="only every SWEEP_TILINGS tiling x SWEEP_RECIPES recipe with Triton and FA3",
    )  # fmt: skip
    parser.add_argument("--no-pingpong", action="store_true", help="--sweep without ping-pong")
    parser.add_argument(
        "--tilings", default=None, help="--sweep: these TILINGS names (a,b,...) instead"
    )  # fmt: skip
    parser.add_argument("--rep", type=int, default=100, help="--sweep: do_bench rep (ms)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="--sweep: timings of each call, round robin"
    )  # fmt: skip
    parser.add_argument("--recipes", default=None, help="--sweep: these SWEEP_RECIPES (a,b)")
    parser.add_argument(
        "--ablate", nargs="?", const="no-softmax", default=None,
        help="--sweep: then its tilings with these ABLATIONS (a,b; default no-softmax)",
    )  # fmt: skip
    parser.add_argument(
        "--warm", default=None, help="--sweep: I/N, compile shard I of N only (L16384; --recipes)"
    )  # fmt: skip
    parser.add_argument(
        "--dispatch", action="store_true",
        help="only prefill's default (impl auto) against impl triton (and --fa3) for "
        "recipes none, fp8 and nvfp4",
    )  # fmt: skip
    args = parser.parse_args()
    import triton

    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu",
         "--format=csv,noheader"], capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "nvidia_smi": smi, "torch": torch.__version__,
        "triton": triton.__version__, "python": platform.python_version(),
        "checks": [], "timings": [],
    }  # fmt: skip
    print(f"{result['device']}  torch {torch.__version__}  triton {triton.__version__}  ({smi})")
    t0 = time.time()
    dispatch = [
        (True, functools.partial(timings, result, args.fa3, recipe, dispatch=True))
        for recipe in ("none", "fp8", "nvfp4")
    ]  # fmt: skip
    if args.sweep and args.warm:
        i, n = map(int, args.warm.split("/"))
        tilings = _sweep_tilings(not args.no_pingpong, args.tilings)
        _sweep_shape("b1-h16-L16384", tilings, args.rep, (i, n), only=args.recipes)
        return
    if args.sweep:
        sweep(
            result, not args.no_pingpong, args.rep, args.out, args.tilings, args.ablate,
            args.rounds, args.recipes,
        )  # fmt: skip
        _write(args.out, result, "gluon-prefill-sweep.json")
        print(f"total {time.time() - t0:.0f}s")
        return
    steps: list[tuple[bool, Callable[[], None]]] = (
        dispatch
        if args.dispatch
        else [
            (not args.no_check, lambda: checks(result)),
            (not args.no_bench, lambda: timings(result, args.fa3)),
            (not args.no_check and not args.no_quant, lambda: checks_quant(result)),
            (not args.no_bench and not args.no_quant, lambda: timings(result, False, "fp8")),
            (not args.no_bench and not args.no_quant, lambda: timings(result, False, "nvfp4")),
            (not args.no_bench, lambda: ablation(result)),
            (not args.no_check and not args.no_ws, lambda: checks_ws(result)),
            (not args.no_bench and not args.no_ws, lambda: timings(result, False, ws=True)),
        ]
    )
    for wanted, step in steps:
        if wanted:
            step()
            _write(args.out, result)  # after every step: a cut-off run keeps its rows
            passed = sum(bool(r.get("pass")) for r in result["checks"])
            print(f"-- checks passed: {passed} of {len(result['checks'])}; "
                  f"{time.time() - t0:.0f}s", flush=True)  # fmt: skip
    print(f"total {time.time() - t0:.0f}s")


def _write(out: str, result: dict[str, Any], name: str = "gluon-prefill.json") -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
