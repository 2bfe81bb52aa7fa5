"""Replayed calls (``common.replay``) launch what the full call launches (CPU).

A call repeated with the same metadata replays the launches recorded from its first
calls. These tests compare, argument by argument, the launches of a replayed call with
those of the full call on the same tensors (on the CPU's dispatch and as on an H200,
with launches stubbed), check the output of replayed interpreter launches bit for bit,
and check that whatever depends on more than the key (values checked on the host, a
shadow's recipe) is never replayed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler.compiler import CompiledKernel, LazyDict
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, native_specialize_impl

import mla_triton
from mla_formats import AttentionQuant
from mla_triton.common import replay
from mla_triton.common.intercept import LOCK, ours
from mla_triton.common.replay import REPLAY, Pointer

SCALE = 192**-0.5
FP8 = AttentionQuant.uniform("fp8")
NVFP4 = AttentionQuant.uniform("nvfp4")


@pytest.fixture
def stubbed() -> Iterator[list[tuple[str, Any, Any, Any]]]:
    """Launches of this package's kernels logged, not run (kernel name, grid, args, kwargs)."""
    log: list[tuple[str, Any, Any, Any]] = []
    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def make(original: Any) -> Any:
        def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
            if not ours(self):
                return original(self, *args, grid=grid, warmup=warmup, **kwargs)
            log.append((self.fn.__name__, grid, args, kwargs))
            return None

        return run

    for cls, original in originals.items():
        cls.run = make(original)  # type: ignore[method-assign]
    try:
        yield log
    finally:
        for cls, original in originals.items():
            cls.run = original  # type: ignore[method-assign]


def _plain(
    v: Any, places: list[torch.Tensor], seen: dict[int, int] | None = None, pointers: bool = False
) -> Any:
    """A launch argument as data; a tensor as its metadata and its place: which of
    ``places`` holds its memory and at which byte offset, else the order in which its
    memory first appeared (scratch the call allocated, a cached placeholder).
    ``pointers``: a tensor or ``Pointer`` as what a compiled launch reads of it, its
    dtype and place."""
    seen = {} if seen is None else seen
    if isinstance(v, (torch.Tensor, Pointer)):
        meta = (v.dtype,) if pointers else (v.dtype, tuple(v.shape), v.stride())
        address = v.data_ptr()
        for i, p in enumerate(places):
            lo = p.data_ptr()
            if lo <= address < lo + max(p.untyped_storage().nbytes(), 1):
                return (*meta, i, address - lo)
        if pointers or isinstance(v, Pointer):
            return (*meta, "other", seen.setdefault(address, len(seen)))
        storage = v.untyped_storage().data_ptr()
        return (*meta, "other", seen.setdefault(storage, len(seen)), address - storage)
    if hasattr(v, "block_shape") and hasattr(v, "base"):
        shapes = (tuple(x) for x in (v.shape, v.strides, v.block_shape))
        return (_plain(v.base, places, seen, pointers), *shapes)
    if isinstance(v, (tuple, list)):
        return type(v)(_plain(x, places, seen, pointers) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x, places, seen, pointers) for k, x in v.items()}
    return v


Call = Callable[[], tuple[torch.Tensor, torch.Tensor]]


def _decode_case(
    heads: int, quant: AttentionQuant | None, given: bool, dtype: torch.dtype = torch.float16
) -> tuple[Call, list]:
    q = torch.randn(3, heads, 576, dtype=dtype)
    cache = torch.randn(6, 64, 576, dtype=dtype)
    table = torch.randperm(6, dtype=torch.int32).reshape(3, 2)
    lens = torch.tensor([5, 64, 128], dtype=torch.int32)
    ws = torch.empty(mla_triton.decode_workspace_size(3, heads, 128), dtype=torch.uint8)
    out = torch.empty(3, heads, 512, dtype=q.dtype) if given else None
    lse = torch.empty(3, heads) if given else None

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return mla_triton.decode(q, cache, table, lens, softmax_scale=SCALE, quant=quant,
                                 workspace=ws, out=out, lse=lse, max_seq_len=128,
                                 check_values=False)  # fmt: skip

    return call, [t for t in (q, cache, table, lens, ws, out, lse) if t is not None]


