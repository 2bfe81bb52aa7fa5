"""The engine warm-up against what vLLM 0.33's start launches around it.

vLLM's GPU worker (V2 model runner, the serving benchmark's) starts in this order:

1. ``profile_run``: attention skipped (``skip_attn``), nothing of ours runs;
2. ``profile_cudagraph_memory``: a *minimal* KV cache of ``min(max_num_seqs, largest
   capture size)`` blocks, then a PIECEWISE capture of every capture size N (a dummy
   batch of N one-token requests with ``seq_len`` 1: decode rows only, attention eager
   outside the graph, warm-up forward then capture forward) and a FULL capture of the
   two largest uniform-decode sizes (metadata for capture: ``max_seq_len`` is
   ``max_model_len``, so several splits);
3. the real KV cache, then ``kernel_warmup``: ``mla_vllm.warmup``'s plans;
4. ``warmup_kernels``: N requests of 2 prompt tokens (a prefill), then decode steps of
   N, 2 and 1 requests;
5. ``capture_model`` on the real cache: steps 2's batches for every size.

Each batch here is built as vLLM builds it (zero block tables as wide as the persistent
one, slots -1, the builder's ``build`` or ``build_for_cudagraph_capture``) and run
through ``MLAAttention.forward``; ``record_keys`` gives the compile keys (sm_90, nothing
launched). Steps 4 and 5 must be covered by the warm-up's keys. Step 2 runs before the
warm-up on another cache; the split kernels do not specialize the cache's block
count, so its keys are the real cache's warm-up's, and the first metadata build (in
step 2) runs the warm-up for the minimal cache (``warmup.warm_before_capture``): the
last tests pin both down.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    PAGE,
    SMALL,
    Batch,
    Model,
    common_metadata,
    forward,
    layer_inputs,
    make_builder,
)
from test_warmup import _quant_model

from mla_triton.precompile import record_keys

pytestmark = pytest.mark.usefixtures("vllm_process")

Keys = set[tuple[str, str]]
CONFIGS: dict[str, Any] = {  # on read and shadow (the unquantized path is on read too)
    "nvfp4": {"recipe": "nvfp4"},
    "nvfp4-shadow": {"recipe": "nvfp4", "kv_path": "shadow"},
}


def _dummy_batch(model: Model, requests: list[tuple[int, int]], *, full: bool, width: int) -> Batch:
    """A batch of ``requests`` (context, new tokens) as vLLM's V2 runner builds it.

    Capture and profile batches (no context) get zero block tables; warm-up steps with
    context get distinct pages. ``full``: FULL-graph capture metadata
    (``build_for_cudagraph_capture``, ``max_seq_len = max_model_len``).
    """
    table = torch.zeros(len(requests), width, dtype=torch.int32)
    page = 1
    for r, (c, q) in enumerate(requests):
        if c:
            for j in range(-(-(c + q) // PAGE)):
                table[r, j] = page
                page += 1
    tokens = sum(q for _, q in requests)
    slots = torch.full((tokens,), -1, dtype=torch.int64)  # dummy slots: no write
    max_len = int(model.config.model_config.max_model_len)
    common = common_metadata(requests, table, slots, max_len if full else None)
    batch = Batch(requests, table, common.seq_lens, common.query_start_loc, slots)
    builder = model.builder
    batch.metadata = (
        builder.build_for_cudagraph_capture(common) if full else builder.build(0, common)
    )
    return batch


def _served(model: Model, batches: list[Batch]) -> Keys:
    """Compile keys of every layer's forward over ``batches``."""
    with record_keys() as keys:
        for batch in batches:
            for i, name in enumerate(model.layers):
                q, kv_c, k_pe = layer_inputs(SMALL, batch.num_tokens, 5 + i)
                forward(model, batch, name, q, kv_c, k_pe)
    return keys


def _warmed(model: Model) -> Keys:
    from mla_vllm.warmup import ENGINE_WARMUP

    plans = ENGINE_WARMUP.get_warmup_keys(model.config)
    with record_keys() as keys:
        ENGINE_WARMUP.run_plans(plans)
    return keys


def _sizes(model: Model) -> list[int]:
    """vLLM's capture sizes up to ``max_num_seqs``, largest first."""
    seqs = int(model.config.scheduler_config.max_num_seqs)
    return sorted((s for s in (1, 2, 4, 8, 16, 32, 64) if s <= seqs), reverse=True)


