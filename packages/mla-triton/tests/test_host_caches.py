"""The per-call caches of the launch paths never change a decision (CPU, no kernel runs).

Each op remembers what depends only on its recipe, shapes and platform (``dispatch.auto``'s
decision, the recipe as the kernels take it, the split policy, TMA layouts): a sequence of
calls that changes the recipe, the dtype, the storage, the head count or the platform
after a cached call must launch exactly what the same call launches with every cache
empty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

import mla_triton
from mla_formats import AttentionQuant, OperandQuant
from mla_triton.common import splitk
from mla_triton.common.intercept import intercept
from mla_triton.common.memo import by_identity
from mla_triton.common.replay import REPLAY
from mla_triton.ops.decode import dispatch
from mla_triton.ops.decode import gluon as gd
from mla_triton.ops.prefill import core as prefill_core
from mla_triton.ops.prefill import gluon as prefill_gluon
from mla_triton.ops.shadow import gluon_shadow_taken, shadow_layout

FP8 = AttentionQuant.uniform("fp8")
NVFP4 = AttentionQuant.uniform("nvfp4")
SCALED = AttentionQuant(q="fp8", k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0), p="fp8")
SCALE = 192**-0.5


def _clear() -> None:
    """Empty every cache of the launch paths."""
    REPLAY.clear()
    dispatch._DECISIONS.clear()
    gd.gluon_recipe.cache_clear()
    gd.by_name.cache_clear()
    splitk.operands.cache_clear()
    splitk._split_policy.cache_clear()
    splitk._layout.cache_clear()
    prefill_core._recipe_of.cache_clear()
    prefill_core.global_scale.cache_clear()
    prefill_core._UNIT_SCALES.clear()
    prefill_gluon._q_as_k.cache_clear()
    prefill_gluon._block_layout.cache_clear()
    prefill_gluon._proto_descriptor.cache_clear()


def _plain(v: Any) -> Any:
    """A launch argument as data: a tensor's dtype, shape, strides and storage offset (a
    TMA descriptor's base, shape, strides and block; a layout its repr)."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, tuple(v.shape), v.stride(), v.storage_offset())
    if hasattr(v, "block_shape") and hasattr(v, "base"):
        return (_plain(v.base), *(tuple(x) for x in (v.shape, v.strides, v.block_shape)))
    if isinstance(v, tuple):
        return tuple(_plain(x) for x in v)
    return v


