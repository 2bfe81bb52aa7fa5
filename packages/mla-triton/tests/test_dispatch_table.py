"""Decode's dispatch table (``ops.decode.dispatch``): its rows, and the decisions of
``decode`` and ``decode_shadow`` over a grid of call facts against the decisions recorded
in ``dispatch_expected.json``.

The grid runs the public calls with the facts patched in (``gluon.gluon_facts``) and the
split-K core captured (``run_decode``: the family and tile config a call would launch):
auto and every forced implementation (names and configs), every recipe of the tests
(on read, and the shadows of both storages), on a grid of platforms (capability, the
interpreter, the Gluon API, dtype, widths, strides, alignment) and head counts. A
decision is ``family class: config`` or the ValueError's message.

``python tests/test_dispatch_table.py --record`` rewrites the JSON file from the code
(the expectations were recorded before the table replaced the rules it encodes).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

import mla_triton
import mla_triton.ops.decode as decode_mod
import mla_triton.ops.shadow as shadow_mod
from mla_formats import AttentionQuant, OperandQuant
from mla_triton import tuning
from mla_triton.ops.decode import dispatch
from mla_triton.ops.decode import gluon as gd
from mla_triton.ops.decode import gluon_ws as ws
from mla_triton.ops.shadow import AUTO_GLUON_SHADOWS

EXPECTED = Path(__file__).with_name("dispatch_expected.json")

ON_READ_RECIPES: dict[str, AttentionQuant | None] = {
    "none": None,
    "identity": AttentionQuant(),
    "fp8": AttentionQuant.uniform("fp8"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "qp-fp8": AttentionQuant(q="fp8", p="fp8"),
    "kv-fp8": AttentionQuant(k="fp8", v="fp8"),
    "kv-fp8-scale-3": AttentionQuant(k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0)),
    "k-fp8": AttentionQuant(k="fp8"),
    "kdyn-fp8": AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="fp8"),
    "kdyn-nvfp4": AttentionQuant(k=OperandQuant("nvfp4", "dynamic"), v="nvfp4"),
    "q-nvfp4": AttentionQuant(q="nvfp4"),
    "p-nvfp4": AttentionQuant(p="nvfp4"),
    "kv-nvfp4": AttentionQuant(k="nvfp4", v="nvfp4"),
    "k-fp8-v-nvfp4": AttentionQuant(q="fp8", k="fp8", v="nvfp4", p="fp8"),
    "v-fp8": AttentionQuant(v="fp8"),
    "nvfp4-v-scale-3": AttentionQuant(
        q="nvfp4", k="nvfp4", v=OperandQuant("nvfp4", 3.0), p="nvfp4"
    ),
    "nvfp4-qdyn": AttentionQuant(
        q=OperandQuant("nvfp4", "dynamic"), k="nvfp4", v="nvfp4", p="nvfp4"
    ),
    "qdyn-fp8": AttentionQuant(q=OperandQuant("fp8", "dynamic"), k="fp8", v="fp8", p="fp8"),
}
"""The recipes of ``decode`` (on read)."""

SHADOW_RECIPES: dict[str, AttentionQuant] = {
    "identity": AttentionQuant(),
    "qp-fp8": AttentionQuant(q="fp8", p="fp8"),
    "fp8": AttentionQuant.uniform("fp8"),
    "fp8-q-none": AttentionQuant(k="fp8", v="fp8", p="fp8"),
    "fp8-scale-3": AttentionQuant(
        q="fp8", k=OperandQuant("fp8", 3.0), v=OperandQuant("fp8", 3.0), p="fp8"
    ),
    "fp8-p-nvfp4": AttentionQuant(q="fp8", k="fp8", v="fp8", p="nvfp4"),
    "nvfp4": AttentionQuant.uniform("nvfp4"),
    "nvfp4-v-scale-3": AttentionQuant(
        q="nvfp4", k="nvfp4", v=OperandQuant("nvfp4", 3.0), p="nvfp4"
    ),
    "kv-nvfp4": AttentionQuant(k="nvfp4", v="nvfp4"),
    "fp8-kdyn": AttentionQuant(q="fp8", k=OperandQuant("fp8", "dynamic"), v="fp8", p="fp8"),
    "fp8-k2-v": AttentionQuant(q="fp8", k=OperandQuant("fp8", 2.0), v="fp8"),
    "k-none-v-nvfp4": AttentionQuant(v="nvfp4", p="nvfp4"),
    "kdyn-nvfp4-vfp8": AttentionQuant(
        q="fp8", k=OperandQuant("nvfp4", "dynamic"), v="fp8", p="nvfp4"
    ),
    "kdyn-fp8-vnvfp4": AttentionQuant(k=OperandQuant("fp8", "dynamic"), v="nvfp4", p="fp8"),
    "calibrated": AttentionQuant(
        q=OperandQuant("nvfp4", 12.0),
        k=OperandQuant("fp8", 5.0),
        v=OperandQuant("nvfp4", 100.0),
        p="nvfp4",
    ),
    "k-only": AttentionQuant(q="nvfp4", k="nvfp4"),
    "v-only": AttentionQuant(v="nvfp4", p="fp8"),
    "k-fp8-only": AttentionQuant(q="fp8", k="fp8"),
}
"""The recipes of ``decode_shadow`` (each in both storages)."""

FORCED: dict[str, tuple[str, object]] = {
    "auto": ("auto", None),
    "triton": ("triton", None),
    "gluon": ("gluon", None),
    "gluon_ws": ("gluon_ws", None),
    "triton-cfg": (
        "triton",
        tuning.TritonDecode(block_h=16, block_n=32, num_warps=4, num_stages=2),
    ),
    "gluon-bn64": ("gluon", gd.VARIANTS[0]),
    "gluon-sepv": ("gluon", gd.SEPARATE_V_CONFIG),
    "gluon-vb": ("gluon", gd.ON_READ_BLOCKS_CONFIG),
    "ws-default": ("gluon_ws", ws.DEFAULT_CONFIG),
    "ws-nvfp4": ("gluon_ws", ws.NVFP4_CONFIG),
    "ws-packed": ("gluon_ws", ws.NVFP4_PACKED_CONFIG),
}
"""``tuning.use`` choices: none (auto), implementation names, configs."""


@dataclass(frozen=True)
class Platform:
    """The facts of a call but its recipe and head count."""

    device: str  # "cpu" or the capability "9.0"
    interpreting: bool
    api_missing: bool
    dtype: str
    widths: tuple[int, int]
    strides: tuple[int, int]
    aligned: bool

    @property
    def key(self) -> str:
        flags = f"{int(self.interpreting)}|{int(self.api_missing)}"
        widths = f"{self.widths[0]}+{self.widths[1]}"
        return f"{self.device}|{flags}|{self.dtype}|{widths}|{self.strides[1]}|{int(self.aligned)}"


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
STRIDES = ((64 * 576, 576), (64 * 584, 584), (64 * 580, 580))  # 16-, 8-aligned, neither
GOOD = Platform("9.0", False, False, "bf16", (512, 64), STRIDES[0], True)
HEADS = (1, 16, 32, 33, 64, 128)


def platforms() -> Iterator[Platform]:
    """Every combination of the platform facts (CPU: no capability)."""
    for device, interp, api, dtype, widths, strides, aligned in itertools.product(
        ("cpu", "8.0", "9.0", "10.0"), (False, True), (False, True), tuple(DTYPES),
        ((512, 64), (256, 64)), STRIDES, (True, False),
    ):  # fmt: skip
        yield Platform(device, interp, api, dtype, widths, strides, aligned)


def _facts(p: Platform) -> Callable[..., gd.GluonFacts]:
    capability = None if p.device == "cpu" else tuple(int(x) for x in p.device.split("."))

    def facts(q: torch.Tensor, kv_cache: torch.Tensor, quant: Any, kv_lora_rank: int) -> Any:
        return gd.GluonFacts(
            device_type="cpu" if p.device == "cpu" else "cuda", capability=capability,
            interpreting=p.interpreting,
            api_missing="Triton 3.7.0: no Gluon" if p.api_missing and capability == (9, 0)
            else None,
            dtype=DTYPES[p.dtype], quant=quant, heads=q.shape[1], kv_lora_rank=p.widths[0],
            rope=p.widths[1], kv_strides=p.strides, kv_aligned=p.aligned,
        )  # fmt: skip

    return facts


class _CapturedError(Exception):
    def __init__(self, family: Any, config: Any) -> None:
        self.family, self.config = family, config


def _capture(*args: Any, **kwargs: Any) -> Any:
    raise _CapturedError(args[5], kwargs.get("config"))


def _describe(family: Any, config: Any) -> str:
    """The family's class, its kernel config and what it reads; the Triton config."""
    name = getattr(getattr(family, "config", None), "name", None)
    reads = [a for a in ("packed", "v_sep") if getattr(family, a, False)]
    reads += ["sections"] if getattr(family, "sections", None) is not None else []
    cfg = "" if config is None else f" {config}"
    return f"{type(family).__name__}:{name}{''.join('+' + r for r in reads)}{cfg}"