def _capture(model: Model, sizes: list[int], full_sizes: list[int]) -> list[Batch]:
    from mla_vllm.warmup import block_table_width

    width = block_table_width(model.config, PAGE)
    piecewise = [_dummy_batch(model, [(0, 1)] * n, full=False, width=width) for n in sizes]
    return piecewise + [
        _dummy_batch(model, [(0, 1)] * n, full=True, width=width) for n in full_sizes
    ]


def _warmup_steps(model: Model) -> list[Batch]:
    """``warmup_kernels``: a prefill of N x 2 tokens, decode steps of N, 2 and 1 requests."""
    from mla_vllm.warmup import block_table_width

    width = block_table_width(model.config, PAGE)
    n = int(model.config.scheduler_config.max_num_seqs)
    steps = [[(0, 2)] * n, [(2, 1)] * n, [(3, 1)] * 2, [(4, 1)]]
    return [_dummy_batch(model, step, full=False, width=width) for step in steps]


def _width(model: Model) -> int:
    from mla_vllm.warmup import block_table_width

    return block_table_width(model.config, PAGE)


def _kernels(keys: Keys) -> list[str]:
    return sorted(name.rsplit(".", 1)[1] for name, _ in keys)


def _shrink_cache(model: Model, blocks: int) -> None:
    """Bind each layer to the first ``blocks`` blocks of its cache (the same rows and
    strides: the profile pass's minimal cache, as far as compile keys go)."""
    for name, layer in model.layers.items():
        layer.bind_kv_cache(model.caches[name][:blocks])
        model.caches[name] = layer.kv_cache


@pytest.mark.parametrize("name", list(CONFIGS))
def test_warmup_covers_capture_and_warmup_steps(tmp_path: Path, name: str) -> None:
    """Steps 4 and 5 (after the warm-up, on the real cache) compile nothing new."""
    model = _quant_model(tmp_path, CONFIGS[name])
    warmed = _warmed(model)
    sizes = _sizes(model)
    capture = _served(model, _capture(model, sizes, sizes))
    steps = _served(model, _warmup_steps(model))
    kernels = _kernels(capture)
    splits = [k for k in kernels if "split" in k]
    assert len(splits) >= 2, kernels  # one split (PIECEWISE) and several (FULL)
    assert ("shadow_update_kernel" in kernels) == ("shadow" in name), kernels
    assert "prefill_fwd_kernel" in _kernels(steps), _kernels(steps)
    for step, keys in (("capture", capture), ("warmup_kernels", steps)):
        missing = keys - warmed
        assert not missing, f"{step}: {len(missing)} keys not warmed: {_kernels(missing)}"


def _profile_pass(model: Model, blocks: int) -> Keys:
    sizes = _sizes(model)
    _shrink_cache(model, blocks)
    return _served(model, _capture(model, sizes, sizes[:2]))


def test_profile_pass_keys_are_the_warmups_for_its_cache(tmp_path: Path) -> None:
    """Step 2's keys are the warm-up's for the cache it runs on: only the cache differs."""
    model = _quant_model(tmp_path, CONFIGS["nvfp4"])
    minimal = min(int(model.config.scheduler_config.max_num_seqs), _sizes(model)[0])
    profile = _profile_pass(model, minimal)
    assert not profile - _warmed(model), _kernels(profile - _warmed(model))


@pytest.mark.parametrize("real", [48, 40])  # a multiple of 16, and not: the minimal is 8
def test_profile_pass_keys_do_not_follow_the_block_count(tmp_path: Path, real: int) -> None:
    """The split kernels take the cache's block count unspecialized (their own
    ``num_blocks``): the profile pass's minimal cache (8 blocks here; 64 in the serving
    benchmark) keys them as the real one does (1,608,071 blocks on the H200 at 4k, on
    read), whatever the two counts' classes (1, divisible by 16, other)."""
    model = _quant_model(tmp_path, CONFIGS["nvfp4"])
    _shrink_cache(model, real)
    warmed = _warmed(model)
    minimal = min(int(model.config.scheduler_config.max_num_seqs), _sizes(model)[0])
    profile = _profile_pass(model, minimal)
    assert any("split" in k for k in _kernels(profile)), _kernels(profile)
    assert not profile - warmed, _kernels(profile - warmed)