def _launches(call: Callable[[], Any]) -> list[tuple[str, Any, Any, dict[str, Any]]]:
    """Every launch ``call()`` makes (none runs): kernel, grid, arguments as data."""
    seen: list[tuple[str, Any, Any, dict[str, Any]]] = []

    def action(run: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> None:
        plain = {k: _plain(x) for k, x in kwargs.items()}
        seen.append((kernel.fn.__name__, grid, _plain(tuple(args)), plain))

    with intercept(action):
        call()
    return seen


def _same_as_uncached(calls: list[Callable[[], Any]]) -> None:
    """Each call, in order with warm caches, launches what it launches alone, caches empty."""
    _clear()
    warm = [_launches(call) for call in calls]
    for call, got in zip(calls, warm, strict=True):
        _clear()
        assert got == _launches(call)
        assert got  # something was launched


def _decode_inputs(heads: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    q = torch.randn(3, heads, 576, dtype=dtype)
    cache = torch.randn(6, 64, 576, dtype=dtype)
    table = torch.arange(6, dtype=torch.int32).reshape(3, 2)
    lens = torch.tensor([5, 64, 128], dtype=torch.int32)
    return q, cache, table, lens


def _decode_call(heads: int, dtype: torch.dtype, quant: AttentionQuant | None) -> Callable[[], Any]:
    q, cache, table, lens = _decode_inputs(heads, dtype)

    def call() -> Any:
        return mla_triton.decode(q, cache, table, lens, softmax_scale=SCALE, quant=quant,
                                 max_seq_len=128, check_values=False)  # fmt: skip

    return call


def _shadow_call(
    heads: int, dtype: torch.dtype, quant: AttentionQuant, storage: str
) -> Callable[[], Any]:
    q, cache, table, lens = _decode_inputs(heads, dtype)
    shadow = mla_triton.allocate_shadow(6, 64, quant, storage=storage)
    ws = torch.empty(mla_triton.decode_workspace_size(3, heads, 128), dtype=torch.uint8)

    def call() -> Any:
        return mla_triton.decode_shadow(q, cache, shadow, table, lens, softmax_scale=SCALE,
                                        quant=quant, storage=storage, workspace=ws,
                                        max_seq_len=128, check_values=False)  # fmt: skip

    return call


@pytest.mark.parametrize("platform", ["cpu", "sm90"])
def test_decode_after_cached_calls(platform: str, request: pytest.FixtureRequest) -> None:
    """decode and decode_shadow: recipe, dtype, heads, storage changed after cached calls."""
    if platform == "sm90":
        request.getfixturevalue("as_sm90")
    calls = [
        _decode_call(128, torch.bfloat16, FP8),
        _decode_call(128, torch.bfloat16, NVFP4),
        _decode_call(16, torch.bfloat16, FP8),
        _decode_call(128, torch.float16, FP8),
        _decode_call(128, torch.bfloat16, None),
        _decode_call(128, torch.bfloat16, SCALED),
        _shadow_call(128, torch.bfloat16, FP8, "fp16"),
        _shadow_call(128, torch.bfloat16, NVFP4, "fp16"),
        _shadow_call(128, torch.bfloat16, NVFP4, "packed"),
        _shadow_call(16, torch.bfloat16, FP8, "fp16"),
        _shadow_call(128, torch.float16, SCALED, "fp16"),
        _decode_call(128, torch.bfloat16, FP8),
        _shadow_call(128, torch.bfloat16, FP8, "fp16"),
    ]
    _same_as_uncached(calls)


def _prefill_call(dtype: torch.dtype, quant: AttentionQuant | None) -> Callable[[], Any]:
    t, h = 80, 4
    q, k = torch.randn(t, h, 192, dtype=dtype), torch.randn(t, h, 192, dtype=dtype)
    v = torch.randn(t, h, 128, dtype=dtype)
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)

    def call() -> Any:
        return mla_triton.prefill(q, k, v, cu, cu, softmax_scale=SCALE, quant=quant,
                                  max_seqlen_q=50, max_seqlen_k=50)  # fmt: skip

    return call


@pytest.mark.parametrize("platform", ["cpu", "sm90"])
def test_prefill_after_cached_calls(
    platform: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefill: recipe (static, dynamic and scaled amax) and dtype changed after cached calls."""
    if platform == "sm90":
        request.getfixturevalue("as_sm90")
    dyn = AttentionQuant(q=OperandQuant("fp8", "dynamic"), k=OperandQuant("nvfp4", "dynamic"))
    calls = [
        _prefill_call(torch.bfloat16, FP8),
        _prefill_call(torch.bfloat16, NVFP4),
        _prefill_call(torch.bfloat16, None),
        _prefill_call(torch.float16, SCALED),
        _prefill_call(torch.bfloat16, dyn),
        _prefill_call(torch.bfloat16, FP8),
    ]
    _same_as_uncached(calls)


def test_auto_remembers_per_rule() -> None:
    """``dispatch.auto``'s memo: the facts, the op and the rule (or its key) decide."""
    facts = gd.GluonFacts(
        device_type="cuda", capability=(9, 0), interpreting=False, api_missing=None,
        dtype=torch.bfloat16, quant=FP8, heads=128, kv_lora_rank=512, rope=64,
        kv_strides=(64 * 576, 576), kv_aligned=True,
    )  # fmt: skip
    dispatch._DECISIONS.clear()

    def fresh(op: str, f: gd.GluonFacts, rule: gd.Rule) -> dispatch.Row | None:
        taken = rule(f)
        if isinstance(taken, gd.Unsupported):
            return None
        return dispatch.lookup(op, gd.recipe_kind(taken), f.heads)

    row = dispatch.auto("decode", facts, gd.gluon_taken)
    assert row is not None and row == fresh("decode", facts, gd.gluon_taken)

    def refuse(f: gd.GluonFacts) -> gd.GluonRecipe | gd.Unsupported:
        return gd.Unsupported("refused", False)

    assert dispatch.auto("decode", facts, refuse) is None  # another rule, the same facts
    assert dispatch.auto("decode", facts, gd.gluon_taken) == row
    for change in ({"heads": 16}, {"quant": NVFP4}, {"dtype": torch.float16},
                   {"kv_aligned": False}, {"capability": (8, 0)}):  # fmt: skip
        other = replace(facts, **change)
        assert dispatch.auto("decode", other, gd.gluon_taken) == fresh(
            "decode", other, gd.gluon_taken
        )
    # decode_shadow: one rule per layout, told apart by the key
    layouts = [shadow_layout(FP8), shadow_layout(NVFP4), shadow_layout(NVFP4, storage="packed")]
    rows = []
    for lay in layouts:
        for quant in (FP8, NVFP4):

            def rule(f: gd.GluonFacts, lay: Any = lay) -> gd.GluonRecipe | gd.Unsupported:
                return gluon_shadow_taken(f, layout=lay)

            f = replace(facts, quant=quant)
            got = dispatch.auto("decode_shadow", f, rule, ("shadow", lay))
            assert got == fresh("decode_shadow", f, rule)
            rows.append(got)
    assert len({id(r) for r in rows if r is not None}) > 1


def test_by_identity() -> None:
    """Per object: equal objects are told apart, at most ``size`` are held."""
    seen: list[object] = []

    def f(x: AttentionQuant) -> str:
        seen.append(x)
        return x.q.format.name

    memo = by_identity(f, size=2)
    a, b = AttentionQuant.uniform("fp8"), AttentionQuant.uniform("fp8")
    assert memo(a) == memo(a) == "fp8" and seen == [a]
    assert memo(b) == "fp8" and len(seen) == 2  # equal, another object
    assert memo(NVFP4) == "nvfp4" and len(memo.memo) == 1  # full: forgotten at once
    assert memo(a) == "fp8" and len(seen) == 4


def test_unit_scale_stays_one() -> None:
    """The shared placeholder of static scales is never written (prefill, K/V pass)."""
    _clear()
    x = torch.randn(40, 2, 64, dtype=torch.float16)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    for quant in (FP8, NVFP4, AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="fp8")):
        prefill_core.quantize_kv(x, x, cu, quant, max_seqlen_k=40)
        mla_triton.prefill(x, x, x, cu, cu, softmax_scale=0.125, quant=quant)
    unit = prefill_core.unit_scale(x.device)
    assert unit is prefill_core.unit_scale(x.device) and torch.equal(unit, torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_descriptors_equal_validated_ones(dtype: torch.dtype) -> None:
    """The Gluon prefill's TMA descriptors, copies of one validated descriptor per row
    stride, width, block and dtype, equal descriptors Triton makes and validates for
    each tensor: over token counts, head strides (a slice of wider heads) and blocks."""
    _clear()
    wide = torch.empty(300, 16, 256, dtype=dtype)
    for x in (wide[:, :, :192], wide[:17, :8, :128], wide[:1], torch.empty(5, 2, 64, dtype=dtype)):
        for block in ([128, 64], [64, 64], [128, 128]):
            tokens, heads, dim = x.shape
            cols = (heads - 1) * x.stride(1) + dim
            made = prefill_gluon._descriptor(x, block)
            fresh = prefill_gluon.TensorDescriptor(
                x, [tokens, cols], [x.stride(0), 1], block, prefill_gluon._layout(block, dtype)
            )
            assert made == fresh and made.base is x
