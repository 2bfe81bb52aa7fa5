"""The measured numbers of the documentation's charts that no benchmark CSV holds.

``ACCURACY``: the relative L2 error of the attention output per recipe, which
``plot_home.py`` draws against the speed. Speed numbers are not kept here: the
benchmark harnesses append their rows to
``packages/mla-triton/benchmarks/results/{decode,shadow,prefill}.csv`` and
``packages/mla-vllm/benchmarks/results/serve.csv``, and the charts and tables are drawn
from those rows (``packages/mla-triton/benchmarks/plot.py``, ``plot_home.py``).
"""

from __future__ import annotations

# accuracy: mla-report's GPU case on the H200 (128 heads, decode 32 x 4096 tokens,
# prefill 2 x 2048, bf16, seeded normals with outlier channels): relative L2 error of
# the attention output against recipe none. {recipe: (decode, prefill)}
ACCURACY: dict[str, tuple[float, float]] = {
    "none": (0.0, 0.0),
    "fp8": (0.0527, 0.0833),
    "nvfp4-kv": (0.1259, 0.2030),
    "nvfp4": (0.1934, 0.2561),
    "nvfp4+2:4": (0.1934, 0.2694),
}