@contextmanager
def _recording(
    compiled: list[Keys], *, compiles: bool = True, early: bool = False
) -> Iterator[None]:
    """``compile_only`` replaced: each warm-up's keys, appended to ``compiled``; with
    ``compiles``, Triton's interpreter is taken for a compiler (as on a GPU); the early
    warm-up (``MLA_QUANT_WARMUP_EARLY``) off unless ``early``."""
    from mla_triton.precompile import record_keys
    from mla_vllm.warmup import EARLY_ENV

    saved = os.environ.get(EARLY_ENV)
    os.environ[EARLY_ENV] = "1" if early else "0"

    @contextmanager
    def recording(threads: int | None = None) -> Iterator[None]:
        with record_keys() as keys:
            yield
        compiled.append(set(keys))

    import mla_vllm.warmup as warmup

    original = warmup.compile_only, warmup._compiles
    warmup.compile_only = recording  # type: ignore[assignment]
    if compiles:
        warmup._compiles = lambda: True  # as on a GPU (under the interpreter: skipped)
    try:
        yield
    finally:
        warmup.join_early()
        warmup.compile_only, warmup._compiles = original
        if saved is None:
            os.environ.pop(EARLY_ENV, None)
        else:
            os.environ[EARLY_ENV] = saved


@pytest.mark.parametrize("name", list(CONFIGS))
def test_first_build_warms_what_the_profile_pass_reaches(tmp_path: Path, name: str) -> None:
    """The first metadata build runs the engine warm-up for the caches bound then (the
    profile pass's minimal one), once per engine; the profile pass's keys, and those of
    the real cache's warm-up, capture and ``warmup_kernels``, are among them."""
    compiled: list[Keys] = []
    with _recording(compiled):
        model = _quant_model(tmp_path, CONFIGS[name])  # builder made, nothing built yet
        assert compiled == []
        real = _warmed(model)
        sizes = _sizes(model)
        _shrink_cache(model, min(int(model.config.scheduler_config.max_num_seqs), sizes[0]))
        batches = _capture(model, sizes, sizes[:2])  # the first build warms, later ones not
        assert len(compiled) == 1
        profile = _served(model, batches)
        make_builder(model)  # a new builder, as for the real cache: the engine is warmed
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
        assert len(compiled) == 1
    early = compiled[0]
    kernels = _kernels(early)
    assert any("split" in k for k in kernels) and "prefill_fwd_kernel" in kernels, kernels
    assert not profile - early, _kernels(profile - early)
    assert not real - early, _kernels(real - early)


def test_first_build_warmup_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter, ``MLA_QUANT_WARMUP=0`` and vLLM's JIT warm-up off (eager):
    no warm-up at a build, and the engine's one warm-up is left for later."""
    from mla_vllm.warmup import ENV

    compiled: list[Keys] = []
    with _recording(compiled, compiles=False):
        model = _quant_model(tmp_path, CONFIGS["nvfp4"])
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
    with _recording(compiled):
        monkeypatch.setenv(ENV, "0")
        make_builder(model)
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
        monkeypatch.setenv(ENV, "1")
        model.config.kernel_config.enable_jit_warmup = False
        make_builder(model)
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
        model.config.kernel_config.enable_jit_warmup = True
        assert compiled == []
        make_builder(model)  # all on: this engine has not been warmed yet
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
        assert len(compiled) == 1


# ------------------------------------------------------------------ early warm-up

EARLY_CONFIGS: dict[str, Any] = {
    "none": {},
    "fp8": {"recipe": "fp8"},
    "nvfp4": {"recipe": "nvfp4"},
    "nvfp4-shadow": {"recipe": "nvfp4", "kv_path": "shadow"},
}


def _unbuilt(tmp_path: Path, mla_quant: object) -> Model:
    """Layers built and loaded, no builder and no cache yet (where vLLM asks the specs)."""
    from conftest import build_model, make_vllm_config

    from mla_vllm.backend import MLAQuantBackend

    config = make_vllm_config(tmp_path, SMALL, mla_quant=mla_quant)
    model = build_model(config, SMALL, MLAQuantBackend, num_layers=2, num_blocks=1)
    for layer in model.layers.values():
        layer.kv_cache = torch.tensor([])  # as vLLM's layers before the cache is bound
    model.caches.clear()
    return model