def _shadow_case(
    heads: int, quant: AttentionQuant, storage: str, dtype: torch.dtype = torch.float16
) -> tuple[Call, list]:
    q = torch.randn(3, heads, 576, dtype=dtype)
    cache = torch.randn(6, 64, 576, dtype=dtype)
    shadow = mla_triton.allocate_shadow(6, 64, quant, storage=storage)
    table = torch.randperm(6, dtype=torch.int32).reshape(3, 2)
    lens = torch.tensor([5, 64, 128], dtype=torch.int32)
    ws = torch.empty(mla_triton.decode_workspace_size(3, heads, 128), dtype=torch.uint8)

    def call() -> tuple[torch.Tensor, torch.Tensor]:
        return mla_triton.decode_shadow(q, cache, shadow, table, lens, softmax_scale=SCALE,
                                        quant=quant, storage=storage, workspace=ws,
                                        max_seq_len=128, check_values=False)  # fmt: skip

    return call, [q, cache, shadow, table, lens, ws]


def _update_case(
    tokens: int, quant: AttentionQuant, storage: str, dtype: torch.dtype = torch.float16
) -> tuple[Callable[[], None], list]:
    kv_c, k_pe = torch.randn(tokens, 512, dtype=dtype), torch.randn(tokens, 64, dtype=dtype)
    cache = torch.zeros(6, 64, 576, dtype=dtype)
    shadow = mla_triton.allocate_shadow(6, 64, quant, storage=storage)
    slots = torch.arange(40, 40 + tokens, dtype=torch.int64)  # crosses a 16-token block

    def call() -> None:
        mla_triton.update_cache(kv_c, k_pe, cache, slots, shadow, quant=quant, storage=storage,
                                check_values=False)  # fmt: skip

    return call, [kv_c, k_pe, cache, slots, shadow]


def _prefill_case(
    heads: int, quant: AttentionQuant | None, lse: bool, dtype: torch.dtype = torch.float16
) -> tuple[Call, list]:
    q, k = torch.randn(80, heads, 192, dtype=dtype), torch.randn(80, heads, 192, dtype=dtype)
    v = torch.randn(80, heads, 128, dtype=dtype)
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)

    def call() -> Any:
        return mla_triton.prefill(q, k, v, cu, cu, softmax_scale=SCALE, quant=quant,
                                  return_lse=lse, max_seqlen_q=50, max_seqlen_k=50)  # fmt: skip

    return call, [q, k, v, cu]


CASES = [
    *[("decode", h, r, g) for h in (128, 16) for r in (None, FP8, NVFP4) for g in (True, False)],
    *[("shadow", h, r, s) for h in (128, 16) for r in (FP8, NVFP4) for s in ("fp16", "packed")],
    *[("update", t, r, s) for t in (1, 20) for r in (FP8, NVFP4) for s in ("fp16", "packed")],
    *[("prefill", h, r, x) for h in (128, 16) for r in (None, FP8, NVFP4) for x in (True, False)],
]


def _tensors(result: Any) -> tuple[torch.Tensor, ...]:
    """A call's result as a tuple of tensors (``update_cache`` returns None)."""
    if result is None:
        return ()
    return result if isinstance(result, tuple) else (result,)


def _case(case: tuple[str, int, Any, Any], dtype: torch.dtype) -> tuple[Call, list]:
    op, heads, quant, extra = case
    if op == "decode":
        return _decode_case(heads, quant, extra, dtype)
    if op == "prefill":
        return _prefill_case(heads, quant, extra, dtype)
    if op == "update":
        return _update_case(heads, quant, extra, dtype)
    return _shadow_case(heads, quant, extra, dtype)


