"""SASS instructions of the Gluon decode's nvfp4-on-read main loop, per phase (no GPU).

From the repository root::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/tools/sass_on_read.py [--mode 1|2] [--sass FILE]

Compiles ``gluon_decode_split_kernel`` for sm_90a as ``test_compiles_for_sm90a
[bn32-st2-on-read-nvfp4]`` does (uniform nvfp4 on read, bf16, page 64, two splits; ``--mode
2``: ``ON_READ_BLOCKS_CONFIG``, ``V_OWN == 2``), reassembles its PTX with line
information (Triton's ``ptxas -lineinfo``) and disassembles it (``nvdisasm -gi``). Each
instruction of the main loop (from the loop's top barrier to its back edge: one warp, one
32-token tile) is charged to the kernel line it was inlined into: V̂ QDQ, K̂ QDQ (and its
in-place barriers), S wgmma, softmax, acc rescale, P̂ QDQ, P V wgmma, copies, waits. Per
phase: instructions and the pipe they issue to (``alu``: integer, logic, compare, min/max,
select, half rate on sm90; ``fma``: float32 and packed 16-bit arithmetic; ``fmaheavy``:
integer multiply-add; ``xu``: MUFU and conversions; ``mio``: shared memory and shuffles;
``ctl``: MMA, barriers, branches; ``uniform``: the uniform datapath). docs/design/decode.md
("What bounds nvfp4 on read") builds its issue model from these counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton

from mla_formats import AttentionQuant
from mla_triton.ops.decode import gluon as gd

KERNEL = Path(gd.__file__).with_name("gluon_kernels.py")
ALU = {"IADD3", "LOP3", "SHF", "ISETP", "FSETP", "FSEL", "SEL", "FMNMX", "IMNMX", "LEA", "PRMT",
       "MOV", "PLOP3", "P2R", "R2P", "VIADD", "VIMNMX", "IABS", "SGXT", "HSETP2"}  # fmt: skip
FMA = {"FADD", "FMUL", "FFMA", "HADD2", "HFMA2", "HMUL2"}
MIO = {"LDS", "STS", "LDSM", "STSM", "SHFL", "LDGSTS", "LDG", "STG", "LDC", "ATOMS"}
XU = {"MUFU", "F2F", "F2I", "I2F", "F2FP", "I2FP", "FRND"}


def pipe(op: str) -> str:
    """The pipe a SASS opcode issues to (this module's docstring)."""
    o = op.split(".")[0]
    if o in FMA:
        return "fma"
    if o == "IMAD":
        return "fmaheavy"
    if o in ALU:
        return "alu"
    if o in XU:
        return "xu"
    if o in MIO:
        return "mio"
    if o.startswith("U") or o in ("S2UR", "R2UR"):
        return "uniform"
    return "ctl"


def compile_sass(mode: int) -> str:
    """The kernel's SASS with inline line information (``nvdisasm -c -gi``); ``mode``:
    ``V_OWN`` (1 today, 2 whole blocks, 3 with V̂ under the S MMA, 4 and K̂ under P V)."""
    recipe = gd.gluon_recipe(AttentionQuant.uniform("nvfp4"))
    assert isinstance(recipe, gd.GluonRecipe)
    cfg = (gd.SEPARATE_V_CONFIG, gd.ON_READ_BLOCKS_CONFIG)[mode - 1]
    return ptx_sass(gd.compile_variant(cfg, num_splits=2, recipe=recipe).ptx)


def ptx_sass(ptx: str, inline: bool = True) -> str:
    """sm_90a SASS of ``ptx`` with line information (Triton's ``ptxas -lineinfo``, then
    ``nvdisasm -c -gi``, or ``-g`` without ``inline``: the innermost line only)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    nvdisasm = os.path.join(os.path.dirname(ptxas), "nvdisasm")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        Path(src).write_text(ptx)
        cmd = [ptxas, "-lineinfo", "--gpu-name", "sm_90a", src, "-o", src + ".cubin"]
        subprocess.run(cmd, check=True, capture_output=True)
        flags = ["-c", "-gi" if inline else "-g"]
        out = subprocess.run([nvdisasm, *flags, src + ".cubin"], check=True, capture_output=True,
                             text=True)  # fmt: skip
    return out.stdout


def parse(sass: str) -> list[tuple[int, str, str, list[int]]]:
    """``(address, opcode, text, kernel-file lines of its inlining chain, innermost
    first)`` per instruction."""
    insts: list[tuple[int, str, str, list[int]]] = []
    chain: list[int] = []
    fresh = True
    for line in sass.splitlines():
        m = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if m:
            if fresh:
                chain, fresh = [], False
            if m.group(1).endswith("kernels/gluon_decode.py"):
                chain.append(int(m.group(2)))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            fresh = True
            text = m.group(2).strip()
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            insts.append((int(m.group(1), 16), op, text, list(chain)))
    return insts


class Lines:
    """Kernel-source lines that bound each phase (found by their text, not hard-coded)."""

    def __init__(self, src: list[str]) -> None:
        def at(text: str, after: int = 0) -> int:
            return next(k + 1 for k in range(after, len(src)) if text in src[k])

        q0 = at("def _qdq_tile_kv(")
        k3 = at("def _qdq_k(")
        self.k3 = (k3, at("kpe_mma.store(y2", k3))
        self.v0 = at("for c in gl.static_range(D1 // WV)", q0)
        self.k0 = at("if K_FMT != 0:", self.v0)
        self.kbar = at("gl.barrier()", self.k0)
        self.kend = at("kpe_mma.store(y2", self.k0)
        plain = at("p_smem = gl.allocate_shared_memory(pv")
        self.top = at("gl.barrier()", at("for i in range(n_tiles):", plain))
        self.adv = (at("nxt = i + STAGES - 1", plain), at("n_bad |= bad", plain))
        self.wait = at("cp.wait_group(STAGES - 1)", plain)
        self.own_bar = at("gl.barrier()", at("if V_OWN:", plain))
        self.qcall = self.own_bar + 1
        self.fence = at("fence_async_shared()", self.qcall)
        self.s0 = at("s = _scores(", self.fence)
        self.v3 = at("_qdq_v_in_place(kv_ring", self.s0)
        self.s1 = at("s = _scores(", self.v3)
        self.sm0 = at("valid = (start + offs_n) < hi", self.s0)
        self.res = at("acc = acc * gl.convert_layout(alpha", self.sm0)
        self.pst = at("p_smem.store(p_hat(", self.res)
        self.pv = (at("acc = warpgroup_mma(p_smem", self.pst) - 1,
                   at("acc = warpgroup_mma_wait(0, deps=(acc,))", self.pst))  # fmt: skip

    def phase(self, chain: list[int]) -> str:
        if not chain:
            return "other"
        outer = chain[-1]
        if any(self.k3[0] <= n <= self.k3[1] for n in chain):
            return "K_qdq"
        if self.qcall <= outer < self.fence and outer != self.own_bar:
            if any(self.v0 <= n < self.k0 for n in chain):
                return "V_qdq"
            if any(self.k3[0] <= n <= self.k3[1] for n in chain):
                return "K_qdq"
            if self.kbar in chain:
                return "waits_barriers"
            return "K_qdq" if any(self.k0 <= n <= self.kend for n in chain) else "other"
        if self.adv[0] <= outer <= self.adv[1]:
            return "copies"
        waits = (self.top, self.wait, self.own_bar, self.fence, self.fence + 1)
        if outer in (*waits, self.pst + 1, self.pst + 2):
            return "waits_barriers"
        if outer == self.v3:
            return "V_qdq"
        if outer in (self.s0, self.s1, self.s1 + 1):
            return "S_wgmma"
        if self.sm0 <= outer < self.res:
            return "softmax"
        if outer == self.res:
            return "acc_rescale"
        if outer == self.pst:
            return "P_qdq"
        if self.pv[0] <= outer <= self.pv[1]:
            return "PV_wgmma"
        return "other"


def main_loop(insts: list[tuple[int, str, str, list[int]]], sass: str, top: int) -> list[int]:
    """Indices of the main loop's instructions: from the first of its top barrier's line
    to the branch back to it."""
    labels: dict[str, int] = {}
    pending: str | None = None
    for line in sass.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending = m.group(1)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/", line)
        if m and pending:
            labels[pending], pending = int(m.group(1), 16), None
    lo = min(a for a, _, _, ch in insts if ch[-1:] == [top])
    hi = lo
    for a, op, text, _ in insts:
        t = re.search(r"`\((\.L_x_\d+)\)", text)
        if op == "BRA" and t and a > lo and labels.get(t.group(1), 1 << 62) <= lo + 0x40:
            hi = a
    return [k for k, (a, _, _, _) in enumerate(insts) if lo <= a <= hi]


def report(sass: str) -> str:
    lines = Lines(KERNEL.read_text().splitlines())
    insts = parse(sass)
    loop = main_loop(insts, sass, lines.top)
    count: collections.Counter[str] = collections.Counter()
    pipes: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for k in loop:
        _, op, _, chain = insts[k]
        ph = lines.phase(chain)
        count[ph] += 1
        pipes[ph][pipe(op)] += 1
    out = [f"main loop: {len(loop)} instructions (one warp, one tile)"]
    for ph, n in count.most_common():
        split = ", ".join(f"{p} {c}" for p, c in pipes[ph].most_common())
        mine = [insts[k][1] for k in loop if lines.phase(insts[k][3]) == ph]
        bars = sum(op.startswith("BAR.SYNC") for op in mine)
        out.append(f"{ph:15s} {n:5d}  ({split}; BAR.SYNC {bars})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", type=int, default=1, choices=(1, 2), help="V_OWN (see above)")
    ap.add_argument("--sass", default=None, help="also write the SASS here")
    args = ap.parse_args(argv)
    sass = compile_sass(args.mode)
    if args.sass:
        Path(args.sass).write_text(sass)
    print(f"Triton {triton.__version__}, sm_90a, V_OWN {args.mode}")
    print(report(sass))
    return 0


if __name__ == "__main__":
    sys.exit(main())
