"""Benchmark of the write-once shadow cache: ``decode_shadow`` against on-read ``decode``,
and the cost of ``update_cache``.

Run on a CUDA GPU from the repository root (one command; compiles in parallel, then times)::

    PYTHONPATH=packages/mla-formats/src:packages/mla-reference/src:packages/mla-triton/src \\
        python packages/mla-triton/benchmarks/shadow.py --out OUTDIR [--sweep] [--tail]

Writes ``OUTDIR/shadow.json`` and ``OUTDIR/shadow.txt``. Per shape (b128 h128 L8192
and b128 h16 L8192, page 64, random bf16, every request at full length, block table
a random permutation) and variant (quant none; on-read fp8 and nvfp4; shadow nvfp4
and fp8 in both storages, default tiles): the median time of
``triton.testing.do_bench``, TFLOP/s counted as FlashMLA does (``2 H L (576 +
512)`` per request), GB/s of raw-latent-equivalent traffic (576 bf16 per token +
q + out) and of the bytes actually read (shadow payload per token, + q + out).
The shadow is filled by ``update_cache`` itself. Then ``update_cache``'s time for
a decode step (128 new tokens at scattered slots) and a prefill (8192 consecutive
tokens), against the raw-only write (``quant`` none), and the bytes per token.
Every shadow variant is checked against the on-read decode on two requests, and
a summary compares each fp16-shadow recipe with quant none of the same shape.

Options: ``--sweep`` adds alternative fp16-shadow tiles (``SWEEP``: block_n 64/32/16,
num_stages 1 to 4, num_warps 4/8, per shape) and quant none at nvfp4's 32-token
tile; ``--variants 'nvfp4:64,64,8,1;fp8:16,64,4,2'`` adds given tiles
(``RECIPE:block_h,block_n,num_warps,num_stages``); ``--tail`` adds b128 h128 at
L = 8155, where every request ends inside a tile (the peeled tail tile, with an
open nvfp4 V block); ``--skip-packed`` and ``--skip-update`` leave parts out.
Tiles that do not fit the device are skipped when compiled.

``--flashmla`` times FlashMLA bf16 (vLLM's ``flash_mla_with_kvcache``, through
``decode.py``'s ``flashmla_run``) once per shape on the same raw bf16 cache, block table
and q, in the same process with the same ``do_bench`` settings: a FlashMLA row (ms,
TFLOP/s, GB/s of 1152 bytes per token + q + out), and every other row of the shape gets
``vs_flashmla`` (FlashMLA's time over the row's) and ``bw_vs_flashmla``, the
bandwidth-equivalent speed: the fraction of FlashMLA's achieved bytes/s the path achieves
on the bytes it must read (the row's read GB/s over FlashMLA's GB/s). As in
``decode.py``, where vLLM or FlashMLA fails the FlashMLA row records the error and the run
goes on; a ``--tiny`` run skips FlashMLA with a note. ``--shapes a,b`` runs the named
shapes (default: those above, plus ``--tail``'s); ``--impl auto|triton|gluon`` is passed
to ``decode_shadow`` (entries with their own tiles run ``triton``) and recorded per row.

``--tiny`` runs a small version of everything on the CPU (``TRITON_INTERPRET=1``):
a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from mla_formats import AttentionQuant
from mla_triton.decode import DecodeConfig, decode, decode_config, decode_num_splits
from mla_triton.shadow import (
    decode_shadow,
    shadow_decode_config,
    shadow_layout,
    update_cache,
)

SHAPES: dict[str, tuple[int, int, int, int]] = {  # batch, heads, seq len, page size
    "b128-h128-L8192": (128, 128, 8192, 64),
    "b128-h16-L8192": (128, 16, 8192, 64),
}
# --tail: every request 37 tokens short of a page bound, so each one's last split
# runs the tile holding its end (with an open 16-token V block of 11 tokens)
TAIL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "b128-h128-L8155-tail": (128, 128, 8155, 64),
}
TINY_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "b2-h16-L80": (2, 16, 80, 16),
}
TINY_TAIL_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "b2-h16-L75-tail": (2, 16, 75, 16),
}
ALL_SHAPES = {**SHAPES, **TAIL_SHAPES}
ALL_TINY_SHAPES = {**TINY_SHAPES, **TINY_TAIL_SHAPES}
IMPLS = ("auto", "triton", "gluon")
NVFP4 = AttentionQuant.uniform("nvfp4")
FP8 = AttentionQuant.uniform("fp8")
QUANTS: dict[str, AttentionQuant | None] = {"none": None, "fp8": FP8, "nvfp4": NVFP4}


@dataclass(frozen=True)
class Entry:
    shape: str
    recipe: str  # a QUANTS key
    path: str  # "on-read", "shadow-fp16", "shadow-packed"
    config: DecodeConfig | None = None  # None: the path's default
    impl: str = "auto"  # decode_shadow's impl (on-read rows: decode's default, "auto")

    @property
    def storage(self) -> str:
        return self.path.removeprefix("shadow-")

    @property
    def name(self) -> str:
        return f"{self.path}:{self.recipe}"


def _cfg(bh: int, bn: int, warps: int, stages: int) -> DecodeConfig:
    return DecodeConfig(block_h=bh, block_n=bn, num_warps=warps, num_stages=stages)


# Alternative tiles of the fp16 shadow (``--sweep``), per head-group size: block_n
# 64/32/16, num_stages 1/2/3/4, num_warps 4/8. Tiles known not to fit the 227 KiB
# of shared memory of an H100/H200 SM with 64 heads a program (q alone takes 72
# KiB; a 64-token stage of K̂ + V̂ 136 KiB) are left out; any other that does not
# fit is skipped when it is compiled.
SWEEP: dict[int, dict[str, list[tuple[int, int, int, int]]]] = {
    64: {
        "nvfp4": [(64, 64, 8, 1), (64, 16, 8, 3), (64, 16, 8, 4)],
        "fp8": [(64, 32, 8, 2), (64, 32, 8, 3), (64, 64, 8, 1)],
    },
    16: {
        "nvfp4": [(16, 32, 4, 3), (16, 64, 4, 2), (16, 64, 4, 1), (16, 32, 8, 2)],
        "fp8": [(16, 64, 4, 2), (16, 32, 4, 3), (16, 64, 8, 3)],
    },
}


def parse_variants(text: str) -> list[tuple[str, tuple[int, int, int, int]]]:
    """``"nvfp4:64,64,8,1;fp8:16,64,4,2"``: (recipe, (block_h, block_n, warps, stages))."""
    out: list[tuple[str, tuple[int, int, int, int]]] = []
    for item in filter(None, (t.strip() for t in text.split(";"))):
        recipe, _, tiles = item.partition(":")
        nums = tuple(int(x) for x in tiles.split(","))
        if recipe not in ("nvfp4", "fp8") or len(nums) != 4:
            raise SystemExit(f"--variants: expected RECIPE:bh,bn,warps,stages, got {item!r}")
        _cfg(*nums)  # validates
        out.append((recipe, (nums[0], nums[1], nums[2], nums[3])))
    return out


def plan(
    shapes: dict[str, tuple[int, int, int, int]],
    sweep: bool,
    *,
    variants: list[tuple[str, tuple[int, int, int, int]]] | None = None,
    packed: bool = True,
    impl: str = "auto",
) -> list[Entry]:
    """Default entries per shape, then the sweep's and ``--variants``' alternative tiles.

    Sweep and variant tiles run the fp16 shadow (the default storage) of the shapes
    whose default head group (64 for H > 32, else 16) matches their block_h, through
    the Triton kernel; the default shadow entries run ``impl``.
    """
    entries: list[Entry] = []
    paths = ("shadow-fp16", "shadow-packed") if packed else ("shadow-fp16",)
    for s in shapes:
        entries += [Entry(s, "none", "on-read"), Entry(s, "fp8", "on-read")]
        entries += [Entry(s, "nvfp4", "on-read")]
        for path in paths:
            entries += [Entry(s, "nvfp4", path, impl=impl), Entry(s, "fp8", path, impl=impl)]
        bh = 64 if shapes[s][1] > 32 else 16
        extra: list[tuple[str, tuple[int, int, int, int]]] = []
        if sweep and not s.endswith("-tail"):
            extra += [(r, t) for r, ts in SWEEP[bh].items() for t in ts]
            if bh == 64:  # quant none at the 32-token tile of nvfp4's default
                entries.append(Entry(s, "none", "on-read", _cfg(64, 32, 8, 2)))
        extra += [(r, t) for r, t in (variants or []) if t[0] == bh]
        for recipe, tiles in extra:
            e = Entry(s, recipe, "shadow-fp16", _cfg(*tiles), impl="triton")
            if e not in entries:
                entries.append(e)
    return entries


def flops(batch: int, heads: int, seq: int) -> float:
    return 2.0 * batch * heads * seq * (576 + 512)


def raw_bytes(batch: int, heads: int, seq: int) -> float:
    """Raw-latent-equivalent traffic: 576 bf16 per token, q read, out written."""
    return 2.0 * (batch * seq * 576 + batch * heads * 576 + batch * heads * 512)


def actual_bytes(entry: Entry, batch: int, heads: int, seq: int) -> float:
    """Bytes the kernel reads per token (shadow payload, or raw rows), + q + out."""
    quant = QUANTS[entry.recipe]
    if entry.path == "on-read" or quant is None:
        per = 576 * 2
    else:
        lay = shadow_layout(quant, storage=entry.storage)
        per = lay.payload_bytes
        if quant.k.is_identity:
            per += 576 * 2
    return batch * seq * per + 2.0 * (batch * heads * 576 + batch * heads * 512)


class Pool:
    """Raw cache, block table and one shadow per (recipe, storage), filled by update_cache."""

    def __init__(self, shape: tuple[int, int, int, int], device: str, *, tiny: bool) -> None:
        batch, heads, seq, page = shape
        self.batch, self.heads, self.seq, self.page = batch, heads, seq, page
        self.device = device
        g = torch.Generator(device="cpu").manual_seed(0)
        pages_per = -(-seq // page)
        self.blocks = batch * pages_per
        self.table = (
            torch.randperm(self.blocks, generator=g).to(torch.int32).reshape(batch, pages_per)
        ).to(device)
        dtype = torch.float16 if tiny else torch.bfloat16
        self.cache = torch.zeros(self.blocks, page, 576, device=device, dtype=dtype)
        self.q = torch.randn(batch, heads, 576, generator=g).to(device, dtype)
        self.lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
        self.shadows: dict[tuple[str, str], torch.Tensor] = {}
        self.g = g

    def fill(self, recipe: str, storage: str) -> torch.Tensor:
        """Write every token through update_cache (in position order, chunked)."""
        key = (recipe, storage)
        if key in self.shadows:
            return self.shadows[key]
        quant = QUANTS[recipe]
        assert quant is not None
        lay = shadow_layout(quant, storage=storage)
        shadow = torch.zeros(
            lay.shape(self.blocks, self.page), dtype=torch.uint8, device=self.device
        )
        g = torch.Generator(device=self.device).manual_seed(1)  # the same latent every time
        chunk = 1 << 16
        total = self.blocks * self.page
        for lo in range(0, total, chunk):
            n = min(chunk, total - lo)
            x = torch.randn(n, 576, generator=g, device=self.device).to(self.cache.dtype)
            update_cache(
                x[:, :512],
                x[:, 512:],
                self.cache,
                torch.arange(lo, lo + n, device=self.device),
                shadow,
                quant=quant,
                storage=storage,
            )
        self.shadows[key] = shadow
        return shadow


def _splits(entry: Entry, shapes: dict[str, tuple[int, int, int, int]], device: str) -> int:
    batch, heads, seq, _ = shapes[entry.shape]
    cfg = _config(entry, heads)
    dev = torch.device(device) if device == "cuda" else None
    return decode_num_splits(batch, heads, seq, device=dev, block_h=cfg.block_h)


def _config(entry: Entry, heads: int) -> DecodeConfig:
    if entry.config is not None:
        return entry.config
    quant = QUANTS[entry.recipe]
    if entry.path == "on-read":
        return decode_config(heads, quant)
    return shadow_decode_config(heads, quant, entry.storage)


def _runner(
    entry: Entry, pool: Pool, splits: int, out: torch.Tensor, lse: torch.Tensor
) -> Callable[[], object]:
    quant = QUANTS[entry.recipe]
    common: dict[str, Any] = {
        "softmax_scale": 0.1,
        "num_splits": splits,
        "config": entry.config,
        "out": out,
        "lse": lse,
        "max_seq_len": pool.seq,
    }
    if entry.path == "on-read":
        return lambda: decode(pool.q, pool.cache, pool.table, pool.lens, quant=quant, **common)
    assert quant is not None
    shadow = pool.fill(entry.recipe, entry.storage)
    return lambda: decode_shadow(
        pool.q,
        pool.cache,
        shadow,
        pool.table,
        pool.lens,
        quant=quant,
        storage=entry.storage,
        impl=entry.impl,
        **common,
    )


def _compile_one(entry: Entry) -> tuple[Entry, str | None]:
    """Compile one entry's kernels on inputs of the same table width (tiny data).

    Returns the entry and a log line, or None when its tiles do not fit the device
    (shared memory or registers), or ``impl="gluon"`` is refused for it (a ValueError
    naming ``impl``): the run then leaves that entry out.
    """
    from triton.runtime.errors import OutOfResources

    _, heads, seq, page = ALL_SHAPES[entry.shape]
    t0 = time.time()
    small = Pool((2, heads, seq, page), "cuda", tiny=False)
    small.lens.fill_(64)
    splits = _splits(entry, ALL_SHAPES, "cuda")
    out = torch.empty(2, heads, 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(2, heads, device="cuda", dtype=torch.float32)
    try:
        _runner(entry, small, splits, out, lse)()
    except OutOfResources as err:
        print(f"skipped {entry.shape} {entry.name} {entry.config}: {err}", flush=True)
        return entry, None
    except ValueError as err:
        if entry.impl != "gluon" or "impl" not in str(err):
            raise
        print(f"skipped {entry.shape} {entry.name} impl=gluon: {err}", flush=True)
        return entry, None
    torch.cuda.synchronize()
    line = f"{entry.shape} {entry.name} {entry.impl} {entry.config} {time.time() - t0:.1f}s"
    return entry, line


def precompile(entries: list[Entry], workers: int) -> list[Entry]:
    """Compile every entry in parallel; returns those that fit the device."""
    ctx = mp.get_context("spawn")
    fitting: list[Entry] = []
    with ctx.Pool(workers) as pool:
        for entry, line in pool.imap_unordered(_compile_one, entries):
            if line is not None:
                fitting.append(entry)
                print("compiled", line, flush=True)
    return [e for e in entries if e in fitting]


def _bench(fn: Callable[[], object], tiny: bool, warmup_ms: int, rep_ms: int) -> float:
    if tiny:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _tag(row: dict[str, object]) -> str:
    c = row["config"]
    assert isinstance(c, dict)
    tiles = f"{c['block_h']},{c['block_n']},{c['num_warps']},{c['num_stages']}"
    return tiles + (" (default)" if row["default_config"] else "")


def _row_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.double(), b.double()
    return float(((a64 - b64).abs().amax(-1) / b64.abs().amax(-1).clamp_min(1e-3)).max())


def time_flashmla(shape: str, pool: Pool, warmup_ms: int, rep_ms: int) -> dict[str, object]:
    """FlashMLA bf16 (``decode.py``'s ``flashmla_run``) on ``pool``'s raw cache, table
    and q: its time, rates and agreement with on-read decode (quant none); the error
    instead where vLLM or FlashMLA fails (the run goes on, as in ``decode.py``)."""
    batch, heads, seq = pool.batch, pool.heads, pool.seq
    row: dict[str, object] = {"shape": shape, "path": "flashmla", "recipe": "none"}
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from decode import flashmla_run  # benchmarks/decode.py (this script's folder)

        if not pool.shadows:  # the latent the shadow rows read (update_cache's raw rows)
            pool.fill("fp8", "fp16")
        run = flashmla_run(pool.q, pool.cache, pool.table, pool.lens, 0.1)
        out = run()[0].reshape(batch, heads, 512)
        ref = decode(pool.q, pool.cache, pool.table, pool.lens, softmax_scale=0.1)[0]
        row["max_row_err_vs_on_read"] = _row_err(out, ref)
        row["finite"] = bool(torch.isfinite(out).all())
        ms = _bench(run, False, warmup_ms, rep_ms)
    except Exception as exc:  # vLLM missing or FlashMLA failing: recorded, the run goes on
        row["error"] = f"{type(exc).__name__}: {exc}"
        print(f"{shape:20s} flashmla skipped: {row['error']}", flush=True)
        return row
    gbps = raw_bytes(batch, heads, seq) / ms / 1e6  # it reads the raw rows: 1152 B a token
    row.update(
        ms=ms, tflops=flops(batch, heads, seq) / ms / 1e9, raw_equiv_gbps=gbps, actual_gbps=gbps
    )
    print(f"{shape:20s} flashmla bf16 {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s", flush=True)
    return row


def _num(x: object) -> float:
    assert isinstance(x, (int, float))
    return float(x)


def time_decodes(
    entries: list[Entry],
    shapes: dict[str, tuple[int, int, int, int]],
    device: str,
    tiny: bool,
    warmup_ms: int,
    rep_ms: int,
    *,
    flashmla: bool = False,
) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The decode rows, and with ``flashmla`` one FlashMLA row per shape (timed after
    the shape's entries, on the same pool); each row of a shape FlashMLA ran at gets
    ``vs_flashmla`` (time ratio) and ``bw_vs_flashmla`` (read GB/s over FlashMLA's)."""
    rows: list[dict[str, object]] = []
    flash: list[dict[str, object]] = []
    for shape in shapes:
        pool = Pool(shapes[shape], device, tiny=tiny)
        batch, heads, seq, _ = shapes[shape]
        for entry in (e for e in entries if e.shape == shape):
            splits = _splits(entry, shapes, device)
            out = torch.empty(batch, heads, 512, device=device, dtype=pool.q.dtype)
            lse = torch.empty(batch, heads, device=device, dtype=torch.float32)
            run = _runner(entry, pool, splits, out, lse)
            ms = _bench(run, tiny, warmup_ms, rep_ms)
            row: dict[str, object] = {
                "shape": shape,
                "path": entry.path,
                "recipe": entry.recipe,
                "impl": entry.impl,
                "config": asdict(_config(entry, heads)),
                "default_config": entry.config is None,
                "num_splits": splits,
                "ms": ms,
                "tflops": flops(batch, heads, seq) / ms / 1e9,
                "raw_equiv_gbps": raw_bytes(batch, heads, seq) / ms / 1e6,
                "actual_gbps": actual_bytes(entry, batch, heads, seq) / ms / 1e6,
                "finite": bool(torch.isfinite(out).all()),
            }
            quant = QUANTS[entry.recipe]
            if entry.path != "on-read" and quant is not None:
                # agreement with on-read on two requests (same data, same pool)
                want = decode(
                    pool.q[:2], pool.cache, pool.table[:2], pool.lens[:2], softmax_scale=0.1,
                    quant=quant, num_splits=splits,
                )  # fmt: skip
                got = decode_shadow(
                    pool.q[:2], pool.cache, pool.shadows[(entry.recipe, entry.storage)],
                    pool.table[:2], pool.lens[:2], softmax_scale=0.1, quant=quant,
                    storage=entry.storage, num_splits=splits, config=entry.config,
                    impl=entry.impl,
                )  # fmt: skip
                row["max_row_err_vs_on_read"] = _row_err(got[0], want[0])
                row["max_lse_err_vs_on_read"] = float((got[1] - want[1]).abs().max())
            rows.append(row)
            print(
                f"{shape:20s} {entry.name:22s} {entry.impl:6s} {_tag(row)} {ms:8.3f} ms "
                f"{row['tflops']:7.1f} TFLOP/s",
                flush=True,
            )
        if flashmla:
            fl = time_flashmla(shape, pool, warmup_ms, rep_ms)
            flash.append(fl)
            if "ms" in fl:
                for r in (r for r in rows if r["shape"] == shape):
                    r["vs_flashmla"] = _num(fl["ms"]) / _num(r["ms"])
                    r["bw_vs_flashmla"] = _num(r["actual_gbps"]) / _num(fl["actual_gbps"])
        del pool
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows, flash


def time_updates(device: str, tiny: bool, warmup_ms: int, rep_ms: int) -> list[dict[str, object]]:
    """update_cache per call: a decode step (128 scattered tokens) and an 8192-token prefill."""
    blocks, page = (64, 16) if tiny else (128 * 8192 // 64, 64)
    dtype = torch.float16 if tiny else torch.bfloat16
    cache = torch.zeros(blocks, page, 576, device=device, dtype=dtype)
    g = torch.Generator(device="cpu").manual_seed(2)
    cases = {
        "decode-step-128": (8 if tiny else 128),
        "prefill-8192": (64 if tiny else 8192),
    }
    rows: list[dict[str, object]] = []
    for case, n in cases.items():
        if case.startswith("decode"):  # one token in each of n sequences' pages
            pages = torch.randperm(blocks, generator=g)[:n]
            slots = pages * page + torch.randint(0, page, (n,), generator=g)
        else:  # consecutive positions of one sequence over random pages
            pages = torch.randperm(blocks, generator=g)[: -(-n // page)]
            pos = torch.arange(n)
            slots = pages[pos // page] * page + pos % page
        slots = slots.to(device)
        x = torch.randn(n, 576, generator=g).to(device, dtype)
        for recipe, storage in (
            ("none", "fp16"),
            ("nvfp4", "fp16"),
            ("nvfp4", "packed"),
            ("fp8", "fp16"),
            ("fp8", "packed"),
        ):
            quant = QUANTS[recipe] or AttentionQuant()
            lay = shadow_layout(quant, storage=storage)
            shadow = torch.zeros(lay.shape(blocks, page), dtype=torch.uint8, device=device)

            def run(
                quant: AttentionQuant = quant,
                shadow: torch.Tensor = shadow,
                st: str = storage,
                x: torch.Tensor = x,
                slots: torch.Tensor = slots,
            ) -> None:
                update_cache(
                    x[:, :512],
                    x[:, 512:],
                    cache,
                    slots,
                    shadow,
                    quant=quant,
                    storage=st,
                )

            ms = _bench(run, tiny, warmup_ms, rep_ms)
            rows.append(
                {
                    "case": case,
                    "recipe": recipe if recipe != "none" else "raw only",
                    "storage": storage if recipe != "none" else "-",
                    "tokens": n,
                    "us": ms * 1e3,
                    "ns_per_token": ms * 1e6 / n,
                    "shadow_bytes_per_token": lay.token_bytes,
                    "shadow_payload_per_token": lay.payload_bytes,
                }
            )
            r = rows[-1]
            print(
                f"update {case:16s} {r['recipe']:8s} {r['storage']:6s} {r['us']:9.1f} us",
                flush=True,
            )
    return rows


def memory_table() -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for recipe in ("nvfp4", "fp8"):
        for storage in ("fp16", "packed"):
            quant = QUANTS[recipe]
            assert quant is not None
            lay = shadow_layout(quant, storage=storage)
            rows.append(
                {
                    "recipe": recipe,
                    "storage": storage,
                    "token_bytes": lay.token_bytes,
                    "payload_bytes": lay.payload_bytes,
                    "raw_bf16_bytes": 1152,
                    "overhead_vs_raw": lay.token_bytes / 1152,
                }
            )
    return rows


def summary(dec: list[dict[str, object]]) -> list[str]:
    """Per shape: each fp16-shadow recipe's default and best tiles against quant none."""
    lines = ["summary (fp16 shadow against on-read quant none, default tiles, same shape):"]
    for shape in dict.fromkeys(str(r["shape"]) for r in dec):
        rows = [r for r in dec if r["shape"] == shape]
        none = [r for r in rows if r["recipe"] == "none" and r["default_config"]]
        if not none:
            continue
        base = float(none[0]["ms"])  # type: ignore[arg-type]
        lines.append(f"  {shape}: none {base:.3f} ms")
        for recipe in ("nvfp4", "fp8"):
            mine = [r for r in rows if r["path"] == "shadow-fp16" and r["recipe"] == recipe]
            if not mine:
                continue
            best = min(mine, key=lambda r: float(r["ms"]))  # type: ignore[arg-type]
            for label, r in [("default", d) for d in mine if d["default_config"]] + [
                ("best", best)
            ]:
                ms = float(r["ms"])  # type: ignore[arg-type]
                lines.append(
                    f"    {recipe:6s} {label:8s} {_tag(r):22s} {ms:8.3f} ms  "
                    f"{base / ms:5.2f}x quant none"
                )
    return lines


def render(
    info: dict[str, object],
    dec: list[dict[str, object]],
    upd: list[dict[str, object]],
    mem: list[dict[str, object]],
    flash: list[dict[str, object]] | None = None,
) -> str:
    lines = [
        f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}",
        f"{'shape':20s} {'path':14s} {'recipe':6s} {'impl':6s} "
        f"{'config (bh,bn,warps,stages)':30s} {'splits':>6s} {'ms':>8s} {'TFLOP/s':>8s} "
        f"{'rawGB/s':>8s} {'GB/s':>7s} {'err':>8s} {'xFlash':>6s} {'bwxFl':>6s}",
    ]
    for r in dec:
        tag = _tag(r)
        err = r.get("max_row_err_vs_on_read")
        vs, bw = r.get("vs_flashmla"), r.get("bw_vs_flashmla")
        lines.append(
            f"{r['shape']:20s} {r['path']:14s} {r['recipe']:6s} {r['impl']:6s} {tag:30s} "
            f"{r['num_splits']:>6} {r['ms']:8.3f} {r['tflops']:8.1f} {r['raw_equiv_gbps']:8.0f} "
            f"{r['actual_gbps']:7.0f} "
            + (f"{err:8.1e}" if isinstance(err, float) else f"{'':8s}")
            + (f" {vs:6.2f} {bw:6.2f}" if isinstance(vs, float) and isinstance(bw, float) else "")
            + ("" if r["finite"] else "  NON-FINITE")
        )
    for fl in flash or []:
        if "ms" in fl:
            lines.append(
                f"{fl['shape']:20s} flashmla bf16 (vLLM) {fl['ms']:8.3f} ms "
                f"{fl['tflops']:8.1f} TFLOP/s {fl['raw_equiv_gbps']:8.0f} GB/s "
                f"(max row err vs on-read {fl['max_row_err_vs_on_read']:.1e})"
                + ("" if fl["finite"] else "  NON-FINITE")
            )
        else:
            lines.append(f"{fl['shape']:20s} flashmla: {fl.get('error')}")
    if flash:
        lines.append(
            "xFlash: vs_flashmla (FlashMLA's ms / the row's); bwxFl: bw_vs_flashmla (the "
            "row's read GB/s / FlashMLA's GB/s)"
        )
    lines += summary(dec)
    lines.append("update_cache (raw write + shadow):")
    for r in upd:
        lines.append(
            f"  {r['case']:16s} {r['recipe']:8s} {r['storage']:6s} {r['tokens']:>6} tokens "
            f"{r['us']:9.1f} us {r['ns_per_token']:8.1f} ns/token"
        )
    lines.append("memory per token (raw bf16 latent: 1152 bytes):")
    for r in mem:
        lines.append(
            f"  {r['recipe']:6s} {r['storage']:6s} {r['token_bytes']:5} bytes "
            f"({r['payload_bytes']} payload), {r['overhead_vs_raw']:.2f}x the raw cache"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for shadow.json/.txt")
    parser.add_argument(
        "--sweep", action="store_true", help="add alternative fp16-shadow tiles (SWEEP)"
    )
    parser.add_argument(
        "--variants",
        default="",
        help="more fp16-shadow tiles, 'RECIPE:bh,bn,warps,stages;...' (recipe nvfp4 or fp8; "
        "run on the shapes whose default head group is bh)",
    )
    parser.add_argument(
        "--tail", action="store_true", help="add a shape whose requests end inside a tile"
    )
    parser.add_argument("--skip-packed", action="store_true", help="leave out the packed storage")
    parser.add_argument("--skip-update", action="store_true", help="leave out update_cache")
    parser.add_argument(
        "--flashmla",
        action="store_true",
        help="time FlashMLA bf16 (vLLM) per shape; rows get vs_flashmla and bw_vs_flashmla",
    )
    parser.add_argument(
        "--shapes",
        default="",
        help="comma-separated shape names (default: the standard shapes, plus --tail's)",
    )
    parser.add_argument(
        "--impl",
        choices=IMPLS,
        default="auto",
        help="decode_shadow's impl for the default shadow entries (default auto)",
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (TRITON_INTERPRET=1)")
    parser.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--warmup-ms", type=int, default=50)
    parser.add_argument("--rep-ms", type=int, default=200)
    args = parser.parse_args(argv)
    tiny = bool(args.tiny)
    if not tiny and not torch.cuda.is_available():
        print("shadow benchmark: needs a CUDA GPU (or --tiny on the CPU)", file=sys.stderr)
        return 2
    if tiny and args.impl == "gluon":
        print(
            "shadow benchmark: --impl gluon needs an sm90 CUDA GPU (the Gluon kernel does not "
            "run in the interpreter); use --impl auto or triton with --tiny",
            file=sys.stderr,
        )
        return 2
    device = "cpu" if tiny else "cuda"
    known = ALL_TINY_SHAPES if tiny else ALL_SHAPES
    shapes = dict(TINY_SHAPES if tiny else SHAPES)
    if args.shapes:
        names = [n for n in args.shapes.split(",") if n]
        unknown = [n for n in names if n not in known]
        if unknown:
            print(
                f"shadow benchmark: --shapes: unknown {', '.join(unknown)} "
                f"(known{' with --tiny' if tiny else ''}: {', '.join(known)})",
                file=sys.stderr,
            )
            return 2
        shapes = {n: known[n] for n in names}
    if args.tail:
        shapes.update(TINY_TAIL_SHAPES if tiny else TAIL_SHAPES)
    flashmla = bool(args.flashmla)
    if flashmla and tiny:
        print("note: --flashmla skipped: FlashMLA needs a CUDA GPU (a --tiny run)", flush=True)
        flashmla = False
    entries = plan(
        shapes,
        args.sweep,
        variants=parse_variants(args.variants),
        packed=not args.skip_packed,
        impl=args.impl,
    )
    if not tiny:
        t0 = time.time()
        entries = precompile(entries, args.workers)
        print(f"precompiled {len(entries)} entries in {time.time() - t0:.0f}s", flush=True)
    info: dict[str, object] = {
        "device": torch.cuda.get_device_name() if not tiny else "cpu (interpreter)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "tiny": tiny,
    }
    dec, flash = time_decodes(
        entries, shapes, device, tiny, args.warmup_ms, args.rep_ms, flashmla=flashmla
    )
    upd = [] if args.skip_update else time_updates(device, tiny, args.warmup_ms, args.rep_ms)
    mem = memory_table()
    text = render(info, dec, upd, mem, flash)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "shadow.json"), "w") as f:
            json.dump(
                {"info": info, "decode": dec, "flashmla": flash, "update": upd, "memory": mem},
                f,
                indent=1,
            )
        with open(os.path.join(args.out, "shadow.txt"), "w") as f:
            f.write(text + "\n")
    errs = [r.get("max_row_err_vs_on_read", 0.0) for r in dec]
    ok = all(r["finite"] for r in dec) and all(isinstance(e, float) and e <= 1e-2 for e in errs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
