"""Plot the benchmark CSVs: per op, the ratio to the anchor per shape and recipe.

From the repository root::

    python packages/mla-triton/benchmarks/plot.py [--out DIR] [--markdown]
        [--commit abc1234] [--gpu "NVIDIA H200"] [--impl auto]

Reads ``results/decode.csv``, ``shadow.csv``, ``prefill.csv`` (this folder; ``--results``)
and mla-vllm's ``benchmarks/results/serve.csv`` (``--serve``). Of the rows of the newest
commit and GPU (the commit nearest the checkout's HEAD in git history, by date where
git does not know it, and that commit's newest row's GPU; or ``--commit``/``--gpu``),
for ``--impl`` (ours: ``auto``; serving: ``mla_quant``) in the op's mode (decode and
shadow: ``graph``, prefill ``eager``, serving ``graph``; ``--mode`` overrides), the
newest row per shape and recipe.
Draws ``<op>.png`` into ``--out`` (default: the results folder): bars of the ratio to
the anchor (FlashMLA bf16, FA3 bf16, the FLASHMLA engine). ``--markdown`` prints the
tables instead: decode on read and through the shadow together (one table per GPU and
commit where their newest rows differ), prefill, serving, and the host time per eager
call.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from harness import RESULTS, read_rows

SERVE = Path(__file__).resolve().parents[2] / "mla-vllm" / "benchmarks" / "results" / "serve.csv"
OPS = {  # csv stem: (op column, default mode, our impl, anchor impl, anchor label)
    "decode": ("decode", "graph", "auto", "flashmla", "FlashMLA"),
    "shadow": ("decode_shadow", "graph", "auto", "flashmla", "FlashMLA"),
    "prefill": ("prefill", "eager", "auto", "fa3", "FA3"),
    "serve": ("serve", "graph", "mla_quant", "flashmla", "FLASHMLA"),
}


def history_depth(commit: str) -> int:
    """How many commits ``commit`` has in its history (its place in HEAD's line), or -1
    where git does not know it (no repository, a commit of another clone)."""
    try:
        done = subprocess.run(
            ["git", "rev-list", "--count", commit], capture_output=True, text=True, check=False,
            cwd=Path(__file__).resolve().parent,
        )  # fmt: skip
    except OSError:
        return -1
    return int(done.stdout) if done.returncode == 0 and done.stdout.strip().isdigit() else -1


def newest(rows: Sequence[dict[str, str]], commit: str | None, gpu: str | None) -> tuple[str, str]:
    """The commit and GPU to show: given, else the newest commit's (deepest in git
    history; a baseline tree measured later, such as an older commit timed for a
    comparison, does not replace it), ties and unknown commits by the rows' date."""
    depth = {c: history_depth(c) for c in {r["commit"] for r in rows}}
    last = max(rows, key=lambda r: (depth[r["commit"]], r["date"]))
    commit = commit or last["commit"]
    if gpu is None:
        gpu = max((r for r in rows if r["commit"] == commit), key=lambda r: r["date"])["gpu"]
    return commit, gpu


def table(
    rows: Sequence[dict[str, str]], op: str, mode: str, impl: str, commit: str, gpu: str
) -> dict[tuple[str, str], dict[str, str]]:
    """``(shape, recipe) -> row``: the newest row of ``impl`` in ``mode``."""
    got: dict[tuple[str, str], dict[str, str]] = {}
    for r in sorted(rows, key=lambda r: r["date"]):
        if (r["op"], r["mode"], r["impl"], r["commit"], r["gpu"]) == (op, mode, impl, commit, gpu):
            got[(r["shape"], r["recipe"])] = r
    return got


def ordered(keys: Sequence[tuple[str, str]], i: int) -> list[str]:
    return list(dict.fromkeys(k[i] for k in keys))


def label(stem: str, recipe: str) -> str:
    """A column title: decode's recipes "on read", the shadow's "shadow" (with storage)."""
    if stem == "decode":
        return recipe if recipe == "none" else f"{recipe} on read"
    if stem == "shadow":
        fmt, _, storage = recipe.partition("-")
        return f"{fmt} shadow" if storage == "fp16" else f"{fmt} {storage} shadow"
    return recipe


def cell(row: dict[str, str] | None) -> str:
    return f"{float(row['ratio']):.2f}x" if row and row["ratio"] else "-"


