"""Plot the recorded H200 benchmark results for docs/benchmarks.md.

Usage: ``python docs/scripts/plot_benchmarks.py`` from the repository root (needs
matplotlib). Reads the JSON that ``packages/mla-triton/benchmarks/{decode,prefill}.py``
wrote into ``packages/mla-triton/benchmarks/results/`` and writes
``docs/img/bench-decode.png`` and ``docs/img/bench-prefill.png``: TFLOP/s per shape
and recipe, with the ceiling measured in the same run as a dashed line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "packages" / "mla-triton" / "benchmarks" / "results"
IMG = ROOT / "docs" / "img"


def _grouped_bars(
    rows: list[dict[str, Any]], recipes: list[str], ceiling: float, title: str, path: Path
) -> None:
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    width = 0.8 / len(recipes)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, recipe in enumerate(recipes):
        values = []
        for shape in shapes:
            match = [r["tflops"] for r in rows if r["shape"] == shape and r["recipe"] == recipe]
            values.append(match[0] if match else 0.0)
        xs = [s + (i - (len(recipes) - 1) / 2) * width for s in range(len(shapes))]
        ax.bar(xs, values, width=width, label=recipe)
    ax.axhline(ceiling, color="grey", linestyle="--", linewidth=1)
    ax.annotate(f"bf16 matmul ceiling {ceiling:.0f}", (len(shapes) - 0.6, ceiling), va="bottom")
    ax.set_xticks(range(len(shapes)), shapes)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    decode = json.loads((RESULTS / "decode-sweep.json").read_text())
    rows = [r for r in decode["rows"] if r.get("default_config")]
    seen: set[tuple[str, str]] = set()
    unique = []
    for r in rows:  # the first default-configuration row of each (shape, recipe)
        if (r["shape"], r["recipe"]) not in seen:
            seen.add((r["shape"], r["recipe"]))
            unique.append(r)
    _grouped_bars(
        unique,
        ["none", "fp8", "nvfp4"],
        decode["ceilings"]["bf16_matmul_TFLOPs"],
        "mla_triton.decode on H200 (on-read QDQ), FlashMLA FLOP counting",
        IMG / "bench-decode.png",
    )
    prefill = json.loads((RESULTS / "prefill-h200.json").read_text())
    _grouped_bars(
        prefill["rows"],
        ["sdpa-flash", "none", "fp8", "nvfp4", "nvfp4+2:4"],
        prefill["ceilings"]["bf16_matmul_tflops"],
        "mla_triton.prefill on H200, causal 192/128",
        IMG / "bench-prefill.png",
    )


if __name__ == "__main__":
    main()
