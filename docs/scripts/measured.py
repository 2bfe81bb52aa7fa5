"""The measured numbers the documentation's tables and charts show.

One NVIDIA H200, the vLLM 0.33 bundle (torch 2.14, Triton 3.8); FlashMLA and
FlashAttention-3 bf16 from the vLLM wheel, timed in the same process as the row;
decode timed from CUDA-graph replays, page size 64. The benchmark harnesses append their
rows to ``packages/mla-triton/benchmarks/results/{decode,shadow,prefill}.csv``;
``packages/mla-triton/benchmarks/plot.py --markdown`` prints the tables of the newest
rows, which replace these numbers and the tables of docs/benchmarks.md.
"""

from __future__ import annotations

GPU = "NVIDIA H200"
VERSIONS = "torch 2.14, Triton 3.8, vLLM 0.33"

# decode: shape -> (anchor FlashMLA bf16 in microseconds or None, {path: ratio})
DECODE_PATHS = ("none", "fp8 on read", "nvfp4 on read")
SHADOW_PATHS = ("fp8 shadow", "nvfp4 shadow (fp16)", "nvfp4 shadow (packed)")
DECODE: dict[str, tuple[float | None, dict[str, float]]] = {
    "b128 h128 L8192": (
        552.0,
        {
            "none": 0.96,
            "fp8 on read": 0.54,
            "nvfp4 on read": 0.20,
            "fp8 shadow": 1.01,
            "nvfp4 shadow (fp16)": 0.60,
            "nvfp4 shadow (packed)": 0.12,
        },
    ),
    "b128 h16 L8192": (
        330.0,
        {
            "none": 1.07,
            "fp8 on read": 0.46,
            "nvfp4 on read": 0.13,
            "fp8 shadow": 1.08,
            "nvfp4 shadow (fp16)": 0.60,
            "nvfp4 shadow (packed)": 0.15,
        },
    ),
    "b8 h128 L32768": (
        155.0,
        {
            "none": 1.03,
            "fp8 on read": 0.57,
            "nvfp4 on read": 0.22,
            "fp8 shadow": 1.04,
            "nvfp4 shadow (fp16)": 0.61,
            "nvfp4 shadow (packed)": 0.14,
        },
    ),
    "b32 h128 L32768": (
        None,
        {
            "none": 0.96,
            "fp8 on read": 0.54,
            "nvfp4 on read": 0.19,
            "fp8 shadow": 1.03,
            "nvfp4 shadow (fp16)": 0.60,
            "nvfp4 shadow (packed)": 0.12,
        },
    ),
}

# prefill, causal, head dims 192/128, varlen API: shape -> {recipe: ratio to FA3 bf16}
PREFILL_RECIPES = ("none", "fp8", "nvfp4", "nvfp4+2:4")
PREFILL: dict[str, dict[str, float]] = {
    "b4 h128 L4096": {"none": 0.86, "fp8": 0.74, "nvfp4": 0.54, "nvfp4+2:4": 0.34},
    "b1 h16 L16384": {"none": 0.84, "fp8": 0.81, "nvfp4": 0.56, "nvfp4+2:4": 0.34},
    "b16 h128 L1024": {"none": 0.78, "fp8": 0.43, "nvfp4": 0.37, "nvfp4+2:4": 0.30},
}

# serving: vLLM engine, DeepSeek-V3 attention, 4 dense layers, CUDA graphs; decode
# tokens/s over FLASHMLA's engine in the same run. None: not measured in that run.
SERVING_CONFIGS = ("none", "fp8 on read", "fp8 shadow", "nvfp4 on read", "nvfp4 shadow")
SERVING: dict[str, dict[str, float | None]] = {
    "4k prompts, batch 64": {
        "none": 1.05,
        "fp8 on read": 0.80,
        "fp8 shadow": 0.85,
        "nvfp4 on read": 0.54,
        "nvfp4 shadow": 0.87,
    },
    "32k prompts, batch 16": {
        "none": 0.95,
        "fp8 on read": None,
        "fp8 shadow": 1.00,
        "nvfp4 on read": 0.40,
        "nvfp4 shadow": 0.84,
    },
}

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