@cache
def _case(heads: int, dtype: str) -> tuple[torch.Tensor, ...]:
    real = torch.float16 if dtype == "fp16" else torch.bfloat16
    q = torch.zeros(1, heads, 576, dtype=real)
    cache_ = torch.zeros(7, 64, 576, dtype=real)
    table = torch.zeros(1, 2, dtype=torch.int32)
    return q, cache_, table, torch.tensor([5], dtype=torch.int32)


@cache
def _shadow(name: str, storage: str) -> torch.Tensor | str:
    try:
        return mla_triton.allocate_shadow(7, 64, SHADOW_RECIPES[name], storage=storage)
    except ValueError as e:
        return f"ValueError: {e}"


def decide(p: Platform, heads: int, op: str, recipe: str, forced: str) -> str:
    """What ``decode`` (``op`` ``"decode"``) or ``decode_shadow`` (``"fp16"``/``"packed"``:
    its storage) does for one case: the captured family and config, or the error."""
    q, cache_, table, seq = _case(heads, p.dtype)
    impl, config = FORCED[forced]
    choice: Any = config if config is not None else impl
    use = nullcontext() if impl == "auto" else tuning.use(choice)
    with ExitStack() as stack:
        mp = stack.enter_context(pytest.MonkeyPatch.context())
        mp.setattr(gd, "gluon_facts", _facts(p))
        mp.setattr(decode_mod, "run_decode", _capture)
        mp.setattr(shadow_mod, "run_decode", _capture)
        try:
            with use:
                if op == "decode":
                    mla_triton.decode(q, cache_, table, seq, softmax_scale=0.1,
                                      quant=ON_READ_RECIPES[recipe])  # fmt: skip
                else:
                    shadow = _shadow(recipe, op)
                    if isinstance(shadow, str):
                        return shadow
                    mla_triton.decode_shadow(q, cache_, shadow, table, seq, softmax_scale=0.1,
                                             quant=SHADOW_RECIPES[recipe], storage=op)  # fmt: skip
        except _CapturedError as c:
            return _describe(c.family, c.config)
        except ValueError as e:
            return f"ValueError: {e}"
    raise AssertionError("no launch and no error")


