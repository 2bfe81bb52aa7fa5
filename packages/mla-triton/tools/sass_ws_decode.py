"""SASS instructions a tile of the warp-specialized Gluon decode issues, per phase (no GPU).

From the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/tools/sass_ws_decode.py [NAME ...]

Compiles each configuration of ``CASES`` (``gluon_decode_ws.compile_ws``: sm_90a, bf16
output, page 64, one split), reassembles its PTX with line information (Triton's ``ptxas
-lineinfo``) and disassembles it (``nvdisasm -c -g``: ``sass_on_read.ptx_sass``). The
per-tile loops are the natural loops of the SASS control-flow graph that hold wgmma
(``HGMMA``) and no smaller such loop: one a math warpgroup, whose iteration is its own
tile (``S``, softmax, P̂, ``P V`` on its 256 features) and the other warpgroup's ``P V``
on them. Ranges a forward branch skips
that hold ``_zero_tail`` / ``tail_v`` code run on the tile holding the split's end only
("tail only"); the rest is what every other tile issues, one warp of the warpgroup (one
a sub-partition: the SM issues this per tile per sub-partition, both warpgroups
together). The producer's loop (``LDGSTS`` or ``UTMALDG``) is counted the same way.
docs/design/decode.md ("Bounds, counted in SASS") builds its per-tile model from these counts.
"""

from __future__ import annotations

import ast
import collections
import functools
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from sass_on_read import ptx_sass  # ptxas -lineinfo, nvdisasm -c -g (inline=False)

from mla_triton.ops.decode import gluon_ws as ws

CASES: dict[str, tuple[ws.WsConfig, Any]] = {
    "none": (ws.VARIANTS[0], None),
    "none-tma": (ws.VARIANTS[3], None),
    "none-tma-es": (ws.VARIANTS[4], None),
    "fp8-shadow": (ws.VARIANTS[0], ws.FP8_SHADOW),
    "fp8-shadow-tma": (ws.VARIANTS[3], ws.FP8_SHADOW),
    "fp8-shadow-tma-es": (ws.VARIANTS[4], ws.FP8_SHADOW),
    "nvfp4-shadow": (ws.NVFP4_CONFIG, ws.NVFP4_SHADOW),
    "nvfp4-shadow-tma": (ws.NVFP4_TMA_CONFIG, ws.NVFP4_SHADOW),
    "nvfp4-shadow-es": (replace(ws.NVFP4_CONFIG, early_s=True), ws.NVFP4_SHADOW),
    "nvfp4-shadow-p-none": (ws.NVFP4_CONFIG, replace(ws.NVFP4_SHADOW, p_fmt=0)),
    # the fp8 shadow on the nvfp4 shadow's tiles (32 tokens, 2 slots): the tile size alone
    "fp8-shadow-n32": (ws.NVFP4_CONFIG, ws.FP8_SHADOW),
}
"""What the docs' table counts: recipe none, the fp8 shadow (V̂ = K̂), the nvfp4 shadow
(its V̂ section, 32-token tiles; with P not quantized: P̂'s share by difference)."""

Inst = dict[str, Any]
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_INST = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
_TAIL = {"tail_v", "_nvfp4_v_block", "_zero_tail"}


def sass(config: ws.WsConfig, recipe: Any) -> str:
    """``nvdisasm -c -g`` of the kernel compiled for sm_90a (one split, page 64)."""
    kw = {} if recipe is None else {"recipe": recipe}
    return ptx_sass(ws.compile_ws(config, num_splits=1, **kw).ptx, inline=False)


@functools.cache
def _functions(path: str) -> list[tuple[int, int, str]]:
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError):
        return []
    return [(n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef)]  # fmt: skip


def _function(path: str, line: int) -> str:
    inside = [(a, name) for a, b, name in _functions(path) if a <= line <= b]
    return max(inside)[1] if inside else "?"


def parse(text: str) -> tuple[list[Inst], dict[str, int]]:
    """Instructions (address, opcode, text, the functions and files of their inlining
    chain) and the labels' instruction indices."""
    insts: list[Inst] = []
    labels: dict[str, int] = {}
    frames: list[tuple[str, str]] = []
    fresh = True
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("//##"):
            got = _FRAME.findall(s)
            frames = got if fresh or len(got) > len(frames) else frames
            fresh = False
        elif re.match(r"^\.L_x_\d+:", s):
            labels[s[:-1]] = len(insts)
        elif m := _INST.match(line):
            body = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2))
            insts.append({"addr": int(m.group(1), 16), "op": body.split()[0], "text": m.group(2),
                          "fns": {_function(f, int(n)) for f, n in frames},
                          "files": {Path(f).name for f, _ in frames}})  # fmt: skip
            fresh = True
    return insts, labels


