"""``mla-compare``'s outputs: the JSON report, the one-screen table and the PNG.

``build_report(native, results, ...)`` turns the engines' raw outputs (what
``engine.run_spec`` returns) into the report; ``table`` renders it with rich;
``plot`` draws per-recipe bars (KL mean and p99, top-1 agreement) and per-layer
lines (the ``observe`` relative L2 error of the attention output, prefill and decode).
With generations (``--generate``): ``generation_table`` shows the figures per
generated-position bucket beside the prompt-scoring ones, ``plot_generation`` draws KL
and top-1 agreement against generated position per recipe.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mla_vllm.compare.generation import Generated, summarize_generation
from mla_vllm.compare.metrics import TopK, first_divergence, summarize

__all__ = [
    "APPROXIMATION",
    "FORMAT",
    "build_report",
    "calibration_recovery",
    "generation_table",
    "layer_index",
    "plot",
    "plot_generation",
    "table",
]

FORMAT = "mla-compare"
APPROXIMATION = (
    "KL(native || recipe) per next-token position from each engine's top-k prompt "
    "logprobs: tokens in both top-k lists are their own buckets, all other tokens one "
    "remainder bucket; the KL of these coarse distributions is exact and a lower bound "
    "of the full-vocabulary KL (equal when the top-k hold the mass; rest_mass_mean is "
    "the native mass in the remainder)."
)


def _topk(result: Mapping[str, Any]) -> TopK:
    return TopK.cat(
        [TopK.from_lists(f["ids"], f["logprobs"], f["target"]) for f in result["forced"]]
    )


def _generation(
    native_scored: Sequence[Mapping[str, Any]],
    generated: Sequence[Mapping[str, Any]],
    resamples: int,
) -> dict[str, Any]:
    """``summarize_generation`` of one recipe's generations and native's scores of them;
    with several turns, also ``by_turn`` (each turn's overall, by-position and by-context
    figures) and each ``per_prompt`` entry's ``turn``."""
    prompts = [
        Generated(
            int(g["prompt_len"]),
            TopK.from_lists(n["ids"], n["logprobs"], n["target"]),
            TopK.from_lists(g["ids"], g["logprobs"], g["target"]),
        )
        for n, g in zip(native_scored, generated, strict=True)
    ]
    summary = summarize_generation(prompts, resamples=resamples)
    turns = [int(g.get("turn", 1)) for g in generated]
    if max(turns, default=1) > 1:
        by_turn: dict[str, Any] = {}
        for turn in sorted(set(turns)):
            part = summarize_generation(
                [p for p, t in zip(prompts, turns, strict=True) if t == turn],
                resamples=resamples,
            )
            by_turn[str(turn)] = {
                key: part[key] for key in ("overall", "by_position", "by_context", "curve")
            }
        summary["by_turn"] = by_turn
        per_prompt = summary["per_prompt"]
        assert isinstance(per_prompt, list)
        for entry, turn in zip(per_prompt, turns, strict=True):
            entry["turn"] = turn
    return summary


def _kl(entry: Mapping[str, Any], generated: bool) -> float | None:
    """A recipe's KL mean: prompt scoring, or over all generated positions."""
    if not generated:
        value = entry.get("kl_mean")
    else:
        value = entry.get("generation", {}).get("overall", {}).get("kl", {}).get("mean")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def calibration_recovery(report: dict[str, Any], pairs: Mapping[str, str]) -> None:
    """Each calibrated recipe's ``calibration``: the recipe it copies (``of``) and the
    share of that recipe's KL mean the calibration removed, ``1 - KL(calibrated) /
    KL(uncalibrated)``, for prompt scoring (``kl_recovered``) and generation
    (``generated_kl_recovered``): 0.3 means 30% less KL, a negative share more. In place."""
    recipes = report["recipes"]
    for name, base in pairs.items():
        if name not in recipes:
            continue
        entry: dict[str, Any] = {"of": base}
        for key, generated in (("kl_recovered", False), ("generated_kl_recovered", True)):
            cal = _kl(recipes[name], generated)
            ref = _kl(recipes.get(base, {}), generated)
            entry[key] = None if cal is None or not ref else 1.0 - cal / ref
        recipes[name]["calibration"] = entry


