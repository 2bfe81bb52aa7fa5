"""``--compare-tp A,B``: two result folders (say TP=1 and TP=2), within stated bounds.

Needs no GPU: it reads the ``<config>.json`` files of both folders and compares
logprobs, per-layer statistics and resolved recipes configuration by configuration.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .configs import RUNS, TP_RUNS
from .logprobs import describe_diff, max_diff

# Bounds of TP=B against TP=A, in nats, for the same configuration (see
# docs/contributing.md): unquantized runs differ only by the bf16 rounding of
# the row-parallel all-reduces (o_proj, down_proj) and of shape-dependent GEMM
# kernels; nvfp4 runs see those same input differences, which can move an element
# across a rounding boundary of the 4-bit grid (one quantum), so their bound is
# wider. Quantization scales themselves never depend on the head split
# (docs/numerics.md "Scales").
TP_TOL = {"none": 0.05, "nvfp4": 0.15}
TP_MEAN_TOL = {"none": 0.01, "nvfp4": 0.03}  # mean |Δ prompt logprob|
STATS_REL_TOL = 0.15  # per layer/path: |rel_l2_mean(B, mean over ranks) / rel_l2_mean(A) - 1|
STATS_COS_TOL = 0.005  # per layer/path: |Δ cosine_mean|


def load_results(folder: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in RUNS:
        path = folder / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def _merged_stats(stats: dict[str, Any]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """``{layer: {path: [stats of each rank]}}`` from get_stats' ``layer`` / ``layer@rank`` keys."""
    merged: dict[str, dict[str, list[dict[str, float]]]] = {}
    for key, per_path in stats.items():
        layer = key.split("@", 1)[0]
        for path, values in per_path.items():
            merged.setdefault(layer, {}).setdefault(path, []).append(values)
    return merged


def compare_tp(a_dir: Path, b_dir: Path) -> tuple[bool, list[str], list[dict[str, Any]]]:
    """Compare two result folders configuration by configuration; (passed, table, checks)."""
    a, b = load_results(a_dir), load_results(b_dir)
    rows: list[dict[str, Any]] = []
    lines = [f"TP compare: A = {a_dir}, B = {b_dir}"]

    def row(check: str, ok: bool, value: str) -> None:
        rows.append({"check": check, "ok": ok, "value": value})

    common = [n for n in TP_RUNS if n in a and n in b]
    if not common:
        row("configurations in both folders", False, f"none of {list(TP_RUNS)}")
    for name in common:
        ra, rb = a[name], b[name]
        label = f"{name} TP={ra.get('tp', 1)} vs TP={rb.get('tp', 1)}"
        wa, wb = ra.get("weights", {}), rb.get("weights", {})
        if wa.get("sha256") is None or wa.get("sha256") != wb.get("sha256"):
            row(f"{label}: same checkpoint", False, f"{wa.get('sha256')} vs {wb.get('sha256')}")
            continue
        kind = "nvfp4" if name.startswith("nvfp4") else "none"
        tol, mean_tol = TP_TOL[kind], TP_MEAN_TOL[kind]
        d = max_diff(ra["outputs"], rb["outputs"], tol)
        ok = (
            d["prompt_max"] <= tol
            and d["prompt_mean"] <= mean_tol
            and d["gen_max"] <= tol
            and d["divergences_near_ties"]
        )
        row(f"{label}: logprobs (max {tol}, mean {mean_tol} nats)", ok, describe_diff(d, "A's"))
        recipes_a = {
            layer: info["recipe"]
            for w in ra.get("workers", [])
            for layer, info in w["layers"].items()
        }
        recipes_b = {
            layer: info["recipe"]
            for w in rb.get("workers", [])
            for layer, info in w["layers"].items()
        }
        if ra["backend"] == "MLA_QUANT" and (recipes_a or recipes_b):
            row(
                f"{label}: every layer resolves the same recipe",
                recipes_a == recipes_b and None not in recipes_a.values(),
                "yes" if recipes_a == recipes_b else f"{recipes_a} vs {recipes_b}",
            )
        sa, sb = _merged_stats(ra.get("stats") or {}), _merged_stats(rb.get("stats") or {})
        for layer in sorted(set(sa) | set(sb)):
            for path in sorted(set(sa.get(layer, {})) | set(sb.get(layer, {}))):
                xa, xb = sa.get(layer, {}).get(path, []), sb.get(layer, {}).get(path, [])
                if not xa or not xb:
                    row(f"{label}: {layer} {path} statistics", False, "missing on one side")
                    continue
                calls_a = {v["calls"] for v in xa}
                calls_b = {v["calls"] for v in xb}
                rel_a = sum(v["rel_l2_mean"] for v in xa) / len(xa)
                rel_b = sum(v["rel_l2_mean"] for v in xb) / len(xb)
                cos_a = sum(v["cosine_mean"] for v in xa) / len(xa)
                cos_b = sum(v["cosine_mean"] for v in xb) / len(xb)
                rel = abs(rel_b / rel_a - 1.0) if rel_a > 0 else math.inf
                ok = (
                    calls_a == calls_b
                    and len(calls_a) == 1
                    and rel <= STATS_REL_TOL
                    and abs(cos_b - cos_a) <= STATS_COS_TOL
                )
                per_rank = ", ".join(f"{v['rel_l2_mean']:.4f}" for v in xb)
                row(
                    f"{label}: {layer} {path} statistics (rel_l2 within "
                    f"{STATS_REL_TOL:.0%}, cosine within {STATS_COS_TOL})",
                    ok,
                    f"calls {sorted(calls_a)} vs {sorted(calls_b)}, rel_l2_mean {rel_a:.4f} vs "
                    f"{rel_b:.4f} (ranks {per_rank}; {rel:.1%}), cosine_mean {cos_a:.5f} vs "
                    f"{cos_b:.5f}",
                )
    passed = bool(rows) and all(r["ok"] for r in rows)
    lines += [f"  [{'ok' if r['ok'] else 'FAIL'}] {r['check']}: {r['value']}" for r in rows]
    lines.append(f"tp_compare: {'PASS' if passed else 'FAIL'}")
    return passed, lines, rows
