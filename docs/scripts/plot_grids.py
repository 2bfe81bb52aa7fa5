"""Draw the E2M1 and E4M3FN value grids for docs/formats.md.

Usage: ``python docs/scripts/plot_grids.py docs/img/grids.png`` (needs torch and
matplotlib). The E4M3 values are every finite non-negative byte pattern of
``torch.float8_e4m3fn``; the E2M1 values are the eight non-negative codes.
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch


def main(path: str) -> None:
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.2))
    top.vlines(e2m1.tolist(), 0, 1, color="tab:blue")
    for value in e2m1.tolist():
        top.annotate(f"{value:g}", (value, 1.02), ha="center", fontsize=8)
    top.set_title("E2M1 (NVFP4 element): 8 magnitudes, ties to even, saturates at 6")
    top.set_yticks([])
    top.set_xlim(-0.2, 6.4)
    positive = e4m3[e4m3 > 0]
    subnormal = positive < 2.0**-6
    bottom.vlines(
        positive[~subnormal].tolist(), 0, 1, color="tab:orange", linewidth=0.7, label="normal"
    )
    bottom.vlines(
        positive[subnormal].tolist(),
        0,
        1,
        color="tab:red",
        linewidth=0.7,
        label="subnormal (step 2^-9)",
    )
    bottom.set_xscale("log", base=2)
    bottom.set_title("E4M3FN (FP8 values, NVFP4 block scales): 126 positive values, 2^-9 to 448")
    bottom.set_yticks([])
    bottom.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/grids.png")
