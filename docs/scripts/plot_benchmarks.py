"""Draw the charts of docs/benchmarks.md from ``measured.py``, one per op.

Usage: ``python docs/scripts/plot_benchmarks.py [--out docs/img/benchmarks]`` (needs
matplotlib). Writes ``decode.png``, ``shadow.png``, ``prefill.png`` and ``serve.png``,
the names the benchmark harness's own plot script gives them. Once the harness's CSVs
hold the rows of the code being documented, draw the charts and print the tables from
them instead: ``python packages/mla-triton/benchmarks/plot.py --out
docs/img/benchmarks`` (and ``--markdown`` for the tables).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).parent))
import measured


def chart(path: Path, title: str, ylabel: str, groups: dict, keys: tuple[str, ...]) -> None:
    """Bars of each key's ratio per group (shape), a dashed line at the anchor's 1.0."""
    fig, ax = plt.subplots(figsize=(9, 3.8))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        xs, ys = [], []
        for g, values in enumerate(groups.values()):
            if values.get(key) is not None:
                xs.append(g + (i - (len(keys) - 1) / 2) * width)
                ys.append(values[key])
        ax.bar(xs, ys, width, label=key)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylim(0, 1.25)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncols=2)
    ax.set_title(f"{title} ({measured.GPU}, {measured.VERSIONS})", fontsize=10)
    ax.set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default="docs/img/benchmarks", help="folder of the PNGs")
    out = Path(parser.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    decode = {shape: ratios for shape, (_, ratios) in measured.DECODE.items()}
    chart(out / "decode.png", "decode on read, ratio to FlashMLA bf16",
          "speed / FlashMLA", decode, measured.DECODE_PATHS)  # fmt: skip
    chart(out / "shadow.png", "decode through the shadow, ratio to FlashMLA bf16",
          "speed / FlashMLA", decode, measured.SHADOW_PATHS)  # fmt: skip
    chart(out / "prefill.png", "prefill causal 192/128, ratio to FA3 bf16",
          "speed / FA3", measured.PREFILL, measured.PREFILL_RECIPES)  # fmt: skip
    chart(out / "serve.png", "vLLM serving, decode tokens/s over FLASHMLA's engine",
          "tokens/s / FLASHMLA", measured.SERVING, measured.SERVING_CONFIGS)  # fmt: skip


if __name__ == "__main__":
    main()