@pytest.mark.parametrize("name", list(EARLY_CONFIGS))
def test_early_plans_cover_the_first_build(tmp_path: Path, name: str) -> None:
    """The early warm-up's stand-in caches key every kernel as the caches vLLM allocates
    (its planner and allocator, ``test_shadow._allocate``) do: the first build's keys are
    among the early ones, and the stand-ins have the real rows' shape and strides."""
    from test_shadow import _allocate

    from mla_vllm.warmup import EngineWarmup, standin_caches

    model = _unbuilt(tmp_path, EARLY_CONFIGS[name])
    standins = standin_caches(model.layers, model.config)
    early = EngineWarmup()
    with record_keys() as early_keys:
        early.run_plans(early.plan(model.layers, model.config, standins))
    make_builder(model)
    _allocate(model)  # vLLM's own views of one buffer, bound to the layers
    for layer_name, cache in model.caches.items():
        standin = standins[layer_name]
        assert standin.shape[1:] == cache.shape[1:] and standin.dtype == cache.dtype
        assert standin.stride()[1:] == cache.stride()[1:], (standin.stride(), cache.stride())
    first = EngineWarmup()
    with record_keys() as first_keys:
        first.run_plans(first.plan(model.layers, model.config))
    kernels = _kernels(first_keys)
    assert any("split" in k for k in kernels), kernels
    assert ("shadow_update_kernel" in kernels) == ("shadow" in name), kernels
    assert first_keys <= early_keys, _kernels(first_keys - early_keys)


def test_early_warmup_starts_once_and_is_joined(tmp_path: Path) -> None:
    """vLLM's spec request starts it (a background thread, once per engine); the metadata
    builder waits for it; the first build then runs the plans again, for keys all
    compiled early; later builds and builders warm nothing."""
    from test_shadow import _allocate, _specs

    import mla_vllm.warmup as warmup

    compiled: list[Keys] = []
    with _recording(compiled, early=True):
        model = _unbuilt(tmp_path, EARLY_CONFIGS["nvfp4-shadow"])
        _specs(model)  # the worker's get_kv_cache_spec: customize_spec starts it
        assert len(warmup._RUNNING) == 1
        run = warmup._RUNNING[0]
        assert run.thread is not None and run.thread.daemon
        _specs(model)  # asked again (the allocator does): no second start
        assert len(warmup._RUNNING) == 1
        make_builder(model)  # joins
        assert warmup._RUNNING == [] and not run.thread.is_alive()
        assert run.added == 0 and run.seconds is not None  # the interpreter compiles nothing
        assert len(compiled) == 1
        _allocate(model)
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))  # the first build
        assert len(compiled) == 2
        make_builder(model)
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
        _specs(model)
        assert len(compiled) == 2 and warmup._RUNNING == []
    early, first = compiled
    assert "shadow_update_kernel" in _kernels(early), _kernels(early)
    assert first <= early, _kernels(first - early)


@pytest.mark.parametrize("switch", ["early-off", "warmup-off", "eager", "interpreter"])
def test_early_warmup_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, switch: str) -> None:
    """``MLA_QUANT_WARMUP_EARLY=0``, ``MLA_QUANT_WARMUP=0``, vLLM's JIT warm-up off
    (eager) and Triton's interpreter: the spec request starts nothing."""
    from test_shadow import _specs

    import mla_vllm.warmup as warmup

    compiled: list[Keys] = []
    with _recording(compiled, compiles=switch != "interpreter", early=switch != "early-off"):
        model = _unbuilt(tmp_path, EARLY_CONFIGS["nvfp4"])
        if switch == "warmup-off":
            monkeypatch.setenv(warmup.ENV, "0")
        if switch == "eager":
            model.config.kernel_config.enable_jit_warmup = False
        _specs(model)
        assert warmup._RUNNING == []
    assert compiled == []


def test_failed_early_warmup_leaves_the_first_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An early warm-up that fails is logged and joined; the first build warms up."""
    from test_shadow import _allocate, _specs

    import mla_vllm.warmup as warmup

    original = warmup._compile
    main = threading.get_ident()

    def failing(*args: Any) -> None:
        if threading.get_ident() != main:
            raise RuntimeError("early compile failed")
        original(*args)

    monkeypatch.setattr(warmup, "_compile", failing)
    compiled: list[Keys] = []
    with _recording(compiled, early=True):
        model = _unbuilt(tmp_path, EARLY_CONFIGS["nvfp4"])
        _specs(model)
        run = warmup._RUNNING[0]
        make_builder(model)
        assert run.added is None  # failed (logged)
        _allocate(model)
        _dummy_batch(model, [(0, 1)], full=False, width=_width(model))
    assert len(compiled) == 1 and any("split" in k for k in _kernels(compiled[0]))
