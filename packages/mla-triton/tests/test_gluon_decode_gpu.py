"""The Gluon sm90 split decode on a GPU (a GPU suite: skipped without an sm90 GPU, a
failure under ``MLA_REQUIRE_GPU=1``).

bf16 against ``mla_reference.decode`` (float64) with the bounds of test_decode_gpu.py
(P not quantized is rounded to bf16 for the dot: rows 1.5e-2; P quantized: exact
products, rows 4e-3 but for at most 2% of the rows (a P code next to a rounding
midpoint may flip), each below 0.5; LSE 2e-5) and against the Triton kernel (the same
algorithm, a different summation order), with test_decode_gpu.py's inputs, CPU oracle
and checks. The CPU part (compiles, dispatch, launch arguments): test_gluon_decode.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from calls import decode  # the public calls, ``impl``/``config`` forced
from test_gluon_decode import SCALE
from test_shadow import RECIPES as SHADOW_RECIPES

from mla_formats import AttentionQuant
from mla_triton.ops.decode.gluon import (
    SEPARATE_V_CONFIG,
    VARIANTS,
    GluonDecodeConfig,
)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


gpu = pytest.mark.skipif(not _sm90(), reason="GPU suite: needs an sm90 CUDA GPU")
GPU_RECIPES = {
    "none": None,
    "fp8": AttentionQuant.uniform("fp8"),
    "kv8": AttentionQuant(k="fp8", v="fp8"),
}


@gpu
@pytest.mark.parametrize("recipe", list(GPU_RECIPES))
@pytest.mark.parametrize("config", VARIANTS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    ("lens", "heads", "page", "splits"),
    [
        ([1, 15, 64, 65, 1000, 4097], 128, 64, 1),
        ([0, 17, 300, 2049], 128, 64, 3),
        ([33, 1000, 8191], 16, 64, 4),
        ([15, 16, 300, 2049], 20, 16, 3),
    ],
)
def test_matches_reference(
    recipe: str, config: GluonDecodeConfig, lens: list[int], heads: int, page: int, splits: int
) -> None:
    """Against the oracle (test_decode_gpu's inputs, CPU oracle and bounds) and against
    the Triton kernel with the same bounds."""
    from test_decode_gpu import check, make_inputs, reference

    quant = GPU_RECIPES[recipe]
    q, cache, table, seq = make_inputs(lens, heads, page, seed=len(lens) + heads)
    out, lse = decode(
        q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=splits, config=config
    )
    check(out, lse, *reference(q, cache, table, seq, quant), quant)
    tri, tlse = decode(
        q, cache, table, seq, softmax_scale=SCALE, quant=quant, num_splits=splits, impl="triton"
    )
    check(out, lse, tri, tlse, quant)


ON_READ_RECIPES = {
    "nvfp4": (AttentionQuant.uniform("nvfp4"), SEPARATE_V_CONFIG),
    # nvfp4 V with a scale that is not a power of two (the exact division), fp8 K (5.0)
    "calibrated": (SHADOW_RECIPES["calibrated"][0], SEPARATE_V_CONFIG),
    "v-nvfp4": (AttentionQuant(v="nvfp4", p="fp8"), SEPARATE_V_CONFIG),
    "qp-nvfp4": (AttentionQuant(q="nvfp4", p="nvfp4"), VARIANTS[0]),
}


@gpu
@pytest.mark.parametrize("recipe", list(ON_READ_RECIPES))
@pytest.mark.parametrize(
    ("lens", "heads", "page", "splits"),
    [([1, 15, 64, 65, 1000, 4097], 128, 64, 1), ([0, 17, 300, 2049], 128, 16, 3),
     ([33, 1000, 8191], 16, 64, 4)],
)  # fmt: skip
def test_on_read_recipes_match_reference(
    recipe: str, lens: list[int], heads: int, page: int, splits: int
) -> None:
    """The on-read recipes of V̂ in its own tiles and nvfp4 q and P, forced to ``"gluon"`` (nvfp4
    K̂ in place and V̂ in its own ring, scales that are not powers of two, nvfp4 q and P)
    against the oracle and ``impl="triton"`` with test_decode_gpu's bounds."""
    from test_decode_gpu import check, make_inputs, reference

    quant, config = ON_READ_RECIPES[recipe]
    q, cache, table, seq = make_inputs(lens, heads, page, seed=len(lens) + heads)
    kw: dict[str, Any] = {"softmax_scale": SCALE, "quant": quant, "num_splits": splits}
    out, lse = decode(q, cache, table, seq, config=config, **kw)
    check(out, lse, *reference(q, cache, table, seq, quant), quant)
    tri, tlse = decode(q, cache, table, seq, impl="triton", **kw)
    check(out, lse, tri, tlse, quant)
