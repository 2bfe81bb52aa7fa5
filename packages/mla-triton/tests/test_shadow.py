"""The write-once shadow cache against on-read decode and mla_formats (CPU, interpreter, fp16).

Caches are built token by token through ``update_cache`` (a prefill chunk, then
decode steps of one token per sequence, with ``-1`` padding slots holding NaN
rows), in pools whose unwritten raw rows are NaN and whose shadow bytes are
0xFF (float16 NaN): anything read that was never written shows.

Checks:

- contents: the raw rows are the inputs; K̂ equals ``qdq_factored`` along the
  features (dynamic scales too), V̂ of every complete 16-token block at absolute
  positions equals ``qdq_factored`` along the tokens (fp8: every token), bitwise,
  for both storages (packed bytes decoded here with torch's float8 and a table);
- decode: ``decode_shadow`` with the same split count and tile configuration as
  ``decode`` is bit-identical to it (the same quantized operands through the same
  dots); with its own default tiles, rows agree within float32 summation order
  (``row_errors <= 1e-3``, LSE 1e-6);
- a wrong shadow (one flipped value, or V quantized at a shifted block origin) is
  detected by both checks.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from calls import decode, decode_shadow  # the public calls, ``config`` forced (tuning.use)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mla_reference
import mla_triton.ops.shadow as shadow_module
from mla_formats import AttentionQuant, OperandQuant, qdq_factored
from mla_triton import (
    ShadowLayout,
    allocate_shadow,
    shadow_layout,
    update_cache,
)
from mla_triton.common.splitk import DecodeConfig
from mla_triton.ops.decode.triton import default_config as decode_config
from mla_triton.ops.shadow import shadow_decode_config

SCALE = 0.07
D1, D2 = 512, 64
D = D1 + D2
E2M1 = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


# ------------------------------------------------------------------ a paged pool


@dataclass
class Pool:
    """A raw cache and its shadow, filled through ``update_cache`` like an engine does."""

    quant: AttentionQuant
    storage: str
    page: int
    max_len: int
    batch: int
    seed: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    cache: torch.Tensor = field(init=False)
    shadow: torch.Tensor = field(init=False)
    table: torch.Tensor = field(init=False)
    lens: list[int] = field(init=False)
    g: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.g = torch.Generator().manual_seed(self.seed)
        per = -(-self.max_len // self.page)
        blocks = self.batch * per + 2
        self.cache = torch.full(
            (blocks, self.page, D), float("nan"), dtype=self.dtype, device=self.device
        )
        self.shadow = allocate_shadow(
            blocks, self.page, self.quant, storage=self.storage, device=self.device
        )
        self.shadow.fill_(0xFF)
        perm = torch.randperm(blocks, generator=self.g)[: self.batch * per]
        self.table = perm.reshape(self.batch, per).to(torch.int32).to(self.device)
        self.lens = [0] * self.batch

    def append(self, counts: list[int], pad: int = 2) -> None:
        """Write ``counts[b]`` new tokens of each sequence in one ``update_cache`` call.

        Sequences appear in a random order, each one's tokens in position order,
        with ``pad`` skipped (``-1``) tokens holding NaN rows in between.
        """
        rows: list[tuple[int, int]] = []  # (slot or -1, sequence)
        for b in torch.randperm(self.batch, generator=self.g).tolist():
            for pos in range(self.lens[b], self.lens[b] + counts[b]):
                slot = int(self.table[b, pos // self.page]) * self.page + pos % self.page
                rows.append((slot, b))
        for _ in range(pad):
            at = int(torch.randint(0, len(rows) + 1, (1,), generator=self.g))
            rows.insert(at, (-1, -1))
        n = len(rows)
        # latent rows of mixed magnitudes (dynamic K scales differ per token); some
        # rows exact ties of E2M1 midpoints
        mag = torch.exp2(torch.randint(-3, 3, (n, 1), generator=self.g).float())
        kvc = torch.randn(n, D1, generator=self.g) * mag
        kpe = torch.randn(n, D2, generator=self.g) * mag
        slots = torch.tensor([s for s, _ in rows], dtype=torch.int64)
        kvc[slots < 0] = float("nan")
        kpe[slots < 0] = float("nan")
        # kv_c as float32 with a row stride: cast to the cache's dtype in the kernel
        wide = torch.zeros(n, D1 + 8)
        wide[:, :D1] = kvc
        dev = self.device
        update_cache(
            wide[:, :D1].to(dev),
            kpe.to(self.dtype).to(dev),
            self.cache,
            slots.to(dev),
            self.shadow,
            quant=self.quant,
            storage=self.storage,
        )
        written = self.gather_rows(slots[slots >= 0]).cpu()
        want = torch.cat([kvc, kpe.to(self.dtype).float()], 1)[slots >= 0].to(self.dtype)
        assert torch.equal(written, want), "raw rows differ from the inputs"
        for b in range(self.batch):
            self.lens[b] += counts[b]

    def gather_rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.cache.view(-1, D)[slots.to(self.device)]

    def slots_of(self, b: int) -> torch.Tensor:
        pos = torch.arange(self.lens[b])
        return self.table[b].cpu()[pos // self.page].long() * self.page + pos % self.page

    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.lens, dtype=torch.int32, device=self.device)

    def on_cpu(self) -> Pool:
        """A copy with the cache, shadow and table on the CPU (the checks index there)."""
        if self.device == "cpu":
            return self
        other = copy.copy(self)
        other.cache, other.shadow, other.table = (
            self.cache.cpu(),
            self.shadow.cpu(),
            self.table.cpu(),
        )
        other.device = "cpu"
        return other

    @property
    def layout(self) -> ShadowLayout:
        return shadow_layout(self.quant, storage=self.storage)


# ------------------------------------------------------------------ reading the shadow here


def _e4m3(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


def _nvfp4_unpack(b: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed nvfp4 ``[..., width / 2 codes, width / 16 scales]`` to (codes, scales)."""
    codes = b[..., : width // 2].long()
    vals = torch.stack([E2M1[codes & 0xF], E2M1[codes >> 4]], -1).flatten(-2)
    return vals, _e4m3(b[..., width // 2 : width // 2 + width // 16])


def read_k(pool: Pool, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Factored K̂ ``[n, 576]`` float32 (and dynamic scales ``[n]``) of shadow rows."""
    lay = pool.layout
    kh, ks, _ = lay.views(pool.shadow)
    assert kh is not None
    rows = kh.reshape(-1, kh.shape[-1])[slots]
    scale = None if ks is None else ks.reshape(-1)[slots]
    if lay.storage == "fp16":
        return rows.float(), scale
    if lay.k_format == "fp8":
        return _e4m3(rows), scale
    parts = []
    at = 0
    for width in (D1, D2):
        vals, sb = _nvfp4_unpack(rows[:, at:], width)
        parts.append((vals.view(-1, width // 16, 16) * sb[..., None]).flatten(1))
        at += width // 2 + width // 16
    return torch.cat(parts, 1), scale


def read_v(pool: Pool, slots: torch.Tensor) -> torch.Tensor:
    """Factored V̂ ``[n, 512]`` float32 of shadow rows (nvfp4: whole 16-token blocks)."""
    lay = pool.layout
    _, _, vh = lay.views(pool.shadow)
    if lay.v_shared:
        return read_k(pool, slots)[0][:, :D1]
    assert vh is not None
    rows = vh.reshape(-1, vh.shape[-1])[slots]
    if lay.storage == "fp16":
        return rows.float()
    if lay.v_format == "fp8":
        return _e4m3(rows)
    vals, sb = _nvfp4_unpack(rows, D1)  # sb: [n, 32], row r of a block: features 32r..
    blocks = sb.view(-1, 16 * (D1 // 16))  # [n / 16, 512]
    return (vals.view(-1, 16, D1) * blocks[:, None, :]).view(-1, D1)


def check_contents(pool: Pool) -> None:
    """Every written token's K̂ and every complete block's V̂ against mla_formats, bitwise.

    On the CPU (a copy of a GPU pool): mla_formats on CUDA divides by a Python
    scalar through its reciprocal, which is not the rounded division of
    docs/numerics.md "Formats and scales".
    """
    pool = pool.on_cpu()
    q = pool.quant
    for b, length in enumerate(pool.lens):
        if length == 0:
            continue
        slots = pool.slots_of(b)
        latent = pool.gather_rows(slots).float()
        if not q.k.is_identity:
            want, gs = qdq_factored(latent, q.k, axis=1)
            got, scale = read_k(pool, slots)
            assert torch.equal(got, want), f"K̂ of sequence {b} differs"
            if q.k.is_dynamic:
                assert scale is not None and torch.equal(scale, gs[:, 0]), "K scales differ"
        if not q.v.is_identity:
            want, _ = qdq_factored(latent[:, :D1], q.v, axis=0, pad=True)
            done = length - length % 16 if q.v.format.name == "nvfp4" else length
            got = read_v(pool, slots[:done])
            assert torch.equal(got, want[:done]), f"V̂ of sequence {b} differs"


# ------------------------------------------------------------------ decode comparisons


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    o, r = out.double(), ref.double()
    return (o - r).abs().amax(-1) / r.abs().amax(-1).clamp_min(1e-3)


def q_for(pool: Pool, heads: int = 4) -> torch.Tensor:
    return (torch.randn(pool.batch, heads, D, generator=pool.g) * 0.5).half()


def check_decode(
    pool: Pool,
    q: torch.Tensor,
    *,
    splits: int = 2,
    same_tiles: bool = True,
    cfg: DecodeConfig | None = None,
    want: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_shadow against decode: bit-identical with equal tiles, else within bounds.

    ``want``: on-read decode's ``(out, lse)`` for these arguments, from an earlier
    call (computed here when None); returned for the next call on the same pool.
    """
    seq = pool.seq_lens()
    kw: dict[str, Any] = {"softmax_scale": SCALE, "quant": pool.quant, "num_splits": splits}
    cfg = cfg or DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2)
    if want is None:
        want = decode(q, pool.cache, pool.table, seq, config=cfg, **kw)
    if same_tiles:
        got = decode_shadow(
            q,
            pool.cache,
            pool.shadow,
            pool.table,
            seq,
            storage=pool.storage,
            config=cfg,
            **kw,
        )
        assert torch.equal(got[0], want[0]), "out differs from on-read decode"
        assert torch.equal(got[1], want[1]), "lse differs from on-read decode"
    else:
        got = decode_shadow(q, pool.cache, pool.shadow, pool.table, seq, storage=pool.storage, **kw)
        assert torch.isfinite(got[0]).all()
        assert torch.equal(torch.isinf(got[1]), torch.isinf(want[1]))
        full = ~torch.isinf(want[1])
        assert (got[1][full] - want[1][full]).abs().max().item() <= 1e-6
        assert row_errors(got[0][full], want[0][full]).max().item() <= 1e-3
    return want


def set_tail_form(monkeypatch: Any, tail_loop: bool) -> list[bool]:
    """Make ``decode_shadow`` run its tail tile as a loop (True) or peeled (False).

    Returns a list that gets one entry per time the policy is asked: a check that
    the launch really took the form under test.
    """
    asked: list[bool] = []

    def form(block_h: int, v_tail: bool) -> bool:
        asked.append(tail_loop)
        return tail_loop

    monkeypatch.setattr(shadow_module, "_tail_loop", form)
    return asked


NVFP4 = AttentionQuant.uniform("nvfp4")
STORAGES = ("fp16", "packed")


def same_raw_cache(a: Pool, b: Pool) -> bool:
    """Whether two pools hold the same raw rows (NaN where unwritten) and table."""
    return torch.equal(a.cache.nan_to_num(7.0), b.cache.nan_to_num(7.0)) and torch.equal(
        a.table, b.table
    )


def test_growth_across_block_bounds_one_token_at_a_time() -> None:
    """Ragged sequences (14, 30, 0, 47 tokens) grow one token a step across 16-token
    block bounds (which are 16-slot page bounds too); decode matches on-read after
    every step: a block one short of full, just full, and the next one opened.

    Both storages, grown from one seed: the same raw rows, so one on-read decode
    a step serves both."""
    pools = [Pool(NVFP4, storage, page=16, max_len=64, batch=4, seed=1) for storage in STORAGES]
    for pool in pools:
        pool.append([14, 30, 0, 47])
        check_contents(pool)
    qs = [q_for(pool) for pool in pools]
    assert torch.equal(qs[0], qs[1])
    for _ in range(3):
        want = None
        for pool in pools:
            pool.append([1, 1, 1, 1], pad=1)
        assert same_raw_cache(*pools)
        for pool in pools:
            want = check_decode(pool, qs[0], want=want)
    for pool in pools:
        check_contents(pool)
        assert pool.lens == [17, 33, 3, 50]


RECIPES = {
    "nvfp4-page64": (NVFP4, 64),
    "fp8-shared": (AttentionQuant.uniform("fp8"), 16),
    "kdyn-nvfp4-vfp8": (
        AttentionQuant(q="fp8", k=OperandQuant("nvfp4", "dynamic"), p="nvfp4", v="fp8"),
        64,
    ),
    "kdyn-fp8-vnvfp4": (AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="nvfp4", p="fp8"), 16),
    "calibrated": (
        AttentionQuant(
            q=OperandQuant("nvfp4", 12.0),
            k=OperandQuant("fp8", 5.0),
            v=OperandQuant("nvfp4", 100.0),
            p="nvfp4",
        ),
        16,
    ),
    "k-only": (AttentionQuant(q="nvfp4", k="nvfp4"), 16),
    "v-only": (AttentionQuant(v="nvfp4", p="fp8"), 64),
}


@pytest.mark.parametrize(
    ("recipe", "storages"),
    [
        ("nvfp4-page64", STORAGES),
        ("fp8-shared", STORAGES),
        ("kdyn-nvfp4-vfp8", ("packed",)),
        ("kdyn-fp8-vnvfp4", ("fp16",)),
        ("calibrated", ("packed",)),
        ("k-only", ("fp16",)),
        ("v-only", ("packed",)),
    ],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_recipes_prefill_then_decode_steps(recipe: str, storages: tuple[str, ...]) -> None:
    """Chunked prefill, then two decode steps: contents bitwise, decode bit-identical.

    Storages of a recipe grown from one seed hold the same raw rows: one on-read
    decode serves them all."""
    quant, page = RECIPES[recipe]
    want = None
    pools: list[Pool] = []
    for storage in storages:
        pool = Pool(quant, storage, page=page, max_len=96, batch=3, seed=2)
        pool.append([20, 0, 33])
        pool.append([14, 31, 0])
        pool.append([1, 1, 1])
        pool.append([1, 0, 1])
        pools.append(pool)
        assert same_raw_cache(pools[0], pool)
        check_contents(pool)
        want = check_decode(pool, q_for(pool), splits=2, want=want)


TAIL_LENGTHS = [*range(1, 18), 31, 32, 48, 64, 65, 79, 96, 127, 128, 143, 150, 192]


@pytest.mark.parametrize(
    ("recipe", "page", "block_n", "splits"),
    [
        ("nvfp4-page64", 64, 64, 3),  # 32-token tiles: kdyn-fp8-vnvfp4 (V nvfp4) below
        ("fp8-shared", 16, 64, 3),
        ("kdyn-fp8-vnvfp4", 16, 32, 3),
    ],
)
def test_tail_tile_lengths(
    recipe: str, page: int, block_n: int, splits: int, monkeypatch: Any
) -> None:
    """Every tail shape, in both forms of the tail tile (peeled, or a loop of 0 or 1).

    Lengths 1 to 17 (an open block alone, a full block, one token past it),
    multiples of 16 and of the tile (no open block, or no tail tile at all), and
    tails behind split bounds (64-token multiples) with 2 and 3 active splits; pages of
    16 (a tile over several pages) and 64. Both forms against one on-read decode of
    one pool (the form only changes ``decode_shadow``): bit-identical.
    """
    quant, _ = RECIPES[recipe]
    lens = TAIL_LENGTHS
    pool = Pool(quant, "fp16", page=page, max_len=max(lens), batch=len(lens), seed=7)
    pool.append([n - 1 for n in lens])  # a prefill, then one decode step
    pool.append([1] * len(lens), pad=1)
    assert pool.lens == lens
    cfg = DecodeConfig(block_h=16, block_n=block_n, num_warps=4, num_stages=2)
    q = q_for(pool)
    want = None
    for tail_loop in (False, True):
        asked = set_tail_form(monkeypatch, tail_loop)
        want = check_decode(pool, q, splits=splits, cfg=cfg, want=want)
        assert asked, "decode_shadow did not ask for the tail form"


def test_tail_tile_wide_head_group(monkeypatch: Any) -> None:
    """64 heads a program (the H = 128 tiles), ragged tails, both tail forms (against
    one on-read decode)."""
    pool = Pool(NVFP4, "fp16", page=64, max_len=140, batch=3, seed=8)
    pool.append([63, 139, 15])
    pool.append([1, 1, 1], pad=0)
    cfg = DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2)
    q = q_for(pool, heads=40)
    want = None
    for tail_loop in (False, True):
        asked = set_tail_form(monkeypatch, tail_loop)
        want = check_decode(pool, q, splits=2, cfg=cfg, want=want)
        assert asked, "decode_shadow did not ask for the tail form"


def test_default_tiles_are_on_read_bits() -> None:
    """decode_shadow's default tiles, given to on-read decode too: bit-identical.

    Both storages of a recipe from one seed hold the same raw rows: one on-read
    decode serves both where their default tiles agree (nvfp4)."""
    for quant in (AttentionQuant.uniform("fp8"), NVFP4):
        wants: dict[DecodeConfig, tuple[torch.Tensor, torch.Tensor]] = {}
        pools: list[Pool] = []
        for storage in STORAGES:
            pool = Pool(quant, storage, page=64, max_len=100, batch=2, seed=9)
            pool.append([70, 99])
            pool.append([1, 1])
            pools.append(pool)
            assert same_raw_cache(pools[0], pool)
            cfg = shadow_decode_config(4, quant, storage)
            wants[cfg] = check_decode(pool, q_for(pool), splits=2, cfg=cfg, want=wants.get(cfg))


HOPPER_SMEM = 232448  # bytes of shared memory one Hopper program may use (227 KiB)


@pytest.mark.parametrize(
    "quant",
    [
        AttentionQuant.uniform("fp8"),
        NVFP4,
        AttentionQuant(k="nvfp4"),
        AttentionQuant(k="nvfp4", v="fp8"),
        AttentionQuant(v="nvfp4"),
    ],
    ids=["fp8-shared", "nvfp4", "k-only", "nvfp4-fp8", "v-only"],
)
def test_default_config_is_the_largest_tile_that_fits(quant: AttentionQuant) -> None:
    """64 heads a program (wgmma): q plus ``num_stages`` tiles of 16-bit K̂ (and V̂ when
    they come from different rows) fit in shared memory; a tile twice as long would
    not. Compiled for sm_90a, these sizes are what ptxas reports (ptx_report.py)."""
    cfg = shadow_decode_config(128, quant)
    assert cfg.block_h == 64 and cfg.num_warps == 8
    two_tiles = not shadow_module._v_shared(quant.k, quant.v)
    per_token = 2 * 576 + (2 * 512 if two_tiles else 0)

    def smem(block_n: int) -> int:
        return cfg.block_h * 576 * 2 + cfg.num_stages * block_n * per_token

    assert cfg.num_stages >= 2, "a single stage does not overlap loads with math"
    assert smem(cfg.block_n) <= HOPPER_SMEM
    assert cfg.block_n == 64 or smem(2 * cfg.block_n) > HOPPER_SMEM


def test_default_config_reads_like_decode_where_only_k_hat_is_read() -> None:
    """fp8 K and V with one scale read K̂ alone: quant none's tiles, any head count.
    The packed storage decodes codes to float32 in registers: never longer tiles."""
    fp8 = AttentionQuant.uniform("fp8")
    for heads in (16, 128):
        assert shadow_decode_config(heads, fp8) == decode_config(heads, None)
        for quant in (fp8, NVFP4):
            packed = shadow_decode_config(heads, quant, "packed")
            assert packed.block_n <= shadow_decode_config(heads, quant).block_n


def test_default_tiles_and_splits_agree() -> None:
    """decode_shadow's own tiles and split policy: equal up to float32 summation order."""
    pool = Pool(NVFP4, "fp16", page=64, max_len=200, batch=2, seed=3)
    pool.append([150, 77])
    pool.append([1, 1])
    check_decode(pool, q_for(pool, heads=20), same_tiles=False, splits=3)


def test_wrong_shadow_is_detected() -> None:
    """One flipped V̂ value, or V quantized at a shifted block origin, fails both checks."""
    pool = Pool(NVFP4, "fp16", page=16, max_len=64, batch=2, seed=4)
    pool.append([40, 45])
    check_contents(pool)
    q = q_for(pool)
    want = check_decode(pool, q)  # the good shadow passes; on-read decode reads no shadow
    good = pool.shadow.clone()
    _, _, vh = pool.layout.views(pool.shadow)
    assert vh is not None
    slot = int(pool.slots_of(0)[5])
    vh.view(-1, D1)[slot, 7] = -vh.view(-1, D1)[slot, 7] + 0.5
    with pytest.raises(AssertionError, match="V̂"):
        check_contents(pool)
    with pytest.raises(AssertionError, match="out differs"):
        check_decode(pool, q, want=want)
    # V̂ of sequence 1 quantized with blocks starting at position 8
    pool.shadow.copy_(good)
    slots = pool.slots_of(1)
    latent = pool.gather_rows(slots).float()[:, :D1]
    shifted, _ = qdq_factored(latent, "nvfp4", axis=0, offset=8, pad=True)
    vh.view(-1, D1)[slots[:16]] = shifted[:16].half()
    with pytest.raises(AssertionError, match="V̂ of sequence 1"):
        check_contents(pool)
    with pytest.raises(AssertionError, match="out differs"):
        check_decode(pool, q, want=want)
    pool.shadow.copy_(good)
    check_contents(pool)


def test_shadow_in_a_combined_allocation() -> None:
    """Raw latent and shadow as two strided views of one uint8 pool (one row per token)."""
    quant = AttentionQuant(q="nvfp4", k="nvfp4", p="nvfp4", v="fp8")
    lay = shadow_layout(quant, storage="packed")
    raw_bytes = D * 2
    blocks, page = 6, 16
    big = torch.full((blocks, page, raw_bytes + lay.token_bytes), 0xFF, dtype=torch.uint8)
    cache = big[..., :raw_bytes].view(torch.float16)
    shadow = big[..., raw_bytes:]
    assert cache.stride(1) == (raw_bytes + lay.token_bytes) // 2
    g = torch.Generator().manual_seed(5)
    kvc = torch.randn(37, D1, generator=g).half()
    kpe = torch.randn(37, D2, generator=g).half()
    table = torch.tensor([[4, 0, 2]], dtype=torch.int32)
    pos = torch.arange(37)
    slots = table[0, pos // page].long() * page + pos % page
    update_cache(kvc, kpe, cache, slots, shadow, quant=quant, storage="packed")
    q = (torch.randn(1, 4, D, generator=g) * 0.5).half()
    seq = torch.tensor([37], dtype=torch.int32)
    cfg = DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=2)
    want = decode(q, cache, table, seq, softmax_scale=SCALE, quant=quant, config=cfg)
    got = decode_shadow(
        q, cache, shadow, table, seq, softmax_scale=SCALE, quant=quant, storage="packed", config=cfg
    )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_empty_rows_and_batch() -> None:
    pool = Pool(NVFP4, "fp16", page=16, max_len=32, batch=2, seed=6)
    pool.append([0, 9])
    q = q_for(pool)
    out, lse = decode_shadow(
        q, pool.cache, pool.shadow, pool.table, pool.seq_lens(), softmax_scale=SCALE, quant=NVFP4
    )
    assert (out[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(out).all()
    out, lse = decode_shadow(
        q[:0], pool.cache, pool.shadow, pool.table[:0], pool.seq_lens()[:0], softmax_scale=SCALE,
        quant=NVFP4,
    )  # fmt: skip
    assert out.shape == (0, 4, D1) and lse.shape == (0, 4)
    # an update with no tokens, or only skipped ones, writes nothing
    before = (pool.cache.clone(), pool.shadow.clone())
    empty = torch.empty(0, D1, dtype=torch.float16)
    update_cache(
        empty,
        empty[:, :D2],
        pool.cache,
        torch.empty(0, dtype=torch.int64),
        pool.shadow,
        quant=NVFP4,
    )
    skip = torch.full((3,), -1, dtype=torch.int64)
    update_cache(torch.zeros(3, D1), torch.zeros(3, D2), pool.cache, skip, pool.shadow, quant=NVFP4)
    assert torch.equal(pool.cache.nan_to_num(7.0), before[0].nan_to_num(7.0))
    assert torch.equal(pool.shadow, before[1])


# ------------------------------------------------------------------ layout


@pytest.mark.parametrize(
    ("quant", "storage", "token", "payload"),
    [
        (NVFP4, "fp16", 2176, 2176),
        (NVFP4, "packed", 624, 612),
        (AttentionQuant.uniform("fp8"), "fp16", 1152, 1152),
        (AttentionQuant.uniform("fp8"), "packed", 576, 576),
        (AttentionQuant(k="nvfp4", v="fp8"), "packed", 848, 836),
        (AttentionQuant(k=OperandQuant("nvfp4", "dynamic"), v="nvfp4"), "fp16", 2192, 2180),
        (AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="fp8"), "packed", 1104, 1092),
        (AttentionQuant(q="nvfp4", p="nvfp4"), "fp16", 0, 0),
    ],
)
def test_layout_bytes(quant: AttentionQuant, storage: str, token: int, payload: int) -> None:
    lay = shadow_layout(quant, storage=storage)
    assert (lay.token_bytes, lay.payload_bytes) == (token, payload)
    assert lay.shape(10, 64) == (10, 64, token) and lay.nbytes(10, 64) == 640 * token
    for off, size in ((lay.k_offset, lay.k_bytes), (lay.v_offset, lay.v_bytes)):
        assert off % 16 == 0 and off + size <= token
    assert lay.v_shared == (
        quant.v.format.name == "fp8" and quant.k.format.name == "fp8" and not quant.k.is_dynamic
    )


# ------------------------------------------------------------------ validation


def _update_calls() -> list[tuple[str, dict[str, object]]]:
    cache = torch.zeros(4, 16, D, dtype=torch.float16)
    shadow = allocate_shadow(4, 16, NVFP4)
    kvc = torch.zeros(3, D1, dtype=torch.float16)
    kpe = torch.zeros(3, D2, dtype=torch.float16)
    slots = torch.tensor([0, 1, -1])
    base: dict[str, object] = {
        "kv_c": kvc, "k_pe": kpe, "kv_cache": cache, "slot_mapping": slots, "shadow": shadow,
        "quant": NVFP4,
    }  # fmt: skip
    cases: list[tuple[str, dict[str, object]]] = [
        ("kv_c", {"kv_c": kvc.int()}),
        ("kv_c", {"kv_c": kvc[:, :500]}),
        ("kv_c", {"kv_c": kvc.t().contiguous().t()}),
        ("k_pe", {"k_pe": kpe[:2]}),
        ("k_pe", {"k_pe": kpe[None]}),
        ("kv_cache", {"kv_cache": cache.float()}),
        ("kv_cache", {"kv_cache": torch.zeros(4, 8, D, dtype=torch.float16)}),
        ("kv_cache", {"kv_cache": cache[..., :560]}),
        ("slot_mapping", {"slot_mapping": slots.float()}),
        ("slot_mapping", {"slot_mapping": torch.tensor([0, 1, 64])}),
        ("slot_mapping", {"slot_mapping": torch.tensor([0, 1, 2, 3])}),
        ("slot_mapping", {"slot_mapping": torch.tensor([-2])}),
        ("shadow", {"shadow": shadow[..., :100]}),
        ("shadow", {"shadow": shadow.view(torch.float16)}),
        ("shadow", {"shadow": allocate_shadow(4, 16, NVFP4, storage="packed")}),
        ("shadow", {"shadow": allocate_shadow(2, 16, NVFP4)}),
        ("quant", {"quant": "nvfp4"}),
        ("storage", {"storage": "fp8"}),
    ]
    return [(name, {**base, **change}) for name, change in cases]


@pytest.mark.parametrize(("argument", "kwargs"), _update_calls())
def test_update_validation(argument: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{argument}"):
        update_cache(**kwargs)  # type: ignore[arg-type]


def _decode_calls() -> list[tuple[str, dict[str, object]]]:
    cache = torch.zeros(4, 16, D, dtype=torch.float16)
    shadow = allocate_shadow(4, 16, NVFP4)
    q = torch.zeros(2, 4, D, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    seq = torch.tensor([3, 20], dtype=torch.int32)
    base: dict[str, object] = {
        "q": q, "kv_cache": cache, "shadow": shadow, "block_table": table, "seq_lens": seq,
        "softmax_scale": SCALE, "quant": NVFP4,
    }  # fmt: skip
    cases: list[tuple[str, dict[str, object]]] = [
        ("q", {"q": q.float()}),
        ("shadow", {"kv_cache": torch.zeros(2, 32, D, dtype=torch.float16)}),
        ("kv_cache", {"kv_cache": torch.zeros(4, 8, D, dtype=torch.float16)}),
        ("shadow", {"shadow": allocate_shadow(4, 16, AttentionQuant.uniform("fp8"))}),
        ("shadow", {"shadow": None}),
        ("shadow", {"shadow": torch.zeros(4, 16, 2184, dtype=torch.uint8)[..., 8:]}),
        ("quant", {"quant": None}),
        ("storage", {"storage": "int4"}),
        ("seq_lens", {"seq_lens": torch.tensor([3, 40], dtype=torch.int32)}),
        ("block_table", {"block_table": torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)}),
        ("num_splits", {"num_splits": 0}),
    ]
    return [(name, {**base, **change}) for name, change in cases]


@pytest.mark.parametrize(("argument", "kwargs"), _decode_calls())
def test_decode_validation(argument: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=f"^{argument}"):
        decode_shadow(**kwargs)  # type: ignore[arg-type]


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match=r"^quant"):
        shadow_layout("nvfp4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^storage"):
        shadow_layout(NVFP4, storage="bits")
    with pytest.raises(ValueError, match=r"^kv_lora_rank"):
        shadow_layout(NVFP4, kv_lora_rank=500)
    with pytest.raises(ValueError, match=r"^page_size"):
        allocate_shadow(4, 24, NVFP4)
    assert math.prod(allocate_shadow(3, 16, NVFP4).shape) == 3 * 16 * 2176


def test_shadow_of_other_widths_names_the_widths_not_the_recipe() -> None:
    """A shadow stamped for other ``kv_lora_rank``/``rope_dim`` than the call's is refused
    naming ``shadow`` and both widths, not the recipe (which is the same)."""
    quant = AttentionQuant.uniform("fp8")
    shadow = allocate_shadow(2, 16, quant, kv_lora_rank=256, rope_dim=32)
    wide = shadow_layout(quant, kv_lora_rank=512, rope_dim=64)
    with pytest.raises(ValueError, match=r"^shadow: allocated for kv_lora_rank 256 and "
                       r"rope_dim 32; this call has kv_lora_rank 512 and rope_dim 64"):  # fmt: skip
        shadow_module._check_stamp(shadow, wide, "quant")


def test_allocate_shadow_on_cuda_without_cuda_names_the_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(ValueError, match=r"^device: 'cuda', but CUDA is not available"):
        allocate_shadow(2, 16, AttentionQuant.uniform("fp8"), device="cuda")
    with pytest.raises(ValueError, match=r"^device: not a torch device"):
        allocate_shadow(2, 16, AttentionQuant.uniform("fp8"), device="tpu:x")


def test_recipe_check_holds_through_views_of_one_allocation() -> None:
    """The recipe a shadow was written with is checked through any view that starts where
    it starts (``view``, a prefix of its blocks); shadows at other addresses of one buffer
    (an engine's per-layer views) keep recipes of their own."""
    fp8 = AttentionQuant.uniform("fp8")
    scaled = AttentionQuant(k=OperandQuant("fp8", amax=1344.0), v=OperandQuant("fp8", amax=1344.0))
    cache = torch.zeros(4, 16, 512 + 64, dtype=torch.float16)
    latent = torch.zeros(1, 512 + 64, dtype=torch.float16)
    slots = torch.zeros(1, dtype=torch.int64)

    def write(shadow: torch.Tensor, quant: AttentionQuant) -> None:
        update_cache(latent[:, :512], latent[:, 512:], cache[: shadow.shape[0]], slots, shadow,
                     quant=quant)  # fmt: skip

    shadow = allocate_shadow(4, 16, fp8)
    for view in (shadow.view(4, 16, -1), shadow[:2]):
        with pytest.raises(ValueError, match=r"^quant: this shadow holds K̂/V̂ written for"):
            write(view, scaled)
        write(view, fp8)
    buffer = torch.zeros(8, 16, shadow.shape[2], dtype=torch.uint8)
    write(buffer[:4], fp8)
    write(buffer[4:], scaled)  # another layer's shadow in the same buffer
    with pytest.raises(ValueError, match=r"^quant: "):
        write(buffer[4:], fp8)


# ------------------------------------------------------------------ write order

# Small widths: these tests make many calls through the interpreter.
OR, OROPE = 32, 16
OD = OR + OROPE
ORDER_QUANTS = {
    "nvfp4": NVFP4,
    "kdyn-fp8-vnvfp4": AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="nvfp4", p="fp8"),
}


def _order_cache(
    blocks: int, page: int, quant: AttentionQuant, storage: str = "fp16"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A raw cache of NaN rows (unwritten rows show if read) and its zeroed shadow."""
    cache = torch.full((blocks, page, OD), float("nan"), dtype=torch.float16)
    shadow = allocate_shadow(blocks, page, quant, kv_lora_rank=OR, rope_dim=OROPE, storage=storage)
    return cache, shadow


def _write(
    cache: torch.Tensor, shadow: torch.Tensor, slots: list[int], quant: AttentionQuant, seed: int,
    storage: str = "fp16", check_values: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """One ``update_cache`` call of random rows to ``slots``; returns the rows ``[T, OD]``."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(len(slots), OD, generator=g).half()
    update_cache(
        rows[:, :OR], rows[:, OR:], cache, torch.tensor(slots, dtype=torch.int64), shadow,
        quant=quant, storage=storage, check_values=check_values,
    )  # fmt: skip
    return rows


def first_misorder(slots: list[int], page: int) -> str | None:
    """What ``update_cache`` must refuse in one call's ``slot_mapping`` (None: nothing).

    The rule, written as a loop: a slot given twice; else the first entry (``-1`` aside)
    that is not one slot past the entry before it on its page."""
    used = [s for s in slots if s >= 0]
    twice = sorted({s for s in used if used.count(s) > 1})
    if twice:
        return f"slot {twice[0]} appears more than once"
    last: dict[int, int] = {}
    for i, s in enumerate(slots):
        if s < 0:
            continue
        if s // page in last and s != last[s // page] + 1:
            return f"entry {i} writes slot {s} (position {s % page} of page {s // page})"
        last[s // page] = s
    return None


@st.composite
def in_order_call(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """``(page, blocks, slot_mapping)`` of one call that keeps the order: 1 to 3 requests
    on pages of their own, each appending 3 to 40 tokens from a drawn position (crossing
    16-token blocks and pages), requests in a drawn order, ``-1`` entries anywhere."""
    page = draw(st.sampled_from([16, 32]))
    n = draw(st.integers(1, 3))
    per = -(-(2 * page + 40) // page)
    blocks = n * per + 1
    pages = draw(st.permutations(range(blocks)))
    slots: list[int] = []
    for r in draw(st.permutations(range(n))):
        start = draw(st.integers(0, 2 * page))
        for pos in range(start, start + draw(st.integers(3, 40))):
            slots.append(pages[r * per + pos // page] * page + pos % page)
    for _ in range(draw(st.integers(0, 2))):
        slots.insert(draw(st.integers(0, len(slots))), -1)
    return page, blocks, slots


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=in_order_call(), how=st.sampled_from(["swap", "gap", "behind", "rewrite"]),
       data=st.data())  # fmt: skip
def test_writes_out_of_position_order_are_refused(
    call: tuple[int, int, list[int]], how: str, data: st.DataObject
) -> None:
    """One call's writes to a page out of position order (two entries swapped), with a gap
    (an entry between two others dropped), behind a slot already written (an earlier slot
    of a page, possibly of a block the call completed, after the call's last slot there),
    or a rewrite of a slot the call wrote: ``ValueError`` naming ``slot_mapping`` and the
    offending entry and slot, and the cache and shadow unchanged (checked by default on
    the CPU)."""
    page, blocks, slots = call
    assert first_misorder(slots, page) is None
    runs: dict[int, list[int]] = {}  # page -> the entries writing it, in call order
    for i, s in enumerate(slots):
        if s >= 0:
            runs.setdefault(s // page, []).append(i)
    fits = {
        "swap": lambda run: len(run) >= 2,
        "gap": lambda run: len(run) >= 3,
        "behind": lambda run: slots[run[0]] % page > 0,
        "rewrite": lambda run: True,
    }[how]
    candidates = [run for run in runs.values() if fits(run)]
    if not candidates:
        how, candidates = "rewrite", list(runs.values())
    run = data.draw(st.sampled_from(candidates))
    bad = list(slots)
    if how == "swap":
        i, j = sorted(data.draw(st.lists(st.sampled_from(run), min_size=2, max_size=2,
                                         unique=True)))  # fmt: skip
        bad[i], bad[j] = bad[j], bad[i]
    elif how == "gap":
        del bad[data.draw(st.sampled_from(run[1:-1]))]
    elif how == "behind":
        first = slots[run[0]]
        earlier = data.draw(st.integers(first - first % page, first - 1))
        bad.insert(data.draw(st.integers(run[-1] + 1, len(bad))), earlier)
    else:
        again = slots[data.draw(st.sampled_from(run))]
        bad.insert(data.draw(st.integers(run[-1] + 1, len(bad))), again)
    want = first_misorder(bad, page)
    assert want is not None
    cache, shadow = _order_cache(blocks, page, NVFP4)
    shadow.random_(0, 256, generator=torch.Generator().manual_seed(len(bad)))
    before = (cache.clone(), shadow.clone())
    with pytest.raises(ValueError, match="^slot_mapping: " + re.escape(want)):
        _write(cache, shadow, bad, NVFP4, seed=0)
    assert torch.equal(cache.nan_to_num(7.0), before[0].nan_to_num(7.0)), "a refused call wrote"
    assert torch.equal(shadow, before[1]), "a refused call wrote into the shadow"


def test_unchecked_writes_are_not_looked_at() -> None:
    """Unchecked, the order is not looked at: one call's tokens in another order (the rows
    with them) write what the call in position order writes, bit for bit."""
    slots = [*range(5, 37), -1, 40, 41]
    order = torch.randperm(len(slots), generator=torch.Generator().manual_seed(3)).tolist()
    assert first_misorder([slots[i] for i in order], 16) is not None
    written = []
    for perm in (list(range(len(slots))), order):
        cache, shadow = _order_cache(4, 16, NVFP4)
        rows = torch.randn(len(slots), OD, generator=torch.Generator().manual_seed(1)).half()
        update_cache(
            rows[perm, :OR], rows[perm, OR:], cache, torch.tensor([slots[i] for i in perm]),
            shadow, quant=NVFP4, check_values=False,
        )  # fmt: skip
        written.append((cache.nan_to_num(7.0), shadow))
    assert torch.equal(written[0][0], written[1][0]) and torch.equal(written[0][1], written[1][1])


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page=st.sampled_from([16, 32]),
    chunks=st.lists(st.lists(st.integers(0, 24), min_size=1, max_size=3), min_size=1, max_size=3),
    rollback=st.integers(0, 5),
    recipe=st.sampled_from(list(ORDER_QUANTS)),
    storage=st.sampled_from(STORAGES),
    seed=st.integers(0, 2**16),
)
def test_writes_in_position_order_match_the_reference(
    page: int, chunks: list[list[int]], rollback: int, recipe: str, storage: str, seed: int
) -> None:
    """Requests appended in chunks (one call a round, requests in a shuffled order, chunks
    crossing 16-token blocks and pages), then a speculative rollback of up to 5 tokens
    rewritten with other rows in a later call: every call accepted (checked), every raw row
    the last one written, K̂ and every complete block's V̂ the QDQ of the raw rows bitwise,
    ``decode_shadow`` the reference's result."""
    quant = ORDER_QUANTS[recipe]
    g = torch.Generator().manual_seed(seed)
    lens = [sum(c) for c in chunks]
    per = max(1, -(-max(lens) // page))
    blocks = len(chunks) * per + 1
    table = torch.randperm(blocks, generator=g)[: len(chunks) * per].view(len(chunks), per)
    cache, shadow = _order_cache(blocks, page, quant, storage)
    done = [0] * len(chunks)
    rounds = [[c[k] if k < len(c) else 0 for c in chunks] for k in range(3)]
    back = [min(rollback, n) for n in lens]
    rounds.append(back)  # the rewrite of the rolled back tokens
    for k, counts in enumerate(rounds):
        if k == 3:
            done = [n - b for n, b in zip(lens, back, strict=True)]
        slots: list[int] = []
        for r in torch.randperm(len(chunks), generator=g).tolist():
            for pos in range(done[r], done[r] + counts[r]):
                slots.append(int(table[r, pos // page]) * page + pos % page)
            done[r] += counts[r]
        slots.insert(int(torch.randint(0, len(slots) + 1, (1,), generator=g)), -1)
        rows = _write(cache, shadow, slots, quant, seed=seed + k, storage=storage)
        keep = torch.tensor(slots) >= 0
        assert torch.equal(cache.view(-1, OD)[torch.tensor(slots)[keep]], rows[keep])
    assert done == lens
    lay = shadow_layout(quant, kv_lora_rank=OR, rope_dim=OROPE, storage=storage)
    kh, ks, vh = lay.views(shadow)
    for r, n in enumerate(lens):
        pos = torch.arange(n)
        slots_r = table[r, pos // page] * page + pos % page
        latent = cache.view(-1, OD)[slots_r].float()
        k_want, k_gs = qdq_factored(latent, quant.k, axis=1)
        v_want, _ = qdq_factored(latent[:, :OR], quant.v, axis=0, pad=True)
        full = n - n % 16
        assert kh is not None and vh is not None
        if storage == "fp16":
            assert torch.equal(kh.reshape(-1, OD)[slots_r].float(), k_want), "K̂ differs"
            v_got = vh.reshape(-1, OR)[slots_r[:full]].float()
            assert torch.equal(v_got, v_want[:full]), "a complete block's V̂ is stale"
        if ks is not None:
            assert torch.equal(ks.reshape(-1)[slots_r], k_gs[:, 0]), "K scales differ"
    q = (torch.randn(len(chunks), 2, OD, generator=g) * 0.7).half()
    seq = torch.tensor(lens, dtype=torch.int32)
    table = table.to(torch.int32)
    out, lse = decode_shadow(q, cache, shadow, table, seq, softmax_scale=0.2, quant=quant,
                             storage=storage, kv_lora_rank=OR)  # fmt: skip
    ref_out, ref_lse = mla_reference.decode(q, cache, table, seq, softmax_scale=0.2,
                                            kv_lora_rank=OR, quant=quant)  # fmt: skip
    empty = seq == 0
    assert (out[empty] == 0).all() and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(out).all()
    if not bool(empty.all()):
        assert float(row_errors(out[~empty], ref_out[~empty]).max()) < 5e-2
    assert torch.allclose(lse[~empty], ref_lse[~empty].float(), atol=1e-3)