def _ops() -> Iterator[tuple[str, str]]:
    yield from (("decode", r) for r in ON_READ_RECIPES)
    yield from ((st, r) for st in ("fp16", "packed") for r in SHADOW_RECIPES)


PLATFORM_RECIPES = (("decode", "none"), ("decode", "nvfp4"), ("decode", "fp8"),
                    ("fp16", "fp8"), ("fp16", "nvfp4"), ("fp16", "kdyn-nvfp4-vfp8"),
                    ("packed", "nvfp4"))  # fmt: skip
"""The recipes the whole platform grid runs (one of each dispatch row, and a refused one)."""


def cases() -> Iterator[tuple[str, tuple[Platform, int, str, str, str]]]:
    """(key, case): every platform at 16 and 128 heads for ``PLATFORM_RECIPES``, auto and
    forced by name; every recipe, head count and forced choice on sm90 platforms the
    Gluon kernels take (both dtypes, strides of 16 and 8 elements, and not 8); each key
    once."""
    seen: set[str] = set()
    for key, case in _grid():
        if key not in seen:
            seen.add(key)
            yield key, case


def _grid() -> Iterator[tuple[str, tuple[Platform, int, str, str, str]]]:
    for p in platforms():
        for heads, (op, recipe), forced in itertools.product(
            (16, 128), PLATFORM_RECIPES, ("auto", "gluon", "gluon_ws")
        ):
            yield f"{p.key}|{heads}|{op}|{recipe}|{forced}", (p, heads, op, recipe, forced)
    for dtype, strides in itertools.product(("bf16", "fp16"), STRIDES):
        p = Platform("9.0", False, False, dtype, (512, 64), strides, True)
        for heads, (op, recipe), forced in itertools.product(HEADS, _ops(), FORCED):
            yield f"{p.key}|{heads}|{op}|{recipe}|{forced}", (p, heads, op, recipe, forced)


def record() -> dict[str, str]:
    return {key: decide(*case) for key, case in cases()}