def category(i: Inst) -> str:
    """The phase an instruction belongs to (by opcode, then by its source functions)."""
    op, fns = i["op"], i["fns"]
    if op.startswith("HGMMA"):
        return "wgmma"
    if op.startswith("WARPGROUP"):
        return "wgmma fence/wait"
    if op.startswith("SYNCS"):
        return "mbarrier"
    if op.startswith("BAR"):
        return "bar.sync"
    if fns & _TAIL:
        return "tail only"
    if "p_hat" in fns or i["files"] & {"kernels.py", "qdq.py"}:
        return "P QDQ"
    if "_softmax" in fns:
        return "softmax"
    if op.startswith("FMUL"):
        return "FMUL (acc rescale)"
    return "other"


def _target(i: Inst, labels: dict[str, int]) -> int | None:
    m = re.search(r"`\((\.L_x_\d+)\)", i["text"])
    return labels.get(m.group(1)) if m and i["op"].startswith("BRA") else None


def loops(insts: list[Inst], labels: dict[str, int], marks: tuple[str, ...]) -> list[set[int]]:
    """The natural loops holding an instruction whose opcode starts with one of ``marks``
    and no smaller such loop (instruction index sets)."""
    cuts = {0, *labels.values()} | {k + 1 for k, i in enumerate(insts)
                                     if i["op"].startswith(("BRA", "EXIT"))}  # fmt: skip
    starts = sorted(c for c in cuts if c < len(insts))
    ends = [*starts[1:], len(insts)]
    block = {k: n for n, (a, b) in enumerate(zip(starts, ends, strict=True)) for k in range(a, b)}
    succ: dict[int, set[int]] = collections.defaultdict(set)
    for n, e in enumerate(ends):
        last = insts[e - 1]
        t = _target(last, labels)
        if t is not None:
            succ[n].add(block[t])
        if n + 1 < len(starts) and (last["text"].startswith("@") or not
                                    last["op"].startswith(("BRA", "EXIT"))):  # fmt: skip
            succ[n].add(n + 1)
    preds: dict[int, set[int]] = collections.defaultdict(set)
    for a, bs in succ.items():
        for b in bs:
            preds[b].add(a)
    dom = {b: set(range(len(starts))) for b in range(len(starts))}
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for b in range(1, len(starts)):
            new = set.intersection(*(dom[p] for p in preds[b])) | {b} if preds[b] else {b}
            if new != dom[b]:
                dom[b], changed = new, True
    found: dict[int, set[int]] = collections.defaultdict(set)
    for a in range(len(starts)):
        for h in succ[a] & dom[a]:  # a back edge a -> h
            body, todo = {h, a}, [a]
            while todo:
                x = todo.pop()
                for p in preds[x] - body if x != h else set():
                    body.add(p)
                    todo.append(p)
            found[h] |= body
    sets = [{k for b in body for k in range(starts[b], ends[b])} for body in found.values()]
    sets = [s for s in sets if any(insts[k]["op"].startswith(marks) for k in s)]
    return [s for s in sets if not any(o < s for o in sets)]


def steady(insts: list[Inst], labels: dict[str, int], idx: set[int]) -> tuple[list[Inst], int]:
    """A loop's instructions on a tile other than the split's last (the ranges a forward
    branch skips that hold tail code, and no wgmma or mbarrier, dropped) and how many
    were dropped."""
    order = sorted(idx)
    skip: set[int] = set()
    for k in order:
        t = _target(insts[k], labels)
        if t is None or t <= k or not insts[k]["text"].startswith("@"):
            continue
        rng = [j for j in order if k < j < t]
        if any(insts[j]["op"].startswith(("HGMMA", "SYNCS")) for j in rng):
            continue
        if any(category(insts[j]) == "tail only" for j in rng):
            skip |= set(rng)
    return [insts[k] for k in order if k not in skip], len(skip)


def report(name: str, text: str) -> str:
    """One configuration's lines: each math warpgroup's loop, then the producer's."""
    insts, labels = parse(text)
    lines = []
    for idx in loops(insts, labels, ("HGMMA",)):
        body, tail = steady(insts, labels, idx)
        c = collections.Counter(category(i) for i in body)
        mma = collections.Counter(
            i["op"].split(".")[1] for i in body if i["op"].startswith("HGMMA")
        )
        f2fp = sum(i["op"].startswith("F2FP") for i in body)
        shfl = sum(i["op"].startswith("SHFL") for i in body)
        lines.append(f"{name:20s} math {len(body):5d} (+{tail} tail only) | " + ", ".join(
            f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])
        ) + f" | HGMMA {dict(mma)} F2FP {f2fp} SHFL {shfl}")  # fmt: skip
    for idx in loops(insts, labels, ("LDGSTS", "UTMALDG")):
        body, _ = steady(insts, labels, idx)
        copies = sum(i["op"].startswith(("LDGSTS", "UTMALDG")) for i in body)
        lines.append(f"{name:20s} producer {len(body):5d} ({copies} LDGSTS / UTMALDG)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    names = (argv if argv is not None else sys.argv[1:]) or list(CASES)
    unknown = set(names) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown: {sorted(unknown)} (known: {sorted(CASES)})")
    for name in names:
        print(report(name, sass(*CASES[name])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
