"""GPU suite of replayed calls (``common.replay``): compiled kernels, launched directly.

Skipped without a CUDA GPU. On a GPU, a plan's first replay launches through each
kernel's ``run`` and keeps the compiled kernels; later replays launch them directly with
``Pointer`` arguments. Each case here checks that those direct launches compute, bit for
bit, what the full call computes on the same tensors (bf16, the default dispatch), and
that the direct path was taken.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import mla_triton
from mla_formats import AttentionQuant
from mla_triton.common.device import GLUON_TRITON, triton_release
from mla_triton.common.replay import REPLAY

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled kernels, bf16)"
)

SCALE = 192**-0.5
FP8 = AttentionQuant.uniform("fp8")
NVFP4 = AttentionQuant.uniform("nvfp4")
PAGE = 64
CASES = [
    ("decode", 128, None, ""), ("decode", 128, FP8, ""), ("decode", 16, NVFP4, ""),
    ("decode", 128, NVFP4, ""), ("shadow", 128, FP8, "fp16"), ("shadow", 128, NVFP4, "fp16"),
    ("shadow", 128, NVFP4, "packed"), ("shadow", 16, NVFP4, "fp16"),
    ("prefill", 128, None, ""), ("prefill", 128, FP8, ""), ("prefill", 16, NVFP4, ""),
]  # fmt: skip


def _case(
    op: str, heads: int, quant: AttentionQuant | None, storage: str, seed: int
) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A decode step of 6 requests (lengths across pages and 16-token blocks) on new
    tensors; prefill: 4 sequences (1 to 700 tokens) with vouched bounds, and its LSE."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf16 = "cuda", torch.bfloat16
    if op == "prefill":
        cu = torch.tensor([0, 1, 130, 830, 1024], dtype=torch.int32, device=dev)
        qp, kp = (torch.randn(1024, heads, 192, dtype=bf16, device=dev, generator=gen)
                  for _ in range(2))  # fmt: skip
        vp = torch.randn(1024, heads, 128, dtype=bf16, device=dev, generator=gen)
        return lambda: mla_triton.prefill(qp, kp, vp, cu, cu, softmax_scale=SCALE, quant=quant,
                                          return_lse=True, max_seqlen_q=700,
                                          max_seqlen_k=700)  # fmt: skip
    lens = torch.tensor([1, 17, 64, 300, 511, 1000], dtype=torch.int32, device=dev)
    width = 16  # pages a row: 1024 tokens
    blocks = 6 * width
    q = torch.randn(6, heads, 576, dtype=bf16, device=dev, generator=gen)
    cache = torch.empty(blocks, PAGE, 576, dtype=bf16, device=dev)
    table = torch.randperm(blocks, dtype=torch.int32, device=dev, generator=gen).view(6, width)
    ws = torch.empty(mla_triton.decode_workspace_size(6, heads, width * PAGE), dtype=torch.uint8,
                     device=dev)  # fmt: skip
    out = torch.empty(6, heads, 512, dtype=bf16, device=dev)
    lse = torch.empty(6, heads, device=dev)
    common: dict[str, Any] = {
        "softmax_scale": SCALE, "quant": quant, "workspace": ws, "out": out, "lse": lse,
        "max_seq_len": width * PAGE, "check_values": False,
    }  # fmt: skip
    if op == "decode":
        cache.normal_(generator=gen)
        return lambda: mla_triton.decode(q, cache, table, lens, **common)
    assert quant is not None
    shadow = mla_triton.allocate_shadow(blocks, PAGE, quant, storage=storage, device=dev)
    tokens = blocks * PAGE
    kv_c = torch.randn(tokens, 512, dtype=bf16, device=dev, generator=gen)
    k_pe = torch.randn(tokens, 64, dtype=bf16, device=dev, generator=gen)
    slots = torch.arange(tokens, dtype=torch.int64, device=dev)
    mla_triton.update_cache(kv_c, k_pe, cache, slots, shadow, quant=quant, storage=storage)
    return lambda: mla_triton.decode_shadow(q, cache, shadow, table, lens, storage=storage,
                                            **common)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c)[:48])
def test_direct_launches_compute_the_full_call(case: tuple[Any, ...]) -> None:
    """The fourth call of a key replays through ``run``, the fifth launches directly;
    its output and LSE equal the full call's bit for bit (the same kernels, grid and
    split count, so the same summation order; prefill: the same kernels and grids)."""
    REPLAY.clear()
    first = _case(*case, seed=1)
    for _ in range(4):  # seen, recorded, recorded (a plan), replayed through run
        first()
    call = _case(*case, seed=2)  # other tensors, the same metadata
    out, lse = (t.clone() for t in call())
    op = "decode_shadow" if case[0] == "shadow" else case[0]  # (the shadow's update_cache
    (plan,) = (e for key, (e, _) in REPLAY._plans.items() if key[0][0][1] == op)  # has its own)
    if triton_release() == GLUON_TRITON:  # direct launches: on the tested Triton release
        assert plan.compiled, "the replay did not launch the compiled kernels directly"
    torch.cuda.synchronize()
    REPLAY.clear()
    ref_out, ref_lse = call()
    torch.cuda.synchronize()
    assert torch.isfinite(ref_out).all()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not torch.equal(out, first()[0])  # the replay read the new tensors


@pytest.mark.parametrize(
    ("quant", "storage"), [(FP8, "fp16"), (NVFP4, "fp16"), (NVFP4, "packed")],
    ids=["fp8-fp16", "nvfp4-fp16", "nvfp4-packed"],
)  # fmt: skip
def test_direct_update_cache_writes_what_the_full_call_writes(
    quant: AttentionQuant, storage: str
) -> None:
    """``update_cache`` of decode steps (8 tokens, each completing or opening 16-token
    blocks), replayed with direct launches, writes the raw cache and the shadow bit for
    bit as the full calls do."""
    REPLAY.clear()
    dev, bf16 = "cuda", torch.bfloat16
    caches = [torch.zeros(16, PAGE, 576, dtype=bf16, device=dev) for _ in range(2)]
    shadows = [mla_triton.allocate_shadow(16, PAGE, quant, storage=storage, device=dev)
               for _ in range(2)]  # fmt: skip
    gen = torch.Generator(device=dev).manual_seed(3)
    steps = []
    for step in range(24):  # request r writes position ``step`` of its page: slot r * 128 + step
        kv_c = torch.randn(8, 512, dtype=bf16, device=dev, generator=gen)
        k_pe = torch.randn(8, 64, dtype=bf16, device=dev, generator=gen)
        steps.append((kv_c, k_pe, torch.arange(8, device=dev) * 2 * PAGE + step))
    for kv_c, k_pe, slots in steps:  # replayed from the fourth step on
        mla_triton.update_cache(kv_c, k_pe, caches[0], slots, shadows[0], quant=quant,
                                storage=storage)  # fmt: skip
    (plan,) = (entry for entry, _ in REPLAY._plans.values())
    if triton_release() == GLUON_TRITON:
        assert plan.compiled, "the replay did not launch the compiled kernels directly"
    for kv_c, k_pe, slots in steps:  # values checked on the host: every call in full
        mla_triton.update_cache(kv_c, k_pe, caches[1], slots, shadows[1], quant=quant,
                                storage=storage, check_values=True)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(caches[0], caches[1])
    assert torch.equal(shadows[0], shadows[1])