def layer_index(name: str) -> int:
    """The N of ``...layers.N...`` (-1 when absent), for ordering layers."""
    match = re.search(r"layers\.(\d+)", name)
    return int(match.group(1)) if match else -1


def _greedy(native: Sequence[Sequence[int]], test: Sequence[Sequence[int]]) -> dict[str, float]:
    agreed = [first_divergence(a, b) for a, b in zip(native, test, strict=True)]
    length = max((len(a) for a in native), default=0)
    return {
        "tokens": float(length),
        "agreed_mean": sum(agreed) / len(agreed),
        "agreed_min": float(min(agreed)),
        "identical_fraction": sum(n == length for n in agreed) / len(agreed),
    }


def _layer_summary(stats: Mapping[str, Mapping[str, Mapping[str, float]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for path in ("prefill", "decode"):
        values = [s[path]["rel_l2_mean"] for s in stats.values() if path in s]
        if values:
            out[f"{path}_rel_l2_mean"] = sum(values) / len(values)
            out[f"{path}_rel_l2_max"] = max(
                s[path]["rel_l2_max"] for s in stats.values() if path in s
            )
    return out


def build_report(
    native: Mapping[str, Any],
    results: Mapping[str, Mapping[str, Any]],
    *,
    recipes: Mapping[str, Mapping[str, Any]],
    errors: Mapping[str, str] | None = None,
    meta: Mapping[str, Any] | None = None,
    tie_margin: float = 0.0,
    resamples: int = 1000,
) -> dict[str, Any]:
    """The report: per recipe KL/top-1/perplexity/greedy/per-layer error, plus the setup.

    With generations (``native["scored"]`` and a recipe's ``generated``), the recipe's
    ``generation`` holds ``summarize_generation``'s figures (``resamples`` bootstrap
    resamples).
    """
    ref = _topk(native)
    report: dict[str, Any] = {
        "format": FORMAT,
        "version": 1,
        **dict(meta or {}),
        "kl_approximation": APPROXIMATION,
        "tie_margin": tie_margin,
        "native": {
            "backend": native["engine"]["backend"],
            "ppl": summarize(ref, ref)["ppl"],
            "positions": int(ref.target.numel()),
            "engine": native["engine"],
        },
        "recipes": {},
    }
    for name, config in recipes.items():
        entry: dict[str, Any] = {"config": dict(config)}
        if errors and name in errors:
            entry["error"] = errors[name]
        elif name in results:
            result = results[name]
            test = _topk(result)
            entry |= summarize(ref, test, tie_margin=tie_margin)
            if native.get("greedy") and result.get("greedy"):
                entry["greedy"] = _greedy(native["greedy"], result["greedy"])
            scored = (native.get("scored") or {}).get(name)
            if scored is not None and result.get("generated"):
                entry["generation"] = _generation(scored, result["generated"], resamples)
            stats = dict(result.get("stats") or {})
            entry["layers"] = {
                n: stats[n] for n in sorted(stats, key=lambda n: (layer_index(n), n))
            }
            entry["attention_error"] = _layer_summary(stats)
            entry["amax"] = result.get("amax") or {}
            entry["engine"] = result["engine"]
        report["recipes"][name] = entry
    return report


def _fmt(value: object, spec: str) -> str:
    if not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def table(report: Mapping[str, Any]) -> Any:
    """A ``rich.table.Table`` of the report, one row per recipe."""
    from rich.table import Table

    native = report["native"]
    tbl = Table(
        title=f"mla-compare: {report.get('model', '')} vs {native['backend']} "
        f"(ppl {native['ppl']:.4f}, {native['positions']} positions, top-{report.get('top_k')})",
        title_justify="left",
    )
    for column in ("recipe", "KL mean", "KL p99", "KL max", "top-1", "ppl", "Δppl"):
        tbl.add_column(column, justify="left" if column == "recipe" else "right")
    tbl.add_column("greedy", justify="right")
    tbl.add_column("attn rel-L2 pre/dec", justify="right")
    for name, e in report["recipes"].items():
        if "error" in e:
            tbl.add_row(name, f"[red]failed: {e['error'].splitlines()[0][:60]}[/red]")
            continue
        greedy = e.get("greedy")
        attn = e.get("attention_error", {})
        recovered = e.get("calibration", {}).get("kl_recovered")
        label = name if recovered is None else f"{name} ({recovered:+.0%} KL recovered)"
        tbl.add_row(
            label,
            _fmt(e["kl_mean"], ".3g"),
            _fmt(e["kl_p99"], ".3g"),
            _fmt(e["kl_max"], ".3g"),
            _fmt(e["top1_agreement"], ".4f"),
            _fmt(e["ppl"], ".4f"),
            _fmt(e["ppl_delta"], "+.4f"),
            f"{greedy['agreed_mean']:.1f}/{greedy['tokens']:.0f}" if greedy else "-",
            f"{_fmt(attn.get('prefill_rel_l2_mean'), '.3f')}/"
            f"{_fmt(attn.get('decode_rel_l2_mean'), '.3f')}",
        )
    return tbl


def _save(fig: Any, title: str, path: str | Path) -> Path:
    """Title, lay out, write and close one figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot(report: Mapping[str, Any], path: str | Path) -> Path:
    """Per-recipe bars (KL mean/p99, top-1) and per-layer lines of the attention error."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {n: e for n, e in report["recipes"].items() if "error" not in e}
    names = list(ok)
    fig, (ax_kl, ax_top, ax_layer) = plt.subplots(1, 3, figsize=(15, 4.5))
    xs = list(range(len(names)))
    width = 0.4
    floor = 1e-9  # a KL of 0 still shows on the log axis
    ax_kl.bar(
        [x - width / 2 for x in xs],
        [max(ok[n]["kl_mean"], floor) for n in names],
        width,
        label="mean",
    )
    ax_kl.bar(
        [x + width / 2 for x in xs],
        [max(ok[n]["kl_p99"], floor) for n in names],
        width,
        label="p99",
    )
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL(native || recipe) [nats]")
    ax_kl.set_title("next-token KL (top-k + remainder)")
    ax_top.bar(xs, [ok[n]["top1_agreement"] for n in names], 0.6)
    ax_top.set_ylim(0.0, 1.0)
    ax_top.set_ylabel("top-1 agreement with native")
    ax_top.set_title("top-1 agreement")
    for ax in (ax_kl, ax_top):
        ax.set_xticks(xs)
        ax.set_xticklabels(names, rotation=30, ha="right")
    ax_kl.legend()
    drawn = False
    for n in names:
        layers = ok[n].get("layers", {})
        for path_name, style in (("prefill", "-"), ("decode", "--")):
            points = sorted(
                (layer_index(layer), s[path_name]["rel_l2_mean"])
                for layer, s in layers.items()
                if path_name in s and "@" not in layer
            )
            if points:
                ax_layer.plot(
                    *zip(*points, strict=True), style, marker="o", label=f"{n} {path_name}"
                )
                drawn = True
    ax_layer.set_xlabel("layer")
    ax_layer.set_ylabel("attention output rel. L2 error")
    ax_layer.set_title("per-layer error (observe)")
    if drawn:
        ax_layer.legend(fontsize="small")
    else:
        ax_layer.text(0.5, 0.5, "no observe statistics", ha="center", transform=ax_layer.transAxes)
    return _save(fig, f"{report.get('model', '')} vs {report['native']['backend']}", path)


def _ci(figure: Mapping[str, float] | None, spec: str) -> str:
    """``mean [low, high]`` of a bootstrap figure."""
    if not figure or not isinstance(figure.get("mean"), float) or math.isnan(figure["mean"]):
        return "-"
    return f"{figure['mean']:{spec}} [{figure['low']:{spec}}, {figure['high']:{spec}}]"


def generation_table(report: Mapping[str, Any]) -> Any:
    """A ``rich.table.Table`` of the generation figures: per recipe, the prompt-scoring
    (prefill) row, then all generated positions and each generated-position bucket."""
    from rich.table import Table

    level = next(
        (e["generation"]["level"] for e in report["recipes"].values() if "generation" in e),
        0.95,
    )
    tbl = Table(
        title=f"generation fidelity vs {report['native']['backend']}: "
        f"{report.get('generate')} tokens per prompt, mean [{level:.0%} interval]",
        title_justify="left",
    )
    columns = ("recipe", "part", "positions", "KL mean", "KL p99", "KL max", "top-1")
    for column in (*columns, "ΔNLL", "acceptance"):
        tbl.add_column(column, justify="left" if column in ("recipe", "part") else "right")
    for name, e in report["recipes"].items():
        gen = e.get("generation")
        if gen is None:
            continue
        tbl.add_row(
            name,
            "prompt (prefill)",
            _fmt(e["positions"], ".0f"),
            _fmt(e["kl_mean"], ".3g"),
            _fmt(e["kl_p99"], ".3g"),
            _fmt(e["kl_max"], ".3g"),
            _fmt(e["top1_agreement"], ".4f"),
            "-",
            "-",
        )
        rows = [("generated, all", gen["overall"])]
        rows += [(f"generated {label}", f) for label, f in gen["by_position"].items()]
        for turn, figures in gen.get("by_turn", {}).items():
            rows.append((f"turn {turn}, all", figures["overall"]))
            rows += [(f"turn {turn} {label}", f) for label, f in figures["by_position"].items()]
        for label, f in rows:
            tbl.add_row(
                "",
                label,
                str(f["positions"]),
                _ci(f["kl"], ".3g"),
                _fmt(f.get("kl_p99"), ".3g"),
                _fmt(f.get("kl_max"), ".3g"),
                _ci(f["top1"], ".4f"),
                _ci(f["dnll"], "+.3g"),
                _ci(f["acceptance"], ".4f"),
            )
        tbl.add_section()
    return tbl


def plot_generation(report: Mapping[str, Any], path: str | Path) -> Path:
    """KL (log axis) and top-1 agreement against generated position, one line per recipe
    (means over equal windows of position, the ``curve`` of each recipe's generation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_kl, ax_top) = plt.subplots(1, 2, figsize=(12, 4.5))
    floor = 1e-9  # a KL of 0 still shows on the log axis
    for name, e in report["recipes"].items():
        curve = e.get("generation", {}).get("curve")
        if not curve or not curve["position"]:
            continue
        ax_kl.plot(curve["position"], [max(v, floor) for v in curve["kl"]], label=name)
        ax_top.plot(curve["position"], curve["top1"], label=name)
        prefill = e.get("kl_mean")
        if isinstance(prefill, float):
            ax_kl.axhline(max(prefill, floor), linestyle=":", color=ax_kl.lines[-1].get_color())
    ax_kl.set_yscale("log")
    ax_kl.set_xlabel("generated position")
    ax_kl.set_ylabel("KL(native || recipe) [nats]")
    ax_kl.set_title("KL per generated position (dotted: prompt scoring)")
    ax_top.set_xlabel("generated position")
    ax_top.set_ylabel("top-1 agreement with native")
    ax_top.set_ylim(0.0, 1.02)
    ax_top.set_title("top-1 agreement per generated position")
    for ax in (ax_kl, ax_top):
        if ax.lines:
            ax.legend(fontsize="small")
    title = f"{report.get('model', '')}: generation vs {report['native']['backend']}"
    return _save(fig, title, path)