@pytest.mark.parametrize("platform", ["cpu", "sm90"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c)[:40])
def test_replayed_launches_are_the_full_calls(
    case: tuple[str, int, Any, Any], platform: str, stubbed: list, request: pytest.FixtureRequest
) -> None:
    """After a call and two recorded calls, a fourth call on other tensors of the same metadata is
    replayed and launches exactly what the full call launches on those tensors (bfloat16
    as on an H200, where the kernels are compiled and a replay passes views as ``Pointer``;
    float16 on the CPU, where the interpreter runs bfloat16 on copies, which are never
    replayed)."""
    dtype = torch.float16
    pointers = platform == "sm90"
    if pointers:
        request.getfixturevalue("as_sm90")
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.setattr(replay, "InterpretedFunction", type("NoInterpreter", (), {}))
        dtype = torch.bfloat16
    first, _ = _case(case, dtype)
    for _ in range(3):  # seen, recorded, recorded and compared: a plan
        first()
    call, inputs = _case(case, dtype)  # new tensors: other addresses, same metadata
    if case[0] == "update":
        call()  # a shadow is replayed once stamped by a full call
    stubbed.clear()
    result = call()
    result = _tensors(result)
    assert len(REPLAY._plans) == 1 and REPLAY.planned(next(iter(REPLAY._plans)))
    launched = [arg for _, _, args, kwargs in stubbed for arg in (*args, *kwargs.values())]
    replayed = _plain(list(stubbed), [*inputs, *result], pointers=pointers)
    REPLAY.clear()
    stubbed.clear()
    full_result = call()
    full_result = _tensors(full_result)
    full = _plain(list(stubbed), [*inputs, *full_result], pointers=pointers)
    assert replayed == full
    assert replayed
    if case[0] in ("decode", "shadow"):  # they read views of their inputs (others: not all)
        assert _has_pointer(launched) == pointers
    assert [(t.shape, t.dtype, t.stride()) for t in result] == [
        (t.shape, t.dtype, t.stride()) for t in full_result
    ]


def _has_pointer(v: Any) -> bool:
    if isinstance(v, Pointer):
        return True
    if isinstance(v, (tuple, list)):
        return any(_has_pointer(x) for x in v)
    return _has_pointer(v.base) if hasattr(v, "block_shape") and hasattr(v, "base") else False


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8, torch.int32]
)
def test_pointer_specializes_as_the_tensor(dtype: torch.dtype) -> None:
    """What a replay on a GPU relies on: Triton types a ``Pointer`` as it types the tensor
    view it stands for (element type, 16-byte alignment), so the replay launches the
    kernel the full call compiled."""
    base = torch.empty(64, dtype=dtype)
    for offset in (0, 1, 4, 8):
        view = base[offset:]
        pointer = Pointer(view.data_ptr(), view.dtype)
        for const in (False, True):
            assert native_specialize_impl(BaseBackend, pointer, const, True, True) == (
                native_specialize_impl(BaseBackend, view, const, True, True)
            )
    assert pointer.data_ptr() == view.data_ptr()