def markdown(groups: Sequence[tuple[str, str, dict[tuple[str, str], dict[str, str]], dict]],
             title: str, anchor_label: str) -> str:  # fmt: skip
    """One table: rows are shapes (with the anchor's time), columns every group's recipes."""
    shapes = list(dict.fromkeys(k[0] for _, _, t, _ in groups for k in t))
    cols = [(stem, recipe, t) for stem, _, t, _ in groups for recipe in ordered(list(t), 1)]
    lines = [
        f"| {title} | " + " | ".join(label(stem, r) for stem, r, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for shape in shapes:
        anchor = next((a[shape] for _, _, _, a in groups if shape in a), None)
        unit = "tok/s" if anchor and anchor["tok_s"] and not anchor["tflops"] else "µs"
        value = anchor["tok_s"] if unit == "tok/s" else anchor["time_us"] if anchor else ""
        head = shape.replace("-", " ") + (
            f" ({anchor_label} {float(value):.0f} {unit})" if value else ""
        )
        lines.append(
            f"| {head} | " + " | ".join(cell(t.get((shape, r))) for _, r, t in cols) + " |"
        )
    return "\n".join(lines)


def host_table(rows: Sequence[dict[str, str]], op: str, impl: str, commit: str, gpu: str) -> str:
    t = table(rows, op, "host", impl, commit, gpu)
    if not t:
        return ""
    shapes, recipes = ordered(list(t), 0), ordered(list(t), 1)
    lines = [f"| {op}: host µs a call (CPU time, GPU kept busy) | " + " | ".join(recipes) + " |",
             "|---|" + "---|" * len(recipes)]  # fmt: skip
    for shape in shapes:
        cells = [t[(shape, r)]["time_us"] if (shape, r) in t else "-" for r in recipes]
        lines.append(f"| {shape.replace('-', ' ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(stem: str, t: dict[tuple[str, str], dict[str, str]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, recipes = ordered(list(t), 0), ordered(list(t), 1)
    width = 0.8 / max(1, len(recipes))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(shapes) + 2), 4.2))
    for i, recipe in enumerate(recipes):
        xs = [j + (i - (len(recipes) - 1) / 2) * width for j in range(len(shapes))]
        ys = [float(t[(s, recipe)]["ratio"] or "nan") if (s, recipe) in t else float("nan")
              for s in shapes]  # fmt: skip
        ax.bar(xs, ys, width, label=label(stem, recipe))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)), [s.replace("-", " ") for s in shapes])
    ax.set_ylabel("ratio to the anchor (higher is faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the CSVs")
    parser.add_argument("--serve", type=Path, default=SERVE, help="mla-vllm's serve.csv")
    parser.add_argument("--out", type=Path, default=None, help="PNG folder (default --results)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--gpu", default=None)
    parser.add_argument("--impl", default=None, help="ours (default auto; serving mla_quant)")
    parser.add_argument("--mode", default=None, help="graph, eager (default: the op's)")
    parser.add_argument("--markdown", action="store_true", help="print tables, draw nothing")
    args = parser.parse_args(argv)
    groups = []
    for stem, (op, mode, impl, anchor, anchor_label) in OPS.items():
        rows = read_rows(args.serve if stem == "serve" else args.results / f"{stem}.csv")
        rows = [r for r in rows if r["op"] == op]
        if not rows:
            print(f"{stem}: no rows", file=sys.stderr)
            continue
        commit, gpu = newest(rows, args.commit, args.gpu)
        mode = args.mode or mode
        impl = args.impl if args.impl and stem != "serve" else impl
        t = table(rows, op, mode, impl, commit, gpu)
        anchors = {s: r for (s, _), r in table(rows, op, mode, anchor, commit, gpu).items()}
        groups.append((stem, f"{gpu}, {commit}, {mode}", t, anchors, anchor_label, rows, impl))
        if not args.markdown and t:
            title = f"{op} ({impl}) / {anchor_label}, {mode}: {gpu}, commit {commit}"
            plot(stem, t, (args.out or args.results) / f"{stem}.png", title)
    if args.markdown:
        decode = [(g[0], g[1], g[2], g[3]) for g in groups if g[0] in ("decode", "shadow")]
        for where in dict.fromkeys(g[1] for g in decode):  # one table per GPU and commit
            same = [g for g in decode if g[1] == where]
            page = next((s.rsplit("-p", 1)[1] for s, _ in same[0][2] if "-p" in s), "64")
            print(f"<!-- {where} -->")
            print(markdown(same, f"decode, page {page}", "FlashMLA") + "\n")
        for g in groups:
            if g[0] in ("prefill", "serve"):
                print(f"<!-- {g[1]} -->")
                title = "prefill causal 192/128" if g[0] == "prefill" else "serving, decode tok/s"
                print(markdown([(g[0], g[1], g[2], g[3])], title, g[4]) + "\n")
        for g in groups:
            commit, gpu = newest(g[5], args.commit, args.gpu)
            host = host_table(g[5], OPS[g[0]][0], g[6], commit, gpu)
            if host:
                print(f"<!-- {gpu}, {commit}, host -->")
                print(host + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
