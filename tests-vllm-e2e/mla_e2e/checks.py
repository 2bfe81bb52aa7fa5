"""Every check of one run of the configurations (at TP=N), and the report's lines.

- ``MLA_QUANT`` with no quantization against ``TRITON_MLA``, and nvfp4 through the
  shadow against nvfp4 on read (the same function), eager and with CUDA graphs:
  prompt and generated logprobs within ``--tol``; greedy tokens identical, except
  at a near tie (the native top-2 margin within ``2 * tol``: reported, and
  generated logprobs compared up to there);
- the quantized runs against the native one: within the bounds of ``bounds``
  (derived from ``tests-vllm-e2e/results/``), logprobs and per-layer statistics;
- every run: finite logprobs, the expected impl, at TP > 1 what every worker saw;
  the shadow's bytes in every layer's cache rows; per-layer statistics of both
  paths where the run observes;
- expected failures name what is wrong; install/uninstall in place restores the
  native logprobs exactly; calibration covers q, k and v of both paths.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .bounds import MEASURED, logprob_check, stats_check
from .configs import CONFIG, EXPECT, LAYERS, RUNS
from .logprobs import describe_diff, max_diff

__all__ = ["check_error", "check_workers", "evaluate", "max_diff"]


def _finite(result: dict[str, Any]) -> bool:
    for key in ("outputs", "native", "installed", "restored"):
        for output in result.get(key, []):
            values = output["logprobs"] + [v for v in output["prompt_logprobs"] if v is not None]
            if any(not math.isfinite(v) for v in values):
                return False
    return True


def check_workers(result: dict[str, Any], tp: int) -> list[str]:
    """Problems with what the worker processes saw (empty: none).

    ``tp`` distinct worker processes with ranks 0..tp-1, other than the engine's
    process at TP > 1; each layer with ``heads / tp`` local heads; for MLA_QUANT:
    registered in every worker, the ``mla_quant`` config there equal to the one
    given, and every layer's resolved recipe bound and identical on every rank.
    """
    workers = result.get("workers") or []
    problems: list[str] = []
    if len(workers) != tp:
        return [f"{len(workers)} worker replies, expected {tp}"]
    pids = {w["pid"] for w in workers}
    if len(pids) != tp:
        problems.append(f"worker pids {sorted(pids)}: not {tp} distinct processes")
    if tp > 1 and result.get("engine_pid") in pids:
        problems.append("a worker ran in the engine's process")
    if sorted(w["tp_rank"] for w in workers) != list(range(tp)):
        problems.append(f"TP ranks {[w['tp_rank'] for w in workers]}")
    heads = int(CONFIG["num_attention_heads"]) // tp
    recipes: dict[str, set[str | None]] = {}
    for w in workers:
        where = f"rank {w['tp_rank']}"
        if len(w["layers"]) != LAYERS:
            problems.append(f"{where}: {len(w['layers'])} MLA layers")
        for layer, info in w["layers"].items():
            if info["num_heads"] != heads:
                problems.append(f"{where} {layer}: {info['num_heads']} local heads, not {heads}")
            if result["backend"] != "MLA_QUANT":
                continue
            if info["impl"] != "MLAQuantImpl":
                problems.append(f"{where} {layer}: impl {info['impl']}")
            if info["mla_quant"] != result["quant"]:
                problems.append(f"{where} {layer}: mla_quant {info['mla_quant']!r} in the worker")
            recipes.setdefault(layer, set()).add(info["recipe"])
        if result["backend"] == "MLA_QUANT" and w["registered"] != "MLAQuantBackend":
            problems.append(f"{where}: MLA_QUANT {w['registered']}")
    for layer, seen in sorted(recipes.items()):
        if None in seen or len(seen) != 1:
            problems.append(
                f"{layer}: recipes differ between ranks or unbound: {sorted(map(str, seen))}"
            )
    return problems


def check_error(name: str, result: dict[str, Any], log: str) -> list[str]:
    """Problems with an expected failure: it must raise, and say what ``EXPECT`` lists."""
    if not result.get("raised"):
        return ["the engine started and generated: no error raised"]
    expect = EXPECT.get(name, {})
    problems = [
        f"the raised error does not mention {text!r}"
        for text in expect.get("message", ())
        if text not in result.get("message", "")
    ]
    problems += [
        f"the log does not mention {text!r}" for text in expect.get("log", ()) if text not in log
    ]
    return problems


def evaluate(
    results: dict[str, Any], tol: float, out: Path | None = None, tp: int = 1
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every check as ``{check, ok, value}``, and the report's lines."""
    checks: list[dict[str, Any]] = []
    lines: list[str] = []

    def check(label: str, ok: bool, value: str) -> None:
        checks.append({"check": label, "ok": ok, "value": value})
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {label}: {value}")

    for native, quant in (
        ("triton_eager", "quant_none_eager"),
        ("triton_graphs", "quant_none_graphs"),
        # same recipe through the shadow KV path: the same function as on-read
        ("nvfp4_eager", "nvfp4_shadow_eager"),
        ("nvfp4_graphs", "nvfp4_shadow_graphs"),
    ):
        if native in results and quant in results:
            d = max_diff(results[native]["outputs"], results[quant]["outputs"], tol)
            ok = d["prompt_max"] <= tol and d["gen_max"] <= tol and d["divergences_near_ties"]
            check(f"{quant} vs {native} (tol {tol} nats)", ok, describe_diff(d))
    for name, m in MEASURED.items():  # the quantized runs: bounds from results/
        if name in results and m.native in results:
            d = max_diff(results[m.native]["outputs"], results[name]["outputs"])
            check(*logprob_check(name, d))
            stats = stats_check(name, results[name].get("stats"))
            if stats is not None and results[name].get("eager"):
                check(*stats)
    for name in [n for n in RUNS if n in results]:
        result = results[name]
        if RUNS[name].action == "expect_error":
            log = (out / f"{name}.log").read_text(errors="replace") if out is not None else ""
            problems = check_error(name, result, log)
            first = result.get("message", "").splitlines()[:1] or ["(none)"]
            check(
                f"{name}: fails in the workers, naming what is wrong",
                not problems,
                "; ".join(problems) or f"yes: {first[0][:300]}",
            )
            continue
        problems = [] if _finite(result) else ["non-finite logprobs"]
        per_rank = result.get("layers_per_rank") or [result.get("layers", {})]
        impls = sorted({v[0] for rank in per_rank for v in rank.values()})
        if result["backend"] == "MLA_QUANT" and impls != ["MLAQuantImpl"]:
            problems.append(f"impls {impls}, expected MLAQuantImpl")
        stats = result.get("stats")
        what = f"finite logprobs, impl {'/'.join(impls)}"
        if tp > 1:
            problems += check_workers(result, tp)
            what += f", {tp} worker processes with the config and recipes"
        recipe = RUNS[name].quant if name in RUNS else None
        if isinstance(recipe, dict) and recipe.get("kv_path") == "shadow":
            shadows = result.get("shadows") or {}
            raw = 2 * (CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"])
            rows = sorted({(v or {}).get("cache_row_bytes") or 0 for v in shadows.values()})
            if len(shadows) != LAYERS or not all(
                v and v["cache_row_bytes"] and v["cache_row_bytes"] >= raw + v["token_bytes"]
                for v in shadows.values()
            ):
                problems.append(f"shadow bytes missing from the cache rows: {shadows}")
            what += f", shadow in every layer's cache rows ({rows} bytes per token, raw {raw})"
        if name.startswith(("nvfp4", "fp8")) and result["eager"]:
            paths = [set(v) for v in (stats or {}).values()]
            want = LAYERS * tp  # get_stats keys other ranks' layers as "<layer>@<rank>"
            if len(paths) != want or not all({"prefill", "decode"} <= p for p in paths):
                problems.append(f"per-layer statistics for {len(paths)} layer shards, not {want}")
            what += f", prefill and decode statistics of {LAYERS} layers x {tp} ranks"
        check(f"{name}: {what}", not problems, "; ".join(problems) or "yes")
        for layer, per_path in sorted((stats or {}).items()):
            for path, s in sorted(per_path.items()):
                lines.append(
                    f"  [stats] {name} {layer} {path}: calls {s['calls']:.0f}, rel_l2 mean "
                    f"{s['rel_l2_mean']:.4f} max {s['rel_l2_max']:.4f}, cosine mean "
                    f"{s['cosine_mean']:.5f} min {s['cosine_min']:.5f}, max_abs mean "
                    f"{s['max_abs_mean']:.4f} max {s['max_abs_max']:.4f}"
                )
    if "install_in_place" in results:
        r = results["install_in_place"]
        back = max_diff(r["native"], r["restored"])
        changed = max_diff(r["native"], r["installed"])
        exact = back["prompt_max"] == 0.0 and back["gen_max"] == 0.0 and back["same_tokens"]
        moved = max(changed["prompt_max"], changed["gen_max"])
        installed = sorted({v[0] for v in r.get("installed_layers", {}).values()})
        restored = sorted({v[0] for v in r.get("restored_layers", {}).values()})
        check(
            "install_in_place: nvfp4 installed, uninstall restores exactly",
            exact and moved > 0.0 and installed == ["MLAQuantImpl"],
            f"installed impls {installed}, nvfp4 moved logprobs by up to {moved:.4f}; "
            f"restored impls {restored}, max |Δ| after uninstall "
            f"{max(back['prompt_max'], back['gen_max']):.1e}, tokens identical "
            f"{back['same_tokens']}",
        )
    if "calibrate" in results:
        layers = results["calibrate"]["calibration"]["layers"]
        ok = len(layers) == LAYERS and all(
            set(p) == {"prefill", "decode"} and all(set(r) == {"q", "k", "v"} for r in p.values())
            for p in layers.values()
        )
        check(f"calibrate: q, k, v amax of both paths for {LAYERS} layers", ok, f"{len(layers)}")
        for layer, per_path in sorted(layers.items()):
            for path, roles in sorted(per_path.items()):
                amax = ", ".join(f"{k} {v:.3f}" for k, v in sorted(roles.items()))
                lines.append(f"  [calibration] {layer} {path}: {amax}")
    return checks, lines
