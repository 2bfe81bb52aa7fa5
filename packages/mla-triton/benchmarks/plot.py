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
newest row per shape and recipe. Serving instead shows, per shape, one run: the rows
sharing a date (one serve.py run or one imported result file) of the newest run, by
the same order (``serve_runs``), so that no table row mixes engines of several runs.
Draws ``<op>.png`` into ``--out`` (default: the results folder): bars of the ratio to
the anchor (FlashMLA bf16, FA3 bf16, the FLASHMLA engine). ``--markdown`` prints the
tables instead: decode on read and through the shadow together (one table per GPU and
commit where their newest rows differ), prefill, serving, and the host time per eager
call. ``newest_rows`` gives other scripts (the docs' home chart) the rows of one op.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
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
SERVE_RECIPES = ("none", "fp8", "fp8-fp16", "fp8-packed", "nvfp4", "nvfp4-fp16", "nvfp4-packed")
SERVE_SHAPE = re.compile(r"b(\d+)-L(\d+)-g(\d+)-l(\d+)")


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


def newest_rows(
    stem: str,
    gpu: str | None = None,
    *,
    results: Path = RESULTS,
    impl: str = "auto",
) -> tuple[str, str, dict[tuple[str, str], dict[str, str]]]:
    """What ``main`` shows of one kernel op (``decode``, ``shadow``, ``prefill``):
    ``(commit, gpu, table(...))`` of ``impl`` in the op's mode, the newest commit on
    ``gpu`` (as ``newest``; ``gpu`` None: the newest commit's GPU). Raises
    ``LookupError`` naming what the CSV holds where it has no row of the op on ``gpu``."""
    if stem not in OPS or stem == "serve":
        raise ValueError(f"newest_rows: a kernel op of {[s for s in OPS if s != 'serve']}")
    op, mode = OPS[stem][:2]
    path = results / f"{stem}.csv"
    every = [r for r in read_rows(path) if r["op"] == op]
    rows = [r for r in every if gpu in (None, r["gpu"])]
    if not rows:
        held = sorted({(r["gpu"], r["commit"]) for r in every})
        raise LookupError(f"{path}: no {op} rows" + (f" on {gpu}" if gpu else "")
                          + f"; it holds (gpu, commit): {held or 'nothing'}")  # fmt: skip
    commit, gpu = newest(rows, None, gpu)
    return commit, gpu, table(rows, op, mode, impl, commit, gpu)


def serve_runs(
    rows: Sequence[dict[str, str]], mode: str, impl: str, commit: str | None, gpu: str | None
) -> dict[str, tuple[str, str, str]]:
    """Per shape, the newest serving run holding a row of ``impl`` in ``mode``:
    ``shape -> (commit, gpu, date)``. A run is the rows sharing a date (one serve.py run,
    or the rows imported from one result file); the newest is the commit deepest in git
    history, then the latest date, as ``newest``; ``commit`` and ``gpu`` restrict it."""
    depth: dict[str, int] = {}
    best: dict[str, tuple[tuple[int, str], tuple[str, str, str]]] = {}
    for r in rows:
        if (r["mode"], r["impl"]) != (mode, impl) or commit not in (None, r["commit"]):
            continue
        if gpu not in (None, r["gpu"]):
            continue
        if r["commit"] not in depth:
            depth[r["commit"]] = history_depth(r["commit"])
        key = (depth[r["commit"]], r["date"])
        if r["shape"] not in best or key > best[r["shape"]][0]:
            best[r["shape"]] = (key, (r["commit"], r["gpu"], r["date"]))
    return {shape: run for shape, (_, run) in best.items()}


def serve_table(
    rows: Sequence[dict[str, str]], mode: str, impl: str, anchor: str,
    runs: dict[str, tuple[str, str, str]],
) -> tuple[dict[tuple[str, str], dict[str, str]], dict[str, dict[str, str]]]:  # fmt: skip
    """``(shape, recipe) -> row`` of ``impl`` and ``shape -> row`` of the anchor, each shape
    from its run in ``runs`` only; where a run started one configuration twice (a fresh
    and a restarted engine), its first row in the CSV."""
    got: dict[tuple[str, str], dict[str, str]] = {}
    anchors: dict[str, dict[str, str]] = {}
    for r in rows:
        if runs.get(r["shape"]) != (r["commit"], r["gpu"], r["date"]) or r["mode"] != mode:
            continue
        if r["impl"] == impl:
            got.setdefault((r["shape"], r["recipe"]), r)
        elif r["impl"] == anchor:
            anchors.setdefault(r["shape"], r)
    return got, anchors


def serve_recipes(rows: Sequence[dict[str, str]], mode: str, impl: str) -> list[str]:
    """The serving columns: every recipe of ``impl`` the CSV holds, in ``SERVE_RECIPES``'s
    order (others after them, as they come)."""
    seen = dict.fromkeys(r["recipe"] for r in rows if (r["mode"], r["impl"]) == (mode, impl))
    known = [r for r in SERVE_RECIPES if r in seen]
    return known + [r for r in seen if r not in SERVE_RECIPES]


def ordered(keys: Sequence[tuple[str, str]], i: int) -> list[str]:
    return list(dict.fromkeys(k[i] for k in keys))


def label(stem: str, recipe: str) -> str:
    """A column title: decode's recipes "on read", the shadow's "shadow" (with storage);
    serving's ``fp8`` "fp8 on read", ``fp8-fp16`` "fp8 shadow", ``fp8-packed``
    "fp8 shadow (packed)"."""
    if stem == "decode":
        return recipe if recipe == "none" else f"{recipe} on read"
    if stem == "shadow":
        fmt, _, storage = recipe.partition("-")
        return f"{fmt} shadow" if storage == "fp16" else f"{fmt} {storage} shadow"
    if stem == "serve" and recipe != "none":
        fmt, _, storage = recipe.partition("-")
        if not storage:
            return f"{fmt} on read"
        return f"{fmt} shadow" if storage == "fp16" else f"{fmt} shadow ({storage})"
    return recipe


def shape_label(stem: str, shape: str) -> str:
    """A row title: serving's ``b64-L4096-g256-l4`` in words, other shapes spaced out."""
    m = SERVE_SHAPE.fullmatch(shape) if stem == "serve" else None
    if m is None:
        return shape.replace("-", " ")
    batch, prompt, gen, layers = m.groups()
    return (f"{prompt}-token prompts + {gen} generated, batch {batch}, {layers} "
            + ("layer" if layers == "1" else "layers"))  # fmt: skip


def failed(row: dict[str, str] | None) -> bool:
    """A serving engine that did not run (its row has no time; the notes say why)."""
    return bool(row) and not row["time_us"] and "failed" in row.get("notes", "")


def cell(row: dict[str, str] | None, stem: str = "") -> str:
    if stem == "serve" and failed(row):
        return "failed"
    return f"{float(row['ratio']):.2f}x" if row and row["ratio"] else "-"


def markdown(groups: Sequence[tuple[str, str, dict[tuple[str, str], dict[str, str]], dict]],
             title: str, anchor_label: str,
             recipes: Sequence[str] | None = None) -> str:  # fmt: skip
    """One table: rows are shapes (with the anchor's time), columns every group's recipes
    (or ``recipes``)."""
    shapes = list(dict.fromkeys(k[0] for _, _, t, _ in groups for k in t))
    cols = [(stem, recipe, t) for stem, _, t, _ in groups
            for recipe in (recipes or ordered(list(t), 1))]  # fmt: skip
    lines = [
        f"| {title} | " + " | ".join(label(stem, r) for stem, r, _ in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for shape in shapes:
        anchor = next((a[shape] for _, _, _, a in groups if shape in a), None)
        unit = "tok/s" if anchor and anchor["tok_s"] and not anchor["tflops"] else "µs"
        value = anchor["tok_s"] if unit == "tok/s" else anchor["time_us"] if anchor else ""
        head = shape_label(groups[0][0], shape) + (
            f" ({anchor_label} {float(value):.0f} {unit})" if value else ""
        )
        lines.append(
            f"| {head} | " + " | ".join(cell(t.get((shape, r)), s) for s, r, t in cols) + " |"
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


def plot(stem: str, t: dict[tuple[str, str], dict[str, str]], path: Path, title: str,
         recipes: Sequence[str] | None = None) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes, recipes = ordered(list(t), 0), list(recipes or ordered(list(t), 1))
    width = 0.8 / max(1, len(recipes))
    size = (max(6.0, 1.8 * len(shapes) + 2), 4.2)
    if stem == "serve":  # two-line titles and shape labels
        size = (max(8.0, 3 * len(shapes) + 2), 4.6)
    fig, ax = plt.subplots(figsize=size)
    for i, recipe in enumerate(recipes):
        xs = [j + (i - (len(recipes) - 1) / 2) * width for j in range(len(shapes))]
        ys = [float(t[(s, recipe)]["ratio"] or "nan") if (s, recipe) in t else float("nan")
              for s in shapes]  # fmt: skip
        ax.bar(xs, ys, width, label=label(stem, recipe))
        for x, s in zip(xs, shapes, strict=True):
            if stem == "serve" and failed(t.get((s, recipe))):
                ax.text(x, 0.02, "failed", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    if stem == "serve":
        ticks = [textwrap.fill(shape_label(stem, s), 36) for s in shapes]
        ax.set_xticks(range(len(shapes)), ticks, fontsize=8)
        ax.set_ylabel("decode tok/s / FLASHMLA engine (higher is faster)")
    else:
        ax.set_xticks(range(len(shapes)), [s.replace("-", " ") for s in shapes])
        ax.set_ylabel("ratio to the anchor (higher is faster)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def serve_groups(rows: Sequence[dict[str, str]], args: argparse.Namespace, mode: str,
                 impl: str, groups: list) -> None:  # fmt: skip
    """Serving's table (per shape its newest run) into ``groups``; its PNG unless
    ``--markdown``."""
    _, _, _, anchor, anchor_label = OPS["serve"]
    runs = serve_runs(rows, mode, impl, args.commit, args.gpu)
    t, anchors = serve_table(rows, mode, impl, anchor, runs)
    where = f"serving, {mode}, newest run per shape: " + "; ".join(
        f"{shape} {gpu} {commit} {date}" for shape, (commit, gpu, date) in runs.items()
    )
    groups.append(("serve", where, t, anchors, anchor_label, rows, impl))
    if not args.markdown and t:
        gpus = ", ".join(dict.fromkeys(gpu for _, gpu, _ in runs.values()))
        dates = "; ".join(f"{c} {d[:16].replace('T', ' ')} UTC" for c, _, d in runs.values())
        title = (f"vLLM serving on {gpus}, CUDA {mode}s: decode tok/s of {impl} / the "
                 f"{anchor_label} engine's of the same run\n"
                 f"newest run per shape: {dates}")  # fmt: skip
        recipes = serve_recipes(rows, mode, impl)
        plot("serve", t, (args.out or args.results) / "serve.png", title, recipes)


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
        mode = args.mode or mode
        impl = args.impl if args.impl and stem != "serve" else impl
        if stem == "serve":
            serve_groups(rows, args, mode, impl, groups)
            continue
        commit, gpu = newest(rows, args.commit, args.gpu)
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
                mode = args.mode or OPS["serve"][1]
                recipes = serve_recipes(g[5], mode, g[6]) if g[0] == "serve" else None
                print(markdown([(g[0], g[1], g[2], g[3])], title, g[4], recipes) + "\n")
        for g in groups:
            commit, gpu = newest(g[5], args.commit, args.gpu)
            host = host_table(g[5], OPS[g[0]][0], g[6], commit, gpu)
            if host:
                print(f"<!-- {gpu}, {commit}, host -->")
                print(host + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