def _load() -> dict[str, str]:
    """The recorded decisions by case key (the file: the distinct decisions, and each
    case's index into them in ``cases()``' order)."""
    data = json.loads(EXPECTED.read_text())
    vocab: list[str] = data["decisions"]
    keys = [key for key, _ in cases()]
    assert len(keys) == len(data["cases"]) == data["count"]
    return {key: vocab[i] for key, i in zip(keys, data["cases"], strict=True)}


def test_decisions_match_the_recorded_ones() -> None:
    """Every case of the grid decides as recorded (auto and forced, messages included)."""
    want = _load()
    got = record()
    assert got.keys() == want.keys()
    differ = [(k, want[k], got[k]) for k in want if want[k] != got[k]]
    assert not differ, (len(differ), differ[:5])


def test_rows_are_consistent() -> None:
    """Each row: its op, an implementation of the op, a config of that implementation,
    a head floor, a recipe set; no recipe kind is in two rows of one op and
    implementation; a shadow row of the warp-specialized kernel names a shadow it reads,
    with the tiles ``ws_shadow_default`` gives it; ``AUTO_GLUON_SHADOWS`` is the shadow
    rows' recipes."""
    configs = {"gluon": gd.GluonDecodeConfig, "gluon_ws": ws.WsConfig}
    seen: set[tuple[str, str, gd.GluonRecipe | None]] = set()
    for row in dispatch.TABLE:
        assert row.op in ("decode", "decode_shadow") and row.min_heads >= 1 and row.why
        assert isinstance(row.config, configs[row.impl]), row
        for kind in row.recipes if row.recipes is not None else (None,):
            assert (row.op, row.impl, kind) not in seen, row
            seen.add((row.op, row.impl, kind))
            assert kind is None or gd.recipe_kind(kind) == kind
            if row.op == "decode_shadow" and row.impl == "gluon_ws":
                assert kind is not None and ws.ws_shadow_dispatched(kind)
                assert ws.ws_shadow_default(kind) == row.config
    shadows = {k for r in dispatch.TABLE if r.op == "decode_shadow" for k in r.recipes or ()}
    assert shadows == AUTO_GLUON_SHADOWS


@pytest.mark.parametrize("heads", HEADS)
def test_lookup_by_heads(heads: int) -> None:
    """The rows ``"auto"`` reaches at each head count: recipe none and the shadows the
    warp-specialized kernel reads at any, the Gluon split kernel above 32 heads only."""
    fp8 = gd.gluon_recipe(AttentionQuant.uniform("fp8"))
    nv = gd.gluon_recipe(AttentionQuant.uniform("nvfp4"))
    assert isinstance(fp8, gd.GluonRecipe) and isinstance(nv, gd.GluonRecipe)
    want = {
        ("decode", gd.UNQUANTIZED): ("gluon_ws", ws.DEFAULT_CONFIG),
        ("decode", gd.recipe_kind(fp8)): ("gluon", gd.VARIANTS[0]) if heads > 32 else None,
        ("decode", gd.recipe_kind(nv)): ("gluon", gd.ON_READ_BLOCKS_CONFIG) if heads > 32 else None,
        ("decode_shadow", ws.FP8_SHADOW): ("gluon_ws", ws.DEFAULT_CONFIG),
        ("decode_shadow", ws.NVFP4_SHADOW): ("gluon_ws", ws.NVFP4_CONFIG),
        ("decode_shadow", ws.NVFP4_PACKED): ("gluon_ws", ws.NVFP4_PACKED_CONFIG),
        ("decode_shadow", dispatch.KDYN_SECTION): ("gluon", gd.SEPARATE_V_CONFIG)
        if heads > 32
        else None,
        ("decode_shadow", gd.UNQUANTIZED): None,
    }
    for (op, kind), expected in want.items():
        row = dispatch.lookup(op, kind, heads)
        assert (None if row is None else (row.impl, row.config)) == expected, (op, kind)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    decisions = record()
    vocab = sorted(set(decisions.values()))
    index = {d: i for i, d in enumerate(vocab)}
    cases_ = ",".join(str(index[d]) for d in decisions.values())
    listed = json.dumps(vocab, indent=1, ensure_ascii=False)
    count = len(decisions)
    EXPECTED.write_text(f'{{"count": {count},\n"decisions": {listed},\n"cases": [{cases_}]}}\n')
    print(len(decisions), "cases,", len(vocab), "decisions")
