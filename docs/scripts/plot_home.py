"""Draw the home page's picture: accuracy cost against speed of each recipe.

Usage: ``python docs/scripts/plot_home.py docs/img/recipes.png`` (needs matplotlib).
The numbers come from ``measured.py`` beside this script: the relative L2 error of
the attention output (mla-report's GPU case) and the speed relative to FlashMLA
(decode, b128 h128 L8192) or FlashAttention-3 (prefill, b4 h128 L4096), bf16, H200.
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).parent))
import measured

DECODE_SHAPE = "b128 h128 L8192"
PREFILL_SHAPE = "b4 h128 L4096"
OFFSET = {"textcoords": "offset points", "fontsize": 8}

# (label, accuracy recipe, decode path, marker)
DECODE_POINTS = (
    ("none", "none", "none", "o"),
    ("fp8, on read", "fp8", "fp8 on read", "s"),
    ("fp8, shadow", "fp8", "fp8 shadow", "D"),
    ("nvfp4, on read", "nvfp4", "nvfp4 on read", "s"),
    ("nvfp4, shadow fp16", "nvfp4", "nvfp4 shadow (fp16)", "D"),
    ("nvfp4, shadow packed", "nvfp4", "nvfp4 shadow (packed)", "^"),
)
PREFILL_POINTS = (
    ("none", "none", "none"),
    ("fp8", "fp8", "fp8"),
    ("nvfp4", "nvfp4", "nvfp4"),
    ("nvfp4 + 2:4", "nvfp4+2:4", "nvfp4+2:4"),
)


def main(path: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    _, decode = measured.DECODE[DECODE_SHAPE]
    for label, recipe, key, marker in DECODE_POINTS:
        x = measured.ACCURACY[recipe][0]
        left.scatter(x, decode[key], s=60, marker=marker, label=label)
        left.annotate(label, (x, decode[key]), xytext=(6, 4), **OFFSET)
    left.set_title(f"decode, {DECODE_SHAPE}")
    left.set_xlabel("attention output error (relative L2, lower is better)")
    left.set_ylabel("speed relative to bf16 (FlashMLA / FA3)")
    prefill = measured.PREFILL[PREFILL_SHAPE]
    for label, recipe, key in PREFILL_POINTS:
        x = measured.ACCURACY[recipe][1]
        right.scatter(x, prefill[key], s=60)
        right.annotate(label, (x, prefill[key]), xytext=(6, 4), **OFFSET)
    right.set_title(f"prefill (causal 192/128), {PREFILL_SHAPE}")
    right.set_xlabel("attention output error (relative L2, lower is better)")
    for ax in (left, right):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlim(-0.02, 0.34)
        ax.set_ylim(0.0, 1.2)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Accuracy cost and speed of each recipe ({measured.GPU}, {measured.VERSIONS})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/img/recipes.png")
