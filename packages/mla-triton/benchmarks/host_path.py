"""Host time of a decode call up to its kernel launches (no GPU: the launches are intercepted).

From the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/host_path.py [--profile NAME] [--json PATH]

Each case of ``CASES`` calls ``decode`` or ``decode_shadow`` on CPU tensors dispatched as
on an H200 (``gluon_facts`` reports sm90, Triton 3.8, no interpreter: the tests' way),
with every ``mla_triton`` launch replaced by a no-op (``warmup._intercept``) and
``check_values=False`` (what GPU callers get by default): what is timed is our Python from
the call to the launches (checks, recipe, dispatch, split policy, workspace, kernel
arguments, TMA descriptors), not Triton's launcher nor the kernels. Prints the best of
nine batches of 50 calls (microseconds a call) per case; ``--profile NAME`` adds
cProfile's cumulative table of 200 calls of one case. Shapes: batch 32, 128 heads, page
64, two splits, float16.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

import mla_triton.gluon_decode as gd
from mla_formats import AttentionQuant, OperandQuant
from mla_triton import allocate_shadow, decode, decode_shadow
from mla_triton.warmup import _intercept

BATCH, HEADS, PAGE, BLOCKS, SCALE = 32, 128, 64, 64, 576**-0.5
FP8_3 = AttentionQuant(q="fp8", k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0), p="fp8")
NVFP4 = AttentionQuant.uniform("nvfp4")
CASE_NAMES = ("none", "fp8-shadow", "nvfp4-shadow", "nvfp4-on-read")


def cases() -> dict[str, Callable[[], Any]]:
    """Name -> a call: recipe none, fp8 and nvfp4 through the fp16 shadow, nvfp4 on read."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, HEADS, 576, generator=g).half()
    cache = torch.randn(BLOCKS, PAGE, 576, generator=g).half()
    table = torch.arange(BLOCKS, dtype=torch.int32).view(BATCH, -1)
    seq = torch.full((BATCH,), 100, dtype=torch.int32)
    kw: dict[str, Any] = {"softmax_scale": SCALE, "num_splits": 2, "check_values": False}
    fp8_shadow, nv_shadow = (
        allocate_shadow(BLOCKS, PAGE, FP8_3),
        allocate_shadow(BLOCKS, PAGE, NVFP4),
    )
    return {
        "none": lambda: decode(q, cache, table, seq, **kw),
        "fp8-shadow": lambda: decode_shadow(q, cache, fp8_shadow, table, seq, quant=FP8_3, **kw),
        "nvfp4-shadow": lambda: decode_shadow(q, cache, nv_shadow, table, seq, quant=NVFP4, **kw),
        "nvfp4-on-read": lambda: decode(q, cache, table, seq, quant=NVFP4, **kw),
    }


def _as_sm90() -> None:
    real = gd.gluon_facts

    def facts(*args: Any) -> gd.GluonFacts:
        return replace(real(*args), device_type="cuda", capability=(9, 0), interpreting=False,
                       api_missing=None)  # fmt: skip

    gd.gluon_facts = facts  # type: ignore[assignment]  # this process only


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--profile", choices=["none", "fp8-shadow", "nvfp4-shadow", "nvfp4-on-read"]
    )
    parser.add_argument("--json", help="write {case: microseconds a call} here")
    args = parser.parse_args()
    _as_sm90()
    launches: list[str] = []

    def action(run: Any, kernel: Any, a: Any, kwargs: dict[str, Any], grid: Any) -> None:
        launches.append(kernel.fn.__name__)

    got: dict[str, dict[str, Any]] = {}
    calls = cases()
    with _intercept(action):
        for name, call in calls.items():
            for _ in range(20):  # first calls compile nothing (intercepted) but fill caches
                call()
            launches.clear()
            call()
            kernels = list(launches)
            batches = []
            for _ in range(9):
                start = time.perf_counter()
                for _ in range(50):
                    call()
                batches.append((time.perf_counter() - start) / 50 * 1e6)
            got[name] = {"us": min(batches), "kernels": kernels}
            print(f"{name:14s} {min(batches):8.1f} us a call  {' '.join(kernels)}")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                calls[args.profile]()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
