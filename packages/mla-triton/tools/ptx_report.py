"""Compile the decode and shadow-cache kernels for sm_90a on any machine, without a GPU:
shared memory, registers and spills per kernel, and the PTX, to compare two versions.

From the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/tools/ptx_report.py --out DIR [--case nvfp4:fp16:128 ...]
    python packages/mla-triton/tools/ptx_report.py --compare DIR_A DIR_B

First a child process runs small ``update_cache``, ``decode_shadow`` and ``decode``
calls per case (``RECIPE:STORAGE:HEADS``; default ``CASES``) in Triton's interpreter
and records every distinct launch: kernel, argument types, constexprs, warps and
stages. Integer arguments are specialized as Triton's JIT does (1 becomes a
constant; multiples of 16 are marked divisible by 16). Then each launch is compiled
for sm_90a with the hardware E4M3 conversion on (``HW_FP8``, as on an H100/H200),
and ``ptxas -v`` reports registers and spills. ``DIR`` gets ``report.txt`` and one
``.ptx`` per launch. ``--compare`` diffs two such folders' PTX with the debug line
information removed: equal PTX is equal machine code, so a refactor that keeps it
needs no new timing. The Triton used is the one installed here (3.8 with torch
2.14; the H200 machine has 3.6).

``--splits N`` runs the decode calls with N splits (the merge kernel then runs too).
``--prefill`` records ``prefill`` launches instead (cases ``RECIPE:DTYPE:CAUSAL``,
default ``PREFILL_CASES``; DeepSeek's 192/128 head dims, the tiling
``default_config`` picks on a GPU, bf16 kept as bf16). Every report line also
counts the SASS instructions of the kernel (``cuobjdump -sass``), to compare the
cost of a change without a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

CASES = ("nvfp4:fp16:128", "fp8:fp16:128", "nvfp4:packed:128", "nvfp4:fp16:16", "fp8:fp16:16")
PREFILL_CASES = ("none:bf16:causal", "fp8:bf16:causal", "nvfp4:bf16:causal",
                 "nvfp4+2:4:bf16:causal", "nvfp4:bf16:full")  # fmt: skip
TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "int32": "i32"}
TYPES.update({"int64": "i64", "uint8": "u8"})


def _encode(value: Any, constexpr: bool = False) -> Any:
    """A launch argument as JSON, reduced to what keys a compile: a tensor by its dtype, a
    tuple as a list, a constexpr as is, a runtime int by its specialization class (1,
    divisible by 16, other, beyond int32), a float as 1.0."""
    import torch

    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, tuple):
        return [_encode(v, constexpr) for v in value]
    if constexpr or isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int) and value != 1:
        base = 16 if -(2**31) <= value < 2**31 else 2**36  # i32 or i64
        return base if value % 16 == 0 else base + 1
    return 1.0 if isinstance(value, float) else value


def _decode(value: Any) -> Any:
    """``_encode``'s inverse, tensors as Triton's ``MockTensor`` (a 16-byte aligned pointer)."""
    import torch
    from triton.runtime.jit import MockTensor

    if isinstance(value, dict):
        return MockTensor(getattr(torch, value["tensor"]))
    if isinstance(value, list):
        return tuple(_decode(v) for v in value)
    return value


def record(path: Path, cases: list[str], splits: int = 1) -> None:
    """Child, under TRITON_INTERPRET=1: run the cases and write their launches to ``path``."""
    import torch
    import triton.runtime.interpreter as interpreter

    from mla_formats import AttentionQuant
    from mla_triton import allocate_shadow, decode, decode_shadow, update_cache

    launches: list[dict[str, Any]] = []
    original = interpreter.InterpretedFunction.__getitem__

    def getitem(self: Any, grid: Any) -> Any:
        launch = original(self, grid)
        params = inspect.signature(self.fn).parameters

        def run(*args: Any, **kwargs: Any) -> Any:
            bound = dict(zip(params, args, strict=False)) | kwargs
            entry = {
                "module": self.fn.__module__,
                "kernel": self.fn.__name__,
                "args": {
                    name: _encode(bound.get(name), "constexpr" in str(param.annotation))
                    for name, param in params.items()
                },
                "num_warps": kwargs.get("num_warps", 4),
                "num_stages": kwargs.get("num_stages", 3),
            }
            if entry not in launches:
                launches.append(entry)
            return launch(*args, **kwargs)

        return run

    interpreter.InterpretedFunction.__getitem__ = getitem  # type: ignore[method-assign]
    if cases and cases[0].count(":") >= 2 and cases[0].split(":")[-1] in ("causal", "full"):
        _record_prefill(cases)
        path.write_text(json.dumps(launches, indent=1, default=str))
        return
    g = torch.Generator().manual_seed(0)
    length, page, blocks = 70, 64, 2
    for case in cases:
        recipe, storage, heads = case.split(":")
        quant = AttentionQuant.uniform(recipe)
        cache = torch.zeros(blocks, page, 576, dtype=torch.float16)
        shadow = allocate_shadow(blocks, page, quant, storage=storage)
        kv_c = torch.randn(length, 512, generator=g).half()
        k_pe = torch.randn(length, 64, generator=g).half()
        update_cache(kv_c, k_pe, cache, torch.arange(length), shadow, quant=quant, storage=storage)
        table = torch.arange(blocks, dtype=torch.int32)[None]
        seq = torch.tensor([length], dtype=torch.int32)
        q = torch.randn(1, int(heads), 576, generator=g).half()
        kw: dict[str, Any] = {"softmax_scale": 0.07, "quant": quant, "num_splits": splits}
        decode_shadow(q, cache, shadow, table, seq, storage=storage, **kw)
        decode(q, cache, table, seq, **kw)
    path.write_text(json.dumps(launches, indent=1, default=str))


def _record_prefill(cases: list[str]) -> None:
    """Small ``prefill`` calls per ``RECIPE[+N:M]:DTYPE:CAUSAL`` case, with the tiling and
    dtype a GPU would use (the interpreter's bf16-in-float32 path is switched off: the
    launches are recorded, their outputs not used)."""
    import torch

    import mla_triton.common.device as device
    from mla_formats import AttentionQuant, NMSparsity
    from mla_triton import prefill, tuning
    from mla_triton.ops.prefill.triton import default_config

    device.interpreted_bf16 = lambda dtype: False  # type: ignore[assignment]  # this process
    g = torch.Generator().manual_seed(0)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    for case in cases:
        recipe_nm, dtype_name, causal = case.rsplit(":", 2)
        recipe, _, nm = recipe_nm.partition("+")
        quant = None if recipe == "none" else AttentionQuant.uniform(recipe)
        sparsity = NMSparsity(*map(int, nm.split(":"))) if nm else None
        dtype = dtypes[dtype_name]
        lens, heads = [200, 56], 16  # more than one query tile: the K/V pass runs
        cu = torch.tensor([0, 200, 256], dtype=torch.int32)
        q = torch.randn(256, heads, 192, generator=g).to(dtype)
        k = torch.randn(256, heads, 192, generator=g).to(dtype)
        v = torch.randn(256, heads, 128, generator=g).to(dtype)
        config = default_config(192, 128, dtype, torch.device("cuda"), quant)
        with tuning.use(config):
            prefill(
                q, k, v, cu, cu, softmax_scale=0.07, causal=causal == "causal", quant=quant,
                sparsity=sparsity, max_seqlen_q=max(lens), max_seqlen_k=max(lens),
            )  # fmt: skip


def _sass_count(ptxas: str, ptx: Path) -> str:
    """SASS instructions of the compiled PTX (``cuobjdump`` beside ``ptxas``), or '?'."""
    cuobjdump = Path(ptxas).with_name("cuobjdump")
    cubin = ptx.with_suffix(".cubin")
    try:
        subprocess.run([ptxas, "-arch=sm_90a", str(ptx), "-o", str(cubin)], check=True)
        sass = subprocess.run(
            [str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return "?"
    finally:
        cubin.unlink(missing_ok=True)
    return str(len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, flags=re.M)))


def compile_all(launches: list[dict[str, Any]], out: Path) -> list[str]:
    """Compile every launch for sm_90a into ``out``; one report line each."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    found = get_ptxas(90)
    ptxas = getattr(found, "path", None) or found[0]
    lines = []
    backend = make_backend(GPUTarget("cuda", 90, 32))
    for i, launch in enumerate(launches):
        fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
        args = {name: _decode(value) for name, value in launch["args"].items()}
        if "HW_FP8" in args:
            args["HW_FP8"] = True
        # the JIT's own specialization (ints of 1 become constants, multiples of 16 and
        # pointers are marked divisible by 16), tuples element by element
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        options = {"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]}
        bound, specialization, opts = binder(**args, **options)
        _, signature, constexprs, attrs = fn._pack_args(
            backend, options, bound, specialization, opts
        )
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        name = f"{i:02d}-{launch['kernel']}"
        ptx = out / f"{name}.ptx"
        ptx.write_text(compiled.asm["ptx"])
        log = subprocess.run(
            [ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        regs = re.findall(r"Used (\d+) registers", log)
        spills = re.findall(r"(\d+) bytes spill stores", log)
        named = dict(args)
        if isinstance(named.get("SHAPE"), tuple):  # (D1, D2, PAGE, BLOCK_H, BLOCK_N, ...)
            named |= {"BLOCK_H": named["SHAPE"][3], "BLOCK_N": named["SHAPE"][4]}
        tiles = ",".join(
            f"{k}={named[k]}"
            for k in ("BLOCK_H", "BLOCK_M", "BLOCK_N", "K_FMT", "V_FMT", "STORE", "CAUSAL")
            if k in named
        )
        line = (
            f"{name:32s} {tiles:46s} warps {launch['num_warps']} stages {launch['num_stages']}"
            f"  smem {compiled.metadata.shared:6d} B  regs {regs[0] if regs else '?':>3s}"
            f"  spills {spills[0] if spills else '?'} B  sass {_sass_count(ptxas, ptx)}"
        )
        print(line, flush=True)
        lines.append(line)
    return lines


def _code(path: Path) -> list[str]:
    """PTX without debug sections, ``.loc``/``.file`` lines, debug labels and comments."""
    text = path.read_text().split(".section\t.debug")[0]
    lines = (re.sub(r"//.*", "", line).rstrip() for line in text.splitlines())
    debug = re.compile(r"\.loc|\.file|^\$L__tmp\d+:$")
    return [line for line in lines if line and not debug.search(line.strip())]


def compare(a: Path, b: Path) -> int:
    names = sorted(p.name for p in a.glob("*.ptx"))
    if names != sorted(p.name for p in b.glob("*.ptx")):
        print("the two folders hold different launches")
        return 1
    differ = [n for n in names if _code(a / n) != _code(b / n)]
    for n in names:
        print(f"{'DIFFERENT' if n in differ else 'same':9s} {n}")
    print(f"{len(names) - len(differ)} of {len(names)} kernels compile to the same PTX")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for report.txt and the PTX")
    parser.add_argument("--case", action="append", help="RECIPE:STORAGE:HEADS (repeatable)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("DIR_A", "DIR_B"))
    parser.add_argument("--prefill", action="store_true", help="prefill launches instead")
    parser.add_argument("--splits", type=int, default=1, help="decode split count (2+: merge)")
    parser.add_argument("--_record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    cases = args.case or list(PREFILL_CASES if args.prefill else CASES)
    if args._record is not None:
        record(args._record, cases, args.splits)
        return 0
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give --out DIR or --compare DIR_A DIR_B")
    args.out.mkdir(parents=True, exist_ok=True)
    launches_file = args.out / "launches.json"
    child = [sys.executable, __file__, "--_record", str(launches_file)]
    child += [f"--case={c}" for c in cases] + [f"--splits={args.splits}"]
    subprocess.run(child, env=os.environ | {"TRITON_INTERPRET": "1"}, check=True)
    lines = compile_all(json.loads(launches_file.read_text()), args.out)
    import triton

    header = f"sm_90a, triton {triton.__version__}, cases {' '.join(cases)}"
    (args.out / "report.txt").write_text("\n".join([header, *lines]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
