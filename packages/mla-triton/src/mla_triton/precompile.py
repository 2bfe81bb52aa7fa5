"""Compile, before serving, every kernel variant an engine's calls can reach.

A Triton kernel is compiled once per *key*: its constexprs (here: the recipe's
formats and flags, tile sizes, ``MULTI_SPLIT``, ``CAUSAL``, ``RETURN_LSE``,
``KV_FUSED``), the dtype of each tensor, and Triton's specialization of the other
arguments: an int is keyed by being 1, divisible by 16 or neither, a pointer by
being 16-byte aligned or not (``JITFunction``'s binder). What varies during serving,
for a fixed engine (model, dtype, recipe, KV-cache geometry):

- decode (``decode``, ``decode_shadow``): whether the split policy picks one split
  or several for the batch's rows and ``max_seq_len`` (``MULTI_SPLIT``; the count,
  1 to 64, is a runtime argument of the split and merge kernels, not specialized);
- prefill: new tokens are causal with or without the LSE (context follows or not),
  context chunks non-causal with the LSE; ``KV_FUSED`` (every sequence fits one
  query tile, with K or V quantized); the LSE row stride is the token count
  (divisible by 16 or not); a context chunk's offsets are a slice of vLLM's
  per-chunk buffer (16-byte aligned or not);
- the shadow's cache write (``update_cache``): the token count (1, divisible by
  16, or neither).

``warmup_decode``, ``warmup_prefill`` and ``warmup_update_cache`` call the public
functions once per such variant on small inputs, inside ``compile_only`` (kernels
are compiled, never launched: nothing is read or written, nothing is captured
into a CUDA graph). The other key parts (strides, the block table's width) are
fixed for an engine's lifetime: pass the engine's own KV cache and block-table width
so that they key the same. The cache's block count is not a key (every split kernel,
Triton and Gluon, takes it as an unspecialized ``num_blocks``). ``record_keys`` computes
the keys (for ``GPUTarget("cuda", 90, 32)``) without a GPU or a launch, and
``compiled_variants`` counts what was compiled: both for tests.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

from mla_formats import AttentionQuant, NMSparsity
from mla_triton.common import device as dev
from mla_triton.common.intercept import Args, Kwargs, Run, intercept, ours
from mla_triton.common.splitk import _MAX_SPLITS, _MIN_SPLIT_TOKENS, decode_num_splits
from mla_triton.ops.decode import decode
from mla_triton.ops.decode.triton import default_config as decode_config
from mla_triton.ops.prefill import prefill
from mla_triton.ops.shadow import decode_shadow, shadow_decode_config, update_cache

__all__ = [
    "compile_only",
    "compiled_variants",
    "decode_split_counts",
    "record_keys",
    "warmup",
    "warmup_decode",
    "warmup_prefill",
    "warmup_update_cache",
]


def _threads(threads: int | None) -> int:
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected None or an int >= 1, got {threads!r}")
        return threads
    return max(1, min(16, os.cpu_count() or 1))


@contextmanager
def compile_only(threads: int | None = None) -> Iterator[None]:
    """Launches of ``mla_triton`` kernels inside compile them without running them.

    Each launch becomes Triton's ``run(..., warmup=True)``: the key is computed from
    the real arguments and the kernel compiled (or loaded from Triton's cache) for
    the current device; nothing runs on the device. With ``threads > 1`` (default:
    the CPU count, at most 16) the compilations run in a pool of that many threads
    (``triton.AsyncCompileMode``) and are all finished when the block exits. Under
    Triton's interpreter nothing is compiled (the calls return at once). Only this
    thread's launches are intercepted, and Triton's ``AsyncCompileMode`` is a context
    variable (this thread's): another thread's launches run and compile as usual.
    """
    workers = _threads(threads)

    def compile_kernel(run: Run, kernel: Any, args: Args, kwargs: Kwargs, grid: Any) -> Any:
        return run(kernel, *args, grid=grid, warmup=True, **kwargs)

    with intercept(compile_kernel):
        async_mode = getattr(triton, "AsyncCompileMode", None)
        if workers <= 1 or async_mode is None or dev.interpreting():
            yield
            return
        with ThreadPoolExecutor(max_workers=workers) as pool, async_mode(pool):
            yield


@contextmanager
def record_keys(target: Any = None) -> Iterator[set[tuple[str, str]]]:
    """Record the compile key of every ``mla_triton`` launch inside; launch nothing.

    Yields a set that receives ``(kernel name, key)``, the key as Triton's
    ``JITFunction.run`` computes it (specialization and options) for ``target``
    (default ``GPUTarget("cuda", 90, 32)``, an H100/H200), so it works on a CPU
    machine, under the interpreter too. Outputs of the calls are left unwritten.
    """
    backend = make_backend(target if target is not None else GPUTarget("cuda", 90, 32))
    binders: dict[int, Any] = {}
    keys: set[tuple[str, str]] = set()

    def binder(kernel: Any) -> Any:
        found = binders.get(id(kernel))
        if found is None:
            jit = kernel if isinstance(kernel, JITFunction) else _as_jit(kernel)
            found = create_function_from_signature(jit.signature, jit.params, backend)
            binders[id(kernel)] = found
        return found

    def record(run: Run, kernel: Any, args: Args, kwargs: Kwargs, grid: Any) -> None:
        _, specialization, options = binder(kernel)(*args, **kwargs)
        name = f"{kernel.fn.__module__}.{kernel.fn.__qualname__}"
        keys.add((name, compute_cache_key({}, specialization, options)))

    with intercept(record):
        yield keys


def _as_jit(kernel: InterpretedFunction[Any]) -> JITFunction[Any]:
    """The ``JITFunction`` an interpreted kernel would be (the same specialization flags)."""
    flags = {
        key: value
        for key, value in getattr(kernel, "kwargs", {}).items()
        if key in ("do_not_specialize", "do_not_specialize_on_alignment") and value
    }
    return JITFunction(kernel.fn, **flags)


def compiled_variants() -> dict[str, int]:
    """Compiled variants per ``mla_triton`` kernel (all devices), from Triton's in-memory caches.

    Only kernels of modules already imported count; an interpreted kernel has none.
    """
    counts: dict[str, int] = {}
    modules = [m for n, m in list(sys.modules.items()) if n.startswith("mla_triton") and m]
    for module in modules:
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction) and ours(value):
                name = f"{value.fn.__module__}.{value.fn.__qualname__}"
                caches = getattr(value, "device_caches", {})
                counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


# ---------------------------------------------------------------------------- decode


def _positive(value: object, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return value


def decode_split_counts(
    max_rows: int,
    num_heads: int,
    max_seq_len: int,
    *,
    block_h: int,
    device: torch.device | None = None,
) -> tuple[int, ...]:
    """Every split count ``decode_num_splits`` returns for 1 to ``max_rows`` rows and
    ``max_seq_len`` 1 to ``max_seq_len`` (``device``'s SM count; None: 132), sorted.

    The policy reads ``max_seq_len`` only through ``max_seq_len // 256`` (its cap),
    so one length per cap is enough.
    """
    per_batch = _splits_per_batch(max_rows, num_heads, max_seq_len, block_h, device)
    return tuple(sorted(set().union(*per_batch.values())))


def _splits_per_batch(
    max_rows: int, num_heads: int, max_seq_len: int, block_h: int, device: torch.device | None
) -> dict[int, set[int]]:
    """``{rows: the split counts rows can take}`` for 1 to ``max_rows`` rows."""
    rows = _positive(max_rows, "max_rows")
    heads = _positive(num_heads, "num_heads")
    longest = _positive(max_seq_len, "max_seq_len")
    lengths = sorted(
        {1, longest}
        | {
            c * _MIN_SPLIT_TOKENS
            for c in range(1, _MAX_SPLITS + 1)
            if c * _MIN_SPLIT_TOKENS <= longest
        }  # the policy reads max_seq_len // this
    )
    return {
        batch: {
            decode_num_splits(batch, heads, length, device=device, block_h=block_h)
            for length in lengths
        }
        for batch in range(1, rows + 1)
    }


def _split_classes(counts: set[int]) -> tuple[int, ...]:
    """One split count per compile key of the split and merge kernels: 1 where ``counts``
    holds it, and the smallest count above 1 where it holds one (the count itself is a
    runtime argument, not specialized)."""
    several = [c for c in counts if c > 1]
    return tuple(sorted(({1} & counts) | ({min(several)} if several else set())))


# Row counts warmup_decode launches besides 1 (which takes each split class): the key
# does not depend on them today; a tile choice by batch size would show here first.
DECODE_ROWS = (2, 16, 64, 256)


def warmup_decode(
    kv_cache: torch.Tensor,
    *,
    num_heads: int,
    pages_per_row: int,
    max_rows: int,
    max_seq_len: int,
    softmax_scale: float,
    quant: AttentionQuant | None = None,
    shadow: torch.Tensor | None = None,
    storage: str = "fp16",
    kv_lora_rank: int = 512,
    index_dtype: torch.dtype = torch.int32,
) -> tuple[int, ...]:
    """Compile decode for the split counts ``max_rows`` rows up to ``max_seq_len`` can take.

    ``kv_cache`` is the engine's raw latent cache ``[blocks, page, kv_lora_rank +
    rope]`` (its strides key the kernels, its block count none);
    ``shadow`` its uint8 shadow bytes (``decode_shadow`` with ``quant`` and ``storage``;
    None: on-read ``decode``); ``pages_per_row`` the block table's width; the dispatch reads only
    the engine's fixed geometry, heads, dtype,
    recipe and cache strides, so serving calls dispatch alike. Call inside ``compile_only``.
    The split count is a runtime argument of the kernels, keyed only by one split or
    several (``MULTI_SPLIT``): returns the counts launched, one per class the policy
    reaches (``_split_classes``: 1 and the smallest count above 1).
    """
    heads = _positive(num_heads, "num_heads")
    width = _positive(pages_per_row, "pages_per_row")
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
        raise ValueError("kv_cache: expected a [blocks, page, kv_lora_rank + rope] tensor")
    if shadow is not None and quant is None:
        raise ValueError("quant: decode_shadow needs the shadow's recipe")
    capacity = width * int(kv_cache.shape[1])
    longest = max(1, min(_positive(max_seq_len, "max_seq_len"), capacity))
    if shadow is not None:
        assert quant is not None
        block_h = shadow_decode_config(heads, quant, storage).block_h
    else:  # auto: the Gluon kernel only above 32 heads, where both kernels take 64 a program
        block_h = decode_config(heads, quant).block_h
    device = kv_cache.device
    rows = _positive(max_rows, "max_rows")
    per_batch = _splits_per_batch(
        rows, heads, longest, block_h, device if device.type == "cuda" else None
    )
    splits = _split_classes(set().union(*per_batch.values()))
    rope = int(kv_cache.shape[2]) - kv_lora_rank
    # one row takes a count of each class (its workspace stays small); a few more row
    # counts take those the policy gives them
    calls = [(1, count) for count in splits]
    for batch in sorted({b for b in (*DECODE_ROWS, rows) if 1 < b <= rows}):
        calls += [(batch, count) for count in _split_classes(per_batch[batch])]
    for batch, count in calls:
        q = torch.zeros(batch, heads, kv_lora_rank + rope, dtype=kv_cache.dtype, device=device)
        query = (q[..., :kv_lora_rank], q[..., kv_lora_rank:])
        table = torch.zeros(batch, width, dtype=index_dtype, device=device)
        lens = torch.ones(batch, dtype=index_dtype, device=device)
        if shadow is None:
            decode(query, kv_cache, table, lens, softmax_scale=softmax_scale,
                   kv_lora_rank=kv_lora_rank, quant=quant, num_splits=count,
                   max_seq_len=1, check_values=False)  # fmt: skip
        else:
            assert quant is not None
            decode_shadow(query, kv_cache, shadow, table, lens, softmax_scale=softmax_scale,
                          quant=quant, storage=storage, kv_lora_rank=kv_lora_rank,
                          num_splits=count, max_seq_len=1, check_values=False)  # fmt: skip
    return splits


# ---------------------------------------------------------------------------- prefill

# Sequence lengths of one prefill call, one per (KV_FUSED, token count class): every
# sequence within one query tile (tiles are 16 to 256 queries) or not, with a token
# count divisible by 16 or not (the LSE's row stride). Prefills have >= 2 tokens
# (vLLM runs 1-token queries as decode).
PREFILL_SHAPES: tuple[tuple[int, ...], ...] = ((16,), (1, 16), (272,), (273,))


def _offsets(lengths: Sequence[int], shift: int, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` of ``lengths`` (int32), starting ``shift`` elements into its buffer."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    buffer = torch.tensor([0] * shift + cu, dtype=torch.int32, device=device)
    return buffer[shift:]


def warmup_prefill(
    *,
    num_heads: int,
    head_dim_qk: int,
    head_dim_v: int,
    dtype: torch.dtype,
    device: torch.device,
    softmax_scale: float,
    quant: AttentionQuant | None = None,
    sparsity: NMSparsity | None = None,
    context: bool = True,
) -> int:
    """Compile ``prefill``'s variants for one recipe; returns the number of calls.

    New tokens: causal, ``sparsity``, with and without the LSE; with ``context``,
    context chunks: non-causal, no sparsity, the LSE, offsets 16-byte aligned and
    not (vLLM slices a chunk's offsets out of one buffer). Each over
    ``PREFILL_SHAPES``, through ``prefill``: each call compiles the kernels the dispatch
    takes for it, as serving calls will. Call inside ``compile_only``.
    """
    heads = _positive(num_heads, "num_heads")
    calls = 0
    for lengths in PREFILL_SHAPES:
        tokens = sum(lengths)
        q = torch.zeros(tokens, heads, head_dim_qk, dtype=dtype, device=device)
        k = torch.zeros_like(q)
        v = torch.zeros(tokens, heads, head_dim_v, dtype=dtype, device=device)
        longest = max(lengths)
        variants: list[tuple[bool, bool, int]] = [(True, False, 0), (True, True, 0)]
        if context:
            variants += [(False, True, 0), (False, True, 1)]
        for causal, lse, shift in variants:
            cu = _offsets(lengths, shift, device)
            prefill(q, k, v, cu, cu, softmax_scale=softmax_scale, causal=causal, quant=quant,
                    sparsity=sparsity if causal else None, return_lse=lse,
                    max_seqlen_q=longest, max_seqlen_k=longest)  # fmt: skip
            calls += 1
    return calls


# ---------------------------------------------------------------------------- cache write

UPDATE_TOKENS = (1, 16, 17)  # the token count keys the write kernel: 1, % 16 == 0, other


def warmup_update_cache(
    kv_cache: torch.Tensor,
    shadow: torch.Tensor,
    *,
    quant: AttentionQuant,
    storage: str = "fp16",
    kv_lora_rank: int = 512,
    slot_dtype: torch.dtype = torch.int64,
) -> int:
    """Compile ``update_cache`` (the shadow's write) for ``UPDATE_TOKENS`` tokens.

    ``kv_cache`` and ``shadow`` as the engine passes them (compiled, never written).
    Call inside ``compile_only``; returns the number of calls.
    """
    device = kv_cache.device
    rope = int(kv_cache.shape[2]) - kv_lora_rank
    for n in UPDATE_TOKENS:
        latent = torch.zeros(n, kv_lora_rank + rope, dtype=kv_cache.dtype, device=device)
        slots = torch.full((n,), -1, dtype=slot_dtype, device=device)
        update_cache(latent[:, :kv_lora_rank], latent[:, kv_lora_rank:], kv_cache, slots,
                     shadow, quant=quant, storage=storage, check_values=False)  # fmt: skip
    return len(UPDATE_TOKENS)


# ---------------------------------------------------------------------------- all of it


# fmt: off
def warmup(
    kv_cache: torch.Tensor, *, num_heads: int, pages_per_row: int, max_rows: int,
    max_seq_len: int, softmax_scale: float, quant: AttentionQuant | None = None,
    shadow: torch.Tensor | None = None, storage: str = "fp16", kv_lora_rank: int = 512,
    prefill_heads: int | None = None, head_dim_qk: int = 192, head_dim_v: int = 128,
    sparsity: NMSparsity | None = None, threads: int | None = None,
) -> int:
    """Compile every kernel variant an engine's decode, prefill and cache writes can launch.

    Call once after allocating the KV cache (and its ``shadow`` when decoding through one:
    ``allocate_shadow``), before serving; nothing runs on the device, and no call later
    compiles (no JIT stall during inference). ``kv_cache`` is the raw latent cache
    ``[blocks, page, kv_lora_rank + rope]`` in the model dtype; ``pages_per_row`` the block
    table's width; ``max_rows`` the largest decode batch; ``quant``/``storage`` the recipe
    (and shadow storage); ``prefill_heads`` the prefill's query heads (default
    ``num_heads``), ``head_dim_qk``/``head_dim_v`` its head dims (DeepSeek: 192/128) and
    ``sparsity`` its N:M score sparsity. Returns the number of kernel variants compiled.
    Engines with several recipes or geometries call it once for each.
    """
    before = sum(compiled_variants().values())
    with compile_only(threads):
        warmup_decode(kv_cache, num_heads=num_heads, pages_per_row=pages_per_row,
                      max_rows=max_rows, max_seq_len=max_seq_len, softmax_scale=softmax_scale,
                      quant=quant, shadow=shadow, storage=storage,
                      kv_lora_rank=kv_lora_rank)  # fmt: skip
        if shadow is not None and quant is not None:
            warmup_update_cache(kv_cache, shadow, quant=quant, storage=storage,
                                kv_lora_rank=kv_lora_rank)  # fmt: skip
        warmup_prefill(num_heads=prefill_heads or num_heads, head_dim_qk=head_dim_qk,
                       head_dim_v=head_dim_v, dtype=kv_cache.dtype, device=kv_cache.device,
                       softmax_scale=softmax_scale, quant=quant, sparsity=sparsity)  # fmt: skip
    return sum(compiled_variants().values()) - before
# fmt: on
