"""How many kernel variants ``mla_triton.warmup`` compiles per recipe: compile keys, no GPU.

Counts, with ``record_keys`` (Triton's keys for sm_90, nothing launched), the keys of
the warm-up of one engine with 128 heads (DeepSeek-V3 at TP 1), 64-token pages, up to
``--rows`` decode rows, per ``max_model_len`` and recipe, by kernel. Run from the
repository root (CPU is fine)::

    TRITON_INTERPRET=1 PYTHONPATH=packages/mla-formats/src:packages/mla-triton/src \\
        python packages/mla-triton/tools/warmup_keys.py --contexts 4352,33024
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from mla_formats import AttentionQuant
from mla_triton.ops.shadow import shadow_layout
from mla_triton.precompile import record_keys, warmup_decode, warmup_prefill, warmup_update_cache

RECIPES = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "nvfp4kv": AttentionQuant(k="nvfp4", v="nvfp4"),
}


def count(context: int, quant: AttentionQuant | None, shadow: bool, rows: int) -> Counter[str]:
    """Compile keys of one engine's warm-up, by kernel name."""
    page, width = 64, -(-context // 64)
    extra = shadow_layout(quant).token_bytes if shadow and quant is not None else 0
    cache = torch.zeros(37, page, 576 + extra // 2, dtype=torch.float16)
    raw = cache[..., :576]
    sh = cache[..., 576:].view(torch.uint8)[..., :extra] if extra else None
    with record_keys() as keys:
        warmup_decode(raw, num_heads=128, pages_per_row=width, max_rows=rows,
                      max_seq_len=context, softmax_scale=0.07, quant=quant, shadow=sh)  # fmt: skip
        if sh is not None and quant is not None:
            warmup_update_cache(raw, sh, quant=quant)
        warmup_prefill(num_heads=128, head_dim_qk=192, head_dim_v=128, dtype=torch.float16,
                       device=torch.device("cpu"), softmax_scale=0.07, quant=quant)  # fmt: skip
    return Counter(name.rsplit(".", 1)[1] for name, _ in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--contexts", default="4352,33024", help="max_model_len values")
    parser.add_argument("--rows", type=int, default=64, help="max decode rows")
    args = parser.parse_args()
    for context in (int(c) for c in args.contexts.split(",")):
        for name, quant in RECIPES.items():
            for shadow in (False, True) if quant is not None else (False,):
                counts = count(context, quant, shadow, args.rows)
                label = f"{name}{'-shadow' if shadow else ''}"
                detail = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
                print(f"max_model_len {context:6d} {label:15s} {sum(counts.values()):4d}: {detail}")


if __name__ == "__main__":
    main()
