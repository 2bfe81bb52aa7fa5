"""No JIT compile after the warm-up, on a GPU (a GPU suite: skipped without CUDA, a failure
under ``MLA_REQUIRE_GPU=1``; ``TRITON_INTERPRET=0``): three engines (nvfp4 on read, nvfp4
shadow, none) warmed under ``compile_only``, then a sweep of batch sizes, sequence
lengths, prefill shapes and cache writes launched for real compiles nothing new
(Triton's in-memory caches keep their size), not even a split count outside the
policy's set (the count is a runtime argument). The CPU part (the warm-up's keys
against a sweep's): test_warmup.py.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from test_warmup import HEADS, NVFP4, RANK, ROPE, SCALE, make_engine, sweep, warm

from mla_triton import decode
from mla_triton.precompile import compile_only, compiled_variants

_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def _total() -> int:
    return sum(compiled_variants().values())


@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU and compiled kernels (TRITON_INTERPRET=0)")
def test_nothing_compiles_after_warmup_gpu() -> None:
    """Warm three engines (nvfp4 on read, nvfp4 shadow, none), then serve a sweep."""
    engines = [
        make_engine(
            quant,
            shadow,
            blocks=1001,
            width=69,
            max_rows=64,
            max_seq_len=4352,
            dtype=torch.bfloat16,
            device="cuda",
        )
        for quant, shadow in ((NVFP4, False), (NVFP4, True), (None, False))
    ]
    start = time.perf_counter()
    with compile_only():
        for engine in engines:
            warm(engine)
    seconds = time.perf_counter() - start
    before = compiled_variants()
    rng = random.Random(0)
    for engine in engines:
        sweep(engine, rng)
    torch.cuda.synchronize()
    after = compiled_variants()
    new = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    print(f"warmup: {sum(before.values())} variants in {seconds:.1f} s; new after sweep: {new}")
    assert not new, f"compiled during the sweep: {new}"
    # not even a split count beyond the policy's (4352 // 256 = 17): a runtime argument
    engine = engines[0]
    q = torch.zeros(1, HEADS, RANK + ROPE, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(1, engine.width, dtype=torch.int32, device="cuda")
    lens = torch.ones(1, dtype=torch.int32, device="cuda")
    decode(q, engine.raw, table, lens, softmax_scale=SCALE, quant=NVFP4, num_splits=40)
    torch.cuda.synchronize()
    assert _total() == sum(after.values()), compiled_variants()