def test_replayed_output_is_bit_identical() -> None:
    """Under Triton's interpreter: the replayed kernels compute the full call's output, and
    a ``max_seq_len`` that moves within one split-policy step (an engine's growing batch
    maximum) keeps the plan."""
    q = torch.randn(2, 16, 576, dtype=torch.float16)
    cache = torch.randn(4, 16, 576, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([20, 32], dtype=torch.int32)
    ws = torch.empty(mla_triton.decode_workspace_size(2, 16, 32), dtype=torch.uint8)

    def call(x: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_triton.decode(x, cache, table, lens, softmax_scale=SCALE, quant=FP8,
                                 workspace=ws, max_seq_len=bound, check_values=False)  # fmt: skip

    for bound in (30, 31, 32):
        call(q, bound)
    q2 = torch.randn(2, 16, 576, dtype=torch.float16)
    out, lse = call(q2, 32)
    assert len(REPLAY._plans) == 1 and REPLAY.planned(next(iter(REPLAY._plans)))
    REPLAY.clear()
    ref_out, ref_lse = call(q2, 32)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    assert not torch.equal(out, call(q, 32)[0])  # the replay read the new q


def test_value_checks_and_recipes_are_never_skipped(stubbed: list) -> None:
    """Host value checks (``check_values``, CPU ``seq_lens`` by default) always run, and a
    shadow stamped for another recipe is refused after its shape was replayed."""
    call, (q, cache, table, lens, ws, _, _) = _decode_case(16, FP8, True)
    for _ in range(3):
        mla_triton.decode(q, cache, table, lens, softmax_scale=SCALE, quant=FP8, workspace=ws)
    assert not REPLAY._plans  # values checked on the host: no plan
    call()
    call()
    bad = torch.tensor([5, 64, 10**6], dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_triton.decode(q, cache, table, bad, softmax_scale=SCALE, quant=FP8, workspace=ws,
                          max_seq_len=128, check_values=True)  # fmt: skip

    call, (q, cache, shadow, table, lens, ws) = _shadow_case(16, FP8, "fp16")
    call()
    call()
    scaled = AttentionQuant(q="fp8", k=FP8.k.__class__("fp8", 2.0), v=FP8.v.__class__("fp8", 2.0),
                            p="fp8")  # fmt: skip
    other = mla_triton.allocate_shadow(6, 64, scaled, storage="fp16")
    assert other.shape == shadow.shape
    with pytest.raises(ValueError, match="quant"):
        mla_triton.decode_shadow(q, cache, other, table, lens, softmax_scale=SCALE, quant=FP8,
                                 storage="fp16", workspace=ws, max_seq_len=128,
                                 check_values=False)  # fmt: skip


def test_prefill_replays_only_vouched_offsets(stubbed: list) -> None:
    """A prefill that reads its offsets on the host (no ``max_seqlen_q``/``max_seqlen_k``)
    is never replayed: its checks run at every call; a vouched one is, per bound."""
    q, k = (torch.randn(80, 16, 192, dtype=torch.float16) for _ in range(2))
    v = torch.randn(80, 16, 128, dtype=torch.float16)
    cu = torch.tensor([0, 30, 80], dtype=torch.int32)
    for _ in range(3):
        mla_triton.prefill(q, k, v, cu, cu, softmax_scale=SCALE, quant=FP8)
    assert not REPLAY._plans
    bad = torch.tensor([0, 30, 81], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        mla_triton.prefill(q, k, v, bad, cu, softmax_scale=SCALE, quant=FP8)
    for bound in (50, 50, 50, 64):
        mla_triton.prefill(q, k, v, cu, cu, softmax_scale=SCALE, quant=FP8, max_seqlen_q=bound,
                           max_seqlen_k=bound)  # fmt: skip
    assert sorted(REPLAY.planned(key) for key in REPLAY._plans) == [False, True]


def test_misaligned_workspace_is_still_refused(stubbed: list) -> None:
    """The key holds each address modulo 16: a workspace the launch paths refuse is
    refused after its aligned twin was replayed."""
    call, (q, cache, table, lens, ws, out, lse) = _decode_case(128, FP8, True)
    call()
    call()
    call()
    big = torch.empty(ws.numel() + 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="workspace"):
        mla_triton.decode(q, cache, table, lens, softmax_scale=SCALE, quant=FP8,
                          workspace=big[1 : 1 + ws.numel()], out=out, lse=lse, max_seq_len=128,
                          check_values=False)  # fmt: skip


INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@pytest.mark.skipif(not INTERPRETED, reason="the direct-launch test runs in this process")
def test_direct_launch_test_in_child() -> None:
    """The direct-launch test passes in a child pytest with TRITON_INTERPRET=0 (compiled
    kernels' launch path, not the interpreter's)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__]
    done = subprocess.run(
        [*cmd, "-k", "test_direct_launches_are_what_run_launches"],
        env=os.environ | {"TRITON_INTERPRET": "0"}, capture_output=True, text=True,
        check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert f"{len(DIRECT_CASES)} passed" in done.stdout, done.stdout[-2000:]


class _Driver:
    """Triton's active driver as on an H200, on a CPU: device 0, a fixed stream."""

    device = 0

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return 0x5EED

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


class _Compiled:
    """A compiled kernel whose launcher logs what it is given; launched as Triton
    launches its compiled kernels (``CompiledKernel.__getitem__`` and
    ``launch_metadata``, the real ones)."""

    __getitem__ = CompiledKernel.__getitem__
    launch_metadata = CompiledKernel.launch_metadata

    def __init__(self, name: str, log: list[Any]) -> None:
        self.name, self.log = name, log
        self.function, self.packed_metadata = hash(name), ("metadata", name)
        self.src = None  # not an ASTSource: no launch_metadata function of the kernel

    def _init_handles(self) -> None:
        pass

    def run(self, *args: Any) -> None:
        self.log.append((self.name, *args))


def _launcher_args(log: list[Any], places: list[torch.Tensor]) -> list[Any]:
    """What each launcher was given, its memory arguments placed in ``places`` (as
    ``_plain`` does), the launch metadata as its items and Triton's hooks by identity."""
    seen: dict[int, int] = {}
    return [
        tuple(
            ("metadata", sorted(x.get().items())) if isinstance(x, LazyDict)
            else _plain(x, places, seen, pointers=True)
            for x in launch
        )
        for launch in log
    ]  # fmt: skip


DIRECT_CASES = [
    ("decode", 128, FP8, True), ("decode", 16, NVFP4, False), ("decode", 128, None, True),
    ("shadow", 128, FP8, "fp16"), ("shadow", 128, NVFP4, "packed"), ("shadow", 16, NVFP4, "fp16"),
    ("update", 20, NVFP4, "packed"), ("update", 20, FP8, "fp16"),
    ("prefill", 16, FP8, True), ("prefill", 128, NVFP4, False), ("prefill", 16, None, True),
]  # fmt: skip


@pytest.mark.skipif(INTERPRETED, reason="run in a child process without the interpreter")
@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: "-".join(str(x) for x in c)[:40])
def test_direct_launches_are_what_run_launches(
    case: tuple[str, int, Any, Any], as_sm90: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan's direct launches hand each compiled kernel's launcher exactly what Triton's
    ``JITFunction.run`` hands it for the full call on the same tensors: grid, stream,
    function, metadata and every argument (the oracle is Triton's own binding, with the
    compiles replaced by launch logs)."""
    log: list[Any] = []
    runs: list[str] = []
    real_run = JITFunction.run

    def compile_logged(self: Any, key: Any, signature: Any, device: Any, *rest: Any) -> Any:
        compiled = _Compiled(self.fn.__name__, log)
        self.device_caches[device][0][key] = compiled
        return compiled

    def run_counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        runs.append(self.fn.__name__)
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", compile_logged)
    monkeypatch.setattr(JITFunction, "run", run_counted)
    active = _Driver()
    monkeypatch.setattr(driver, "_active", active)
    if case[0] == "prefill":  # its checks take CPU tensors under the interpreter's flag only
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # (the kernels stay compiled ones)
    first, _ = _case(case, torch.bfloat16)
    for _ in range(4):  # seen, recorded, recorded (a plan), replayed through run
        first()
    call, inputs = _case(case, torch.bfloat16)  # other tensors, the same metadata
    if case[0] == "update":
        call()  # a shadow is replayed once stamped by a full call
    log.clear()
    runs.clear()
    result = call()
    result = _tensors(result)
    direct = _launcher_args(log, [*inputs, *result])
    assert not runs and direct  # launched directly, not through run
    with LOCK:  # launches intercepted (a warm-up's compile-only pass): through run
        call()
    assert runs
    runs.clear()
    active.device = 1
    call()  # another current device: through run (its own compiled kernels)
    assert runs
    active.device = 0
    REPLAY.clear()
    log.clear()
    full_result = call()
    full_result = _tensors(full_result)
    assert runs  # the full call went through run
    assert direct == _launcher_args(log, [*inputs, *full_result])
