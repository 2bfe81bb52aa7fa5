"""Draw the home page's picture: accuracy cost against speed of each recipe.

Usage: ``python docs/scripts/plot_home.py [docs/img/recipes.png] [--gpu "NVIDIA H200"]``
(needs matplotlib). The error is the relative L2 error of the attention output
(mla-report's GPU case, ``ACCURACY`` in ``measured.py`` beside this script); the speed is
the ratio to FlashMLA (decode, b128 h128 L8192: on read and through the shadow) or
FlashAttention-3 (prefill, b4 h128 L4096), bf16, read from the benchmark CSVs under
``packages/mla-triton/benchmarks/results/`` through that folder's ``plot.py``: per op
the newest commit's rows on one GPU (``--gpu``; default: the GPU of the newest decode
rows). A ratio the CSVs lack stops the script with the row it needs; nothing is drawn.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCH = HERE.parents[1] / "packages" / "mla-triton" / "benchmarks"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(BENCH))
import measured  # noqa: E402
import plot  # noqa: E402

DECODE_SHAPE = "b128-h128-L8192"
PREFILL_SHAPE = "b4-h128-L4096"
OFFSET = {"textcoords": "offset points", "fontsize": 8}

# (label, accuracy recipe, benchmark CSV, its recipe, marker)
DECODE_POINTS = (
    ("none", "none", "decode", "none", "o"),
    ("fp8, on read", "fp8", "decode", "fp8", "s"),
    ("fp8, shadow", "fp8", "shadow", "fp8-fp16", "D"),
    ("nvfp4, on read", "nvfp4", "decode", "nvfp4", "s"),
    ("nvfp4, shadow fp16", "nvfp4", "shadow", "nvfp4-fp16", "D"),
    ("nvfp4, shadow packed", "nvfp4", "shadow", "nvfp4-packed", "^"),
)
PREFILL_POINTS = (
    ("none", "none", "none"),
    ("fp8", "fp8", "fp8"),
    ("nvfp4", "nvfp4", "nvfp4"),
    ("nvfp4 + 2:4", "nvfp4+2:4", "nvfp4+2:4"),
)


def speeds(
    gpu: str | None = None, results: Path = plot.RESULTS
) -> tuple[str, dict[tuple[str, str], float], str]:
    """``(gpu, {(csv stem, recipe): ratio}, versions)`` of the chart's points: of ``auto``
    against the anchor, in each op's default mode, the newest commit's rows on ``gpu``
    (default: the GPU of the newest decode rows). Raises ``SystemExit`` naming the
    missing row where a CSV lacks one."""
    shape = {"decode": DECODE_SHAPE, "shadow": DECODE_SHAPE, "prefill": PREFILL_SHAPE}
    needed = [(stem, recipe) for _, _, stem, recipe, _ in DECODE_POINTS]
    needed += [("prefill", recipe) for _, _, recipe in PREFILL_POINTS]
    ratios: dict[tuple[str, str], float] = {}
    versions: dict[str, None] = {}
    try:
        gpu = gpu or plot.newest_rows("decode", results=results)[1]
        found = {stem: plot.newest_rows(stem, gpu, results=results) for stem in shape}
    except LookupError as e:
        raise SystemExit(f"plot_home.py: {e}: run its harness on that GPU, or pass --gpu") from e
    for stem, recipe in needed:
        commit, _, rows = found[stem]
        row = rows.get((shape[stem], recipe))
        if row is None or not row["ratio"]:
            raise SystemExit(
                f"plot_home.py: {results / (stem + '.csv')} has no ratio of impl auto for "
                f"{shape[stem]} recipe {recipe} ({plot.OPS[stem][1]} mode) in the rows of "
                f"commit {commit} on {gpu}: run benchmarks/{stem}.py on that GPU (or pass "
                "--gpu)"
            )
        ratios[(stem, recipe)] = float(row["ratio"])
        versions[f"torch {row['torch']}, Triton {row['triton']}, vLLM {row['vllm']}"] = None
    for stem, (commit, _, _) in found.items():
        print(f"plot_home.py: {stem} from commit {commit} on {gpu}")
    return gpu, ratios, "; ".join(versions)


def main(path: str, gpu: str | None = None) -> None:
    gpu, speed, versions = speeds(gpu)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    for label, recipe, stem, key, marker in DECODE_POINTS:
        x, y = measured.ACCURACY[recipe][0], speed[(stem, key)]
        left.scatter(x, y, s=60, marker=marker, label=label)
        left.annotate(label, (x, y), xytext=(6, 4), **OFFSET)
    left.set_title(f"decode, {DECODE_SHAPE.replace('-', ' ')}")
    left.set_xlabel("attention output error (relative L2, lower is better)")
    left.set_ylabel("speed relative to bf16 (FlashMLA / FA3)")
    for label, recipe, key in PREFILL_POINTS:
        x, y = measured.ACCURACY[recipe][1], speed[("prefill", key)]
        right.scatter(x, y, s=60)
        right.annotate(label, (x, y), xytext=(6, 4), **OFFSET)
    right.set_title(f"prefill (causal 192/128), {PREFILL_SHAPE.replace('-', ' ')}")
    right.set_xlabel("attention output error (relative L2, lower is better)")
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlim(-0.02, 0.34)
        ax.set_ylim(0.0, 1.2)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Accuracy cost and speed of each recipe ({gpu}, {versions})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("path", nargs="?", default="docs/img/recipes.png")
    parser.add_argument("--gpu", default=None, help="default: the newest decode rows' GPU")
    args = parser.parse_args()
    main(args.path, args.gpu)
