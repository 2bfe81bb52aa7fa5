"""The host (Python) time of an eager ``decode``, ``decode_shadow`` or ``prefill`` call,
on a CPU, as on an H200: dispatch as on sm90, Triton's own launch path (argument binding, cache key,
the compiled kernel's runner), compiles replaced by a launcher that does nothing. Times
the full call (no replay plan), a replayed call through each
kernel's ``run``, and a replayed call with direct launches (``common.replay``), each the
best of five rounds. What a GPU adds on top: the CUDA launches themselves. Run from the
repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-triton/src \\
        python packages/mla-triton/tools/host_time.py
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels' launch path, before Triton loads

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

import mla_triton
from mla_formats import AttentionQuant
from mla_triton.common import device as dev
from mla_triton.common import replay
from mla_triton.ops.decode import gluon as gd

FP8, NVFP4 = AttentionQuant.uniform("fp8"), AttentionQuant.uniform("nvfp4")
CASES: dict[str, tuple[str, int, AttentionQuant | None, str]] = {
    "decode none h128": ("decode", 128, None, ""),
    "decode fp8 h128": ("decode", 128, FP8, ""),
    "decode nvfp4 h16": ("decode", 16, NVFP4, ""),
    "shadow fp8 h128": ("shadow", 128, FP8, "fp16"),
    "shadow nvfp4 h128 packed": ("shadow", 128, NVFP4, "packed"),
    "prefill none h128": ("prefill", 128, None, ""),
    "prefill fp8 h128": ("prefill", 128, FP8, ""),
    "prefill nvfp4 h128": ("prefill", 128, NVFP4, ""),
}


class _Driver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class _Compiled:
    """A compiled kernel launched as Triton launches one, whose launcher does nothing."""

    __getitem__ = CompiledKernel.__getitem__
    launch_metadata = CompiledKernel.launch_metadata

    def __init__(self, name: str) -> None:
        self.name, self.function, self.packed_metadata, self.src = name, 0, (), None

    def _init_handles(self) -> None:
        pass

    def run(self, *args: Any) -> None:
        pass


def _as_h200() -> None:
    real = gd.gluon_facts
    gd.gluon_facts = lambda *a: replace(  # type: ignore[assignment]
        real(*a), device_type="cuda", capability=(9, 0), interpreting=False, api_missing=None
    )
    dev.capability = lambda device: (9, 0)  # type: ignore[assignment]
    driver._active = _Driver()  # type: ignore[assignment]

    def compile_nothing(self: Any, key: Any, signature: Any, device: Any, *rest: Any) -> Any:
        compiled = _Compiled(self.fn.__name__)
        self.device_caches[device][0][key] = compiled
        return compiled

    JITFunction._do_compile = compile_nothing  # type: ignore[method-assign]


def _call(
    op: str, heads: int, quant: AttentionQuant | None, storage: str, batch: int
) -> Callable[[], Any]:
    dt = torch.bfloat16
    q = torch.randn(batch, heads, 576, dtype=dt)
    cache = torch.randn(batch * 64, 64, 576, dtype=dt)
    table = torch.arange(batch * 64, dtype=torch.int32).reshape(batch, 64)
    lens = torch.full((batch,), 500, dtype=torch.int32)
    ws = torch.empty(mla_triton.decode_workspace_size(batch, heads, 4096), dtype=torch.uint8)
    out, lse = torch.empty(batch, heads, 512, dtype=dt), torch.empty(batch, heads)
    common: dict[str, Any] = {
        "softmax_scale": 0.1, "quant": quant, "workspace": ws, "out": out, "lse": lse,
        "max_seq_len": 4096, "check_values": False,
    }  # fmt: skip
    if op == "decode":
        return lambda: mla_triton.decode(q, cache, table, lens, **common)
    if op == "prefill":  # batch sequences of 128 tokens, DeepSeek's head dims 192 and 128
        os.environ["TRITON_INTERPRET"] = "1"  # its checks take CPU tensors (kernels compiled)
        tokens = batch * 128
        qp, kp = (torch.randn(tokens, heads, 192, dtype=dt) for _ in range(2))
        vp = torch.randn(tokens, heads, 128, dtype=dt)
        cu = torch.arange(0, tokens + 1, 128, dtype=torch.int32)
        return lambda: mla_triton.prefill(qp, kp, vp, cu, cu, softmax_scale=0.1, quant=quant,
                                          max_seqlen_q=128, max_seqlen_k=128)  # fmt: skip
    shadow = mla_triton.allocate_shadow(cache.shape[0], 64, quant, storage=storage)
    return lambda: mla_triton.decode_shadow(q, cache, shadow, table, lens, storage=storage,
                                            **common)  # fmt: skip


def _best(f: Callable[[], Any], n: int) -> float:
    for _ in range(20):
        f()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--calls", type=int, default=300, help="calls a round")
    args = parser.parse_args()
    _as_h200()
    adopt = replay._Plan.adopt
    print(f"{'case':26s} {'full':>9s} {'replay, run':>12s} {'replay, direct':>15s}  (µs a call)")
    for name, case in CASES.items():
        f = _call(*case, batch=args.batch)

        def full(f: Callable[[], Any] = f) -> None:
            replay.REPLAY.clear()
            f()

        t_full = _best(full, max(args.calls // 4, 1))
        replay.REPLAY.clear()
        replay._Plan.adopt = lambda self, compiled: None  # type: ignore[method-assign]
        t_run = _best(f, args.calls)
        replay.REPLAY.clear()
        replay._Plan.adopt = adopt  # type: ignore[method-assign]
        t_direct = _best(f, args.calls)
        print(f"{name:26s} {t_full:9.1f} {t_run:12.1f} {t_direct:15.1f}")


if __name__ == "__main__":
    main()
