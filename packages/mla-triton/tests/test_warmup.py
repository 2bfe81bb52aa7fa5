"""``mla_triton.precompile``: what an engine's calls compile is compiled at warmup.

CPU: ``record_keys`` computes Triton's compile keys (for sm_90) without launching;
the keys of a sweep of serving-like calls (built the way vLLM 0.33 builds them:
q as the absorbed pair, block tables and sequence lengths as slices of persistent
buffers, context-chunk offsets as slices of one buffer, the shadow inside the
cache rows) must all be among the keys warmup produced, and a call whose geometry
differs from the warmed one (another block-table width) must not be: the keys see
Triton's int specialization. The split-count enumeration is checked against a
brute force of the policy.

On a GPU (test_warmup_gpu.py): after warmup, a sweep launched for real compiles
nothing new.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

import mla_triton
from mla_formats import AttentionQuant
from mla_triton import allocate_shadow, decode, decode_shadow, prefill, update_cache
from mla_triton.common.splitk import decode_num_splits
from mla_triton.ops.decode.triton import default_config as decode_config
from mla_triton.ops.shadow import shadow_layout
from mla_triton.precompile import (
    compile_only,
    decode_split_counts,
    record_keys,
    warmup_decode,
    warmup_prefill,
    warmup_update_cache,
)

HEADS = 128
RANK, ROPE, NOPE, VDIM = 512, 64, 128, 128
PAGE = 64
SCALE = 192**-0.5
NVFP4 = AttentionQuant.uniform("nvfp4")
KV_ONLY = AttentionQuant(k="nvfp4", v="nvfp4")
FP8 = AttentionQuant.uniform("fp8")


@dataclass
class Engine:
    """The fixed geometry of one engine: its cache rows (raw + shadow) and block table."""

    rows: torch.Tensor  # [blocks, PAGE, width] in the model dtype
    width: int  # block-table entries per request
    max_rows: int
    max_seq_len: int
    quant: AttentionQuant | None
    shadow: bool
    storage: str = "fp16"

    @property
    def raw(self) -> torch.Tensor:
        return self.rows[..., : RANK + ROPE]

    @property
    def shadow_bytes(self) -> torch.Tensor | None:
        if not self.shadow:
            return None
        assert self.quant is not None
        need = shadow_layout(self.quant, storage=self.storage).token_bytes
        return self.rows[..., RANK + ROPE :].view(torch.uint8)[..., :need]


def make_engine(
    quant: AttentionQuant | None,
    shadow: bool,
    *,
    blocks: int,
    width: int,
    max_rows: int,
    max_seq_len: int,
    dtype: torch.dtype,
    device: str,
) -> Engine:
    extra = 0
    if shadow:
        assert quant is not None
        extra = shadow_layout(quant).token_bytes // dtype.itemsize
    rows = torch.zeros(blocks, PAGE, RANK + ROPE + extra, dtype=dtype, device=device)
    return Engine(rows, width, max_rows, max_seq_len, quant, shadow)


def warm(engine: Engine, *, prefill_too: bool = True) -> None:
    """Everything an engine of this geometry warms (as mla_vllm does)."""
    warmup_decode(
        engine.raw,
        num_heads=HEADS,
        pages_per_row=engine.width,
        max_rows=engine.max_rows,
        max_seq_len=engine.max_seq_len,
        softmax_scale=SCALE,
        quant=engine.quant,
        shadow=engine.shadow_bytes,
        storage=engine.storage,
    )
    shadow = engine.shadow_bytes
    if shadow is not None:
        assert engine.quant is not None
        warmup_update_cache(engine.raw, shadow, quant=engine.quant, storage=engine.storage)
    if prefill_too:
        warmup_prefill(
            num_heads=HEADS,
            head_dim_qk=NOPE + ROPE,
            head_dim_v=VDIM,
            dtype=engine.rows.dtype,
            device=engine.rows.device,
            softmax_scale=SCALE,
            quant=engine.quant,
        )


# ---------------------------------------------------------------------------- serving-like calls


def decode_step(engine: Engine, batch: int, lens: list[int], rng: random.Random) -> None:
    """One decode step as MLAQuantImpl.forward_mqa makes it."""
    device, dtype = engine.rows.device, engine.rows.dtype
    blocks = engine.rows.shape[0]
    q_full = torch.randn(batch + 3, HEADS, NOPE + ROPE, dtype=dtype, device=device)
    q_nope = torch.randn(batch, HEADS, RANK, dtype=dtype, device=device)  # bmm's output
    q_pe = q_full[:batch].split([NOPE, ROPE], dim=-1)[1]
    table_buffer = torch.zeros(engine.max_rows, engine.width, dtype=torch.int32, device=device)
    lens_buffer = torch.zeros(engine.max_rows, dtype=torch.int32, device=device)
    for b, n in enumerate(lens):
        pages = -(-n // PAGE)
        table_buffer[b, :pages] = torch.tensor(
            [rng.randrange(blocks) for _ in range(pages)], dtype=torch.int32
        )
        lens_buffer[b] = n
    table, seq_lens = table_buffer[:batch], lens_buffer[:batch]
    max_seq_len = max(1, min(max(lens), engine.width * PAGE))
    splits = decode_num_splits(
        batch, HEADS, max_seq_len, device=None if device == "cpu" else q_nope.device
    )
    shadow = engine.shadow_bytes
    if shadow is None:
        decode((q_nope, q_pe), engine.raw, table, seq_lens, softmax_scale=SCALE,
               kv_lora_rank=RANK, quant=engine.quant, num_splits=splits,
               max_seq_len=max_seq_len, check_values=False)  # fmt: skip
    else:
        assert engine.quant is not None
        decode_shadow((q_nope, q_pe), engine.raw, shadow, table, seq_lens, softmax_scale=SCALE,
                      quant=engine.quant, storage=engine.storage, kv_lora_rank=RANK,
                      num_splits=splits, max_seq_len=max_seq_len, check_values=False)  # fmt: skip


def cache_write(engine: Engine, tokens: int, rng: random.Random) -> None:
    """One MLAQuantImpl.do_kv_cache_update on the shadow path (vLLM's layouts)."""
    shadow = engine.shadow_bytes
    assert shadow is not None and engine.quant is not None
    device, dtype = engine.rows.device, engine.rows.dtype
    kv_lora = torch.randn(tokens, RANK + ROPE, dtype=dtype, device=device)
    kv_c = torch.randn(tokens, RANK, dtype=dtype, device=device)  # the normed latent
    k_pe = kv_lora[:, RANK:].unsqueeze(1)  # [T, 1, rope], a view
    capacity = engine.rows.shape[0] * PAGE
    slots = torch.tensor(rng.sample(range(capacity), tokens), dtype=torch.int64, device=device)
    update_cache(kv_c, k_pe.reshape(tokens, -1), engine.raw, slots.flatten(), shadow,
                 quant=engine.quant, storage=engine.storage, check_values=False)  # fmt: skip


def prefill_batch(engine: Engine, lengths: list[int], context: list[int] | None) -> None:
    """vLLM's prefill of new tokens (causal) and, with ``context``, two context chunks."""
    device, dtype = engine.rows.device, engine.rows.dtype
    tokens = sum(lengths)
    decodes = 5  # decode tokens come first in vLLM's batch: q is a slice after them
    q = torch.randn(decodes + tokens, HEADS, NOPE + ROPE, dtype=dtype, device=device)[decodes:]
    kv_nope = torch.randn(tokens, HEADS, NOPE + VDIM, dtype=dtype, device=device)
    k_nope, v = kv_nope.split([NOPE, VDIM], dim=-1)
    k_pe = torch.randn(tokens, 1, ROPE, dtype=dtype, device=device)
    k = torch.cat([k_nope, k_pe.expand(-1, HEADS, -1)], dim=-1)
    cu_list = [0]
    for n in lengths:
        cu_list.append(cu_list[-1] + n)
    cu = torch.tensor(cu_list, dtype=torch.int32, device=device)
    longest = max(lengths)
    prefill(q, k, v, cu, cu, softmax_scale=SCALE, causal=True, quant=engine.quant,
            return_lse=context is not None, max_seqlen_q=longest, max_seqlen_k=longest)  # fmt: skip
    if context is None:
        return
    # two chunks over the same requests; each chunk's offsets slice one flat buffer
    flat_q: list[int] = []
    flat_k: list[int] = []
    for _ in range(2):
        flat_q += cu_list
        ctx = [0]
        for n in context:
            ctx.append(ctx[-1] + n)
        flat_k += ctx
    q_buffer = torch.tensor(flat_q, dtype=torch.int32, device=device)
    k_buffer = torch.tensor(flat_k, dtype=torch.int32, device=device)
    ctx_tokens = sum(context)
    kv_ctx = torch.randn(ctx_tokens, HEADS, NOPE + VDIM, dtype=dtype, device=device)
    k_nope_c, v_c = kv_ctx.split([NOPE, VDIM], dim=-1)
    k_c = torch.cat(
        [k_nope_c, torch.randn(ctx_tokens, HEADS, ROPE, dtype=dtype, device=device)], -1
    )
    step = len(lengths) + 1
    for chunk in range(2):
        boundary = slice(chunk * step, (chunk + 1) * step)
        prefill(q, k_c, v_c, q_buffer[boundary], k_buffer[boundary], softmax_scale=SCALE,
                causal=False, quant=engine.quant, return_lse=True, max_seqlen_q=longest,
                max_seqlen_k=max(context))  # fmt: skip


def sweep(engine: Engine, rng: random.Random, *, prefill_too: bool = True) -> None:
    """Serving-like calls: decode batches of many sizes and lengths, prefills, writes."""
    longest = min(engine.max_seq_len, engine.width * PAGE)
    for batch in (1, 2, 3, 7, 16, 17, 33, engine.max_rows):
        for top in (1, 200, 600, 1500, longest):
            lens = [rng.randrange(1, top + 1) for _ in range(batch)]
            lens[0] = top
            decode_step(engine, batch, lens, rng)
    if engine.shadow:
        for tokens in (1, 2, 15, 16, 33, 64, 100):
            cache_write(engine, tokens, rng)
    if prefill_too:
        for lengths, context in (
            ([2], None),
            ([5, 9], None),
            ([31], [40]),
            ([32], [64, 3]),
            ([40, 7], [100, 1]),
            ([300], None),
            ([129, 64, 2], [33, 500, 16]),
        ):
            prefill_batch(engine, lengths, context)


# ---------------------------------------------------------------------------- CPU


def test_split_counts_match_brute_force() -> None:
    """The enumeration equals the policy over every (rows, max_seq_len) of a grid."""
    for heads, rows, longest in ((128, 9, 3000), (16, 5, 2100), (128, 70, 700)):
        block_h = decode_config(heads).block_h
        brute = {
            decode_num_splits(b, heads, n, block_h=block_h)
            for b in range(1, rows + 1)
            for n in range(1, longest + 1)
        }
        assert decode_split_counts(rows, heads, longest, block_h=block_h) == tuple(sorted(brute))


def test_split_counts_reach_the_policy_cap() -> None:
    """At 32k context one request takes up to 60 splits at 128 heads (two programs: 120
    of 132 SMs is one wave 91% full) and the cap of 64 at 16 heads (one program): every
    count from 1 up is warmed."""
    counts = decode_split_counts(64, 128, 32768 + 256, block_h=decode_config(128).block_h)
    assert counts == tuple(range(1, 61))
    counts = decode_split_counts(64, 16, 32768 + 256, block_h=decode_config(16).block_h)
    assert counts == tuple(range(1, 65))


def test_bad_arguments_are_refused_before_any_launch() -> None:
    cache = torch.zeros(2, PAGE, RANK + ROPE, dtype=torch.float16)
    with pytest.raises(ValueError, match="pages_per_row"):
        warmup_decode(cache, num_heads=HEADS, pages_per_row=0, max_rows=1, max_seq_len=1,
                      softmax_scale=SCALE)  # fmt: skip
    shadow = torch.zeros(2, PAGE, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="quant"):
        warmup_decode(cache, num_heads=HEADS, pages_per_row=1, max_rows=1, max_seq_len=1,
                      softmax_scale=SCALE, shadow=shadow)  # fmt: skip
    with pytest.raises(ValueError, match="max_rows"):
        decode_split_counts(0, HEADS, 10, block_h=64)
    with pytest.raises(ValueError, match="threads"), compile_only(threads=0):
        pass


def _keys(action: Callable[[], None]) -> set[tuple[str, str]]:
    with record_keys() as keys:
        action()
    return set(keys)


def decode_keys(quant: AttentionQuant | None) -> tuple[set[tuple[str, str]], ...]:
    """``(warmed, served)``: the keys an on-read engine's decode warm-up records and those
    a decode sweep launches (37 blocks, width 35, 40 rows, 2176 tokens, float16, CPU)."""
    engine = make_engine(quant, False, blocks=37, width=35, max_rows=40, max_seq_len=2176,
                         dtype=torch.float16, device="cpu")  # fmt: skip
    warmed = _keys(lambda: warm(engine, prefill_too=False))
    return warmed, _keys(lambda: sweep(engine, random.Random(0), prefill_too=False))


CPU_ENGINES = {
    "nvfp4-on-read": (NVFP4, False),
    "nvfp4-shadow": (NVFP4, True),
    "kv-only-shadow": (KV_ONLY, True),
    "none": (None, False),
}


@pytest.mark.parametrize("name", list(CPU_ENGINES))
def test_warmup_covers_every_serving_key(name: str) -> None:
    quant, shadow = CPU_ENGINES[name]
    engine = make_engine(quant, shadow, blocks=37, width=35, max_rows=40, max_seq_len=2176,
                         dtype=torch.float16, device="cpu")  # fmt: skip
    warmed = _keys(lambda: warm(engine))
    served = _keys(lambda: sweep(engine, random.Random(0)))
    kernels = {kernel.rsplit(".", 1)[1] for kernel, _ in served}
    assert "prefill_fwd_kernel" in kernels and any("split" in k for k in kernels), kernels
    missing = served - warmed
    assert not missing, f"{len(missing)} serving keys not warmed: {sorted(missing)[:3]}"
    # 8 split counts reachable (1 .. 2176 // 256); the split kernel is keyed twice (one
    # split, several: the count is a runtime argument), the merge once
    assert len(decode_split_counts(40, HEADS, 2176, block_h=64)) == 8
    split_keys = {key for kernel, key in warmed if kernel.endswith("split_kernel")}
    merge_keys = {key for kernel, key in warmed if kernel.endswith("merge_kernel")}
    assert len(split_keys) == 2 and len(merge_keys) == 1, (split_keys, merge_keys)


def test_split_count_is_not_a_compile_key() -> None:
    """Every split count from 2 to 64 gives the split kernels (on read, shadow) and the
    merge kernel one compile key each; one split another (its epilogue writes out)."""
    cache = torch.zeros(3, PAGE, RANK + ROPE, dtype=torch.float16)
    shadow = allocate_shadow(3, PAGE, NVFP4)
    q = torch.zeros(2, HEADS, RANK + ROPE, dtype=torch.float16)
    table = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([5, 100], dtype=torch.int32)

    def calls(counts: range) -> Callable[[], None]:
        def run() -> None:
            for n in counts:
                decode(q, cache, table, lens, softmax_scale=SCALE, quant=NVFP4, num_splits=n)
                decode_shadow(q, cache, shadow, table, lens, softmax_scale=SCALE, quant=NVFP4,
                              num_splits=n)  # fmt: skip

        return run

    several, one = _keys(calls(range(2, 65))), _keys(calls(range(1, 2)))
    for name in ("decode_split_kernel", "shadow_decode_split_kernel", "decode_merge_kernel"):
        keys = {key for kernel, key in several if kernel.rsplit(".", 1)[1] == name}
        assert len(keys) == 1, (name, len(keys))
    split_one = {key for kernel, key in one if kernel.endswith("split_kernel")}
    split_several = {key for kernel, key in several if kernel.endswith("split_kernel")}
    assert len(split_one) == 2 and not split_one & split_several


def test_other_geometry_keys_differently() -> None:
    """A block table whose width is another class (16, not 35) keys the split kernel anew.

    (The merge kernel does not read the block table: its keys are shared.)
    """
    engine = make_engine(NVFP4, False, blocks=37, width=35, max_rows=4, max_seq_len=1000,
                         dtype=torch.float16, device="cpu")  # fmt: skip
    warmed = _keys(lambda: warm(engine, prefill_too=False))
    other = make_engine(NVFP4, False, blocks=37, width=16, max_rows=4, max_seq_len=1000,
                        dtype=torch.float16, device="cpu")  # fmt: skip
    served = _keys(lambda: decode_step(other, 2, [100, 900], random.Random(1)))
    split = {item for item in served if item[0].endswith("decode_split_kernel")}
    assert split and not split & warmed


@pytest.mark.parametrize("name", ["nvfp4-on-read", "nvfp4-shadow", "fp8-shadow"])
def test_block_count_is_not_a_compile_key(name: str) -> None:
    """Caches of 1, 37, 64 and 1000 blocks warm the same keys (decode split, merge,
    q and the shadow's write): vLLM's CUDA-graph memory profile runs on a minimal cache
    (64 blocks in the serving benchmark, divisible by 16) before the real one, whose
    block count is of any class; the split kernels take it unspecialized."""
    quant, shadow = (FP8, True) if name.startswith("fp8") else CPU_ENGINES[name]
    keys = []
    for blocks in (1, 37, 64, 1000):
        engine = make_engine(quant, shadow, blocks=blocks, width=35, max_rows=40,
                             max_seq_len=2176, dtype=torch.float16, device="cpu")  # fmt: skip
        keys.append(_keys(lambda e=engine: warm(e, prefill_too=False)))
    split = {kernel for kernel, _ in keys[0] if kernel.endswith("split_kernel")}
    assert len(split) == 1, split
    assert all(k == keys[0] for k in keys), [len(k - keys[0]) for k in keys]


def as_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode`` and ``prefill`` dispatch CPU tensors as on an H200 (launches must be
    intercepted: ``record_keys``)."""
    import mla_triton.ops.decode.gluon as gd
    from mla_triton.common import device as dev

    real = gd.gluon_facts

    def facts(*args: Any) -> Any:
        return replace(real(*args), device_type="cuda", capability=(9, 0), interpreting=False,
                       api_missing=None)  # fmt: skip

    monkeypatch.setattr(gd, "gluon_facts", facts)
    monkeypatch.setattr(dev, "capability", lambda device: (9, 0))
    monkeypatch.setattr(dev, "hw_fp8", lambda device: False)


def test_block_count_is_not_a_gluon_compile_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an sm90 engine (dispatch as on an H200) the keys of the Gluon decode kernel that
    auto takes for recipe none (the warp-specialized one) do not depend on the cache's
    block count either (37 and 64)."""
    as_sm90(monkeypatch)
    keys = []
    for blocks in (37, 64):
        engine = make_engine(None, False, blocks=blocks, width=35, max_rows=40,
                             max_seq_len=2176, dtype=torch.float16, device="cpu")  # fmt: skip
        warmed = _keys(lambda e=engine: warm(e, prefill_too=False))
        gluon = ("gluon_decode_split_kernel", "gluon_decode_ws_kernel")
        keys.append({key for kernel, key in warmed if kernel.endswith(gluon)})
    assert len(keys[0]) == 2 and keys[0] == keys[1]


@pytest.mark.parametrize("shadow", [False, True], ids=["on-read", "shadow"])
def test_public_warmup_runs_every_warmup_and_counts_compiles(
    shadow: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``mla_triton.warmup`` (CPU): decode's, the shadow's cache write (with a shadow) and
    prefill's warm-ups run with the engine's arguments, nothing is written, and the count
    of compiled variants it returns is an int (0 under the interpreter: nothing compiles)."""
    import mla_triton.precompile as pc

    called: dict[str, dict[str, Any]] = {}

    def spy(name: str) -> Callable[..., Any]:
        real = getattr(pc, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            called[name] = kwargs
            return real(*args, **kwargs)

        return run

    for name in ("warmup_decode", "warmup_update_cache", "warmup_prefill"):
        monkeypatch.setattr(pc, name, spy(name))
    engine = make_engine(NVFP4, shadow, blocks=5, width=3, max_rows=2, max_seq_len=300,
                         dtype=torch.float16, device="cpu")  # fmt: skip
    before = engine.rows.clone()
    compiled = mla_triton.warmup(engine.raw, num_heads=16, pages_per_row=engine.width,
                                 max_rows=engine.max_rows, max_seq_len=engine.max_seq_len,
                                 softmax_scale=SCALE, quant=NVFP4, shadow=engine.shadow_bytes,
                                 prefill_heads=4, threads=1)  # fmt: skip
    assert isinstance(compiled, int) and not isinstance(compiled, bool)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        assert compiled == 0
    else:
        assert compiled >= 0
    assert set(called) == {"warmup_decode", "warmup_prefill"} | (
        {"warmup_update_cache"} if shadow else set())  # fmt: skip
    assert called["warmup_decode"]["num_heads"] == 16
    assert called["warmup_decode"]["pages_per_row"] == engine.width
    assert called["warmup_prefill"]["num_heads"] == 4
    assert (called["warmup_prefill"]["head_dim_qk"], called["warmup_prefill"]["head_dim_v"]) == (
        192, 128)  # fmt: skip
    assert called["warmup_prefill"]["quant"] == NVFP4
    assert torch.equal(engine.rows, before)  # compiled at most, never launched


def test_compile_only_launches_nothing() -> None:
    """Under compile_only the outputs stay unwritten (and on CPU nothing compiles)."""
    cache = torch.zeros(3, PAGE, RANK + ROPE, dtype=torch.float16)
    q = torch.zeros(1, HEADS, RANK + ROPE, dtype=torch.float16)
    out = torch.full((1, HEADS, RANK), 7.0, dtype=torch.float16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with compile_only(threads=1):
        decode(q, cache, table, lens, softmax_scale=SCALE, out=out, num_splits=1)
    assert bool((out == 7.0).all())


def test_compile_only_leaves_other_threads_launching() -> None:
    """A ``compile_only`` open in another thread (mla_vllm's early warm-up) intercepts
    only that thread's launches: this thread's decode runs and writes its output."""
    import threading

    opened, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def background() -> None:
        try:
            with compile_only(threads=1):
                opened.set()
                done.wait(60)
        except BaseException as exc:  # reported below
            errors.append(exc)
            opened.set()

    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert opened.wait(60)
        heads = 16
        cache = torch.randn(1, PAGE, RANK + ROPE).to(torch.float16)
        q = torch.randn(1, heads, RANK + ROPE).to(torch.float16)
        out = torch.full((1, heads, RANK), 7.0, dtype=torch.float16)
        table = torch.zeros(1, 1, dtype=torch.int32)
        lens = torch.full((1,), 4, dtype=torch.int32)
        decode(q, cache, table, lens, softmax_scale=SCALE, out=out, num_splits=1)
    finally:
        done.set()
        thread.join()
    assert not errors, errors
    assert not bool((out == 7.0).any())  # launched: every output written
