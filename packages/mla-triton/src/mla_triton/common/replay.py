"""Replaying a call's launches: the host time of a call repeated with the same metadata.

A serving engine calls ``decode`` (or ``decode_shadow``) every step with tensors of the
same shapes, strides, dtypes and devices; only their addresses and values change. The
argument checks, the dispatch and the building of the kernels' arguments then decide the
same launches every time, and they are most of an eager call's host time. ``Replay``
notes a call's *key* (the tensors' metadata, their addresses modulo 16 and the other
arguments), records the launches of the key's next two calls, proves that they are the
same function of the inputs, and then replays them: the same kernels, grids and
arguments on the new call's tensors, without running the Python that chose them.

The proof, from the two recordings: every tensor a launch takes is a view of an input at
a fixed byte offset from that input's address, or of memory the call allocated
(allocated again by the replay), or one object that both calls passed (a cached
placeholder); every other
argument is equal; and the call ran no torch operation other than reading metadata,
taking views and allocating (``_PURE``): nothing that reads values. Anything else (a
copy, a value read on the host, a launch by another thread's warm-up) leaves the key
without a plan, and its calls run in full. A call that raises records nothing.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch.overrides import TorchFunctionMode
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from mla_triton.common.device import GLUON_TRITON, triton_release
from mla_triton.common.intercept import LOCK, Args, Kwargs, Run, intercept

R = TypeVar("R")

_PURE = frozenset({
    "TensorBase.__getitem__", "TensorBase.data_ptr", "TensorBase.dim", "TensorBase.element_size",
    "TensorBase.is_contiguous", "TensorBase.numel", "TensorBase.size", "TensorBase.stride",
    "TensorBase.storage_offset", "TensorBase.view", "getset_descriptor.__get__",
    "_VariableFunctionsClass.empty", "_VariableFunctionsClass.empty_strided",
})  # fmt: skip
"""The torch functions a replayable call may run: metadata, views, allocations."""
_ALLOCATE = frozenset({"_VariableFunctionsClass.empty", "_VariableFunctionsClass.empty_strided"})
_MAX_PLANS = 256
_TRIES = 3
"""Recordings that are not replayable before a key is given up (the first call of a
recipe fills the launch paths' memos with torch arithmetic)."""


class _Watch(TorchFunctionMode):
    """Notes whether a torch function outside ``_PURE`` ran (and which)."""

    def __init__(self) -> None:
        super().__init__()
        self.impure: str | None = None
        self.launching = False  # a launch's own work (the interpreter's copies) is not the call's
        self.allocated: list[torch.Tensor] = []  # by the call, in order

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        result = func(*args, **(kwargs or {}))
        if not self.launching:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            if name not in _PURE and self.impure is None:
                self.impure = str(name)
            elif name in _ALLOCATE:
                self.allocated.append(result)
        return result


@dataclass(frozen=True)
class _View:
    """A tensor at ``offset`` bytes from source ``src``'s address: ``("in", i)`` the call's
    input ``i``, ``("new", j)`` its ``j``-th allocation."""

    src: tuple[str, int]
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    whole: bool = False  # the source itself (same metadata): passed as it is


@dataclass(frozen=True)
class _Const:
    """A tensor both recorded calls passed (same address): kept and passed again."""

    address: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    tensor: torch.Tensor = dataclasses.field(compare=False)


@dataclass(frozen=True)
class _Alloc:
    """Memory the call allocated (``torch.empty``): allocated again by the replay."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class _Obj:
    """A dataclass argument holding tensors (a TMA descriptor): its fields as templates."""

    kind: type
    fields: tuple[tuple[str, Any], ...]
    proto: Any = dataclasses.field(compare=False)


@dataclass(frozen=True)
class _List:
    """A list argument: its items as templates (a new list each call)."""

    items: tuple[Any, ...]


class _NotReplayableError(Exception):
    pass


class _Sources:
    """The storages of a call's inputs and of what it allocated, to place a tensor."""

    def __init__(self, inputs: Sequence[torch.Tensor], allocated: Sequence[torch.Tensor]) -> None:
        self.inputs = inputs
        self.allocated = allocated
        self.input_storages = [t.untyped_storage().data_ptr() for t in inputs]
        self.allocated_storages = [t.untyped_storage().data_ptr() for t in allocated]

    def template(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, tuple):
            return tuple(self.template(v) for v in value)
        if isinstance(value, list):
            return _List(tuple(self.template(v) for v in value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = tuple(
                (f.name, self.template(getattr(value, f.name))) for f in dataclasses.fields(value)
            )
            if not any(_dynamic(t) for _, t in fields):
                return value  # no tensor inside: compared as it is
            if not hasattr(value, "__dict__"):
                raise _NotReplayableError("an object holding tensors without a __dict__")
            return _Obj(type(value), fields, value)
        return value

    def _tensor(self, t: torch.Tensor) -> _View | _Const:
        storage = t.untyped_storage().data_ptr()
        meta = (t.dtype, tuple(t.shape), tuple(t.stride()))
        for kind, storages, tensors in (
            ("in", self.input_storages, self.inputs),
            ("new", self.allocated_storages, self.allocated),
        ):
            same = [i for i, s in enumerate(storages) if s == storage]
            exact = [i for i in same if tensors[i].data_ptr() == t.data_ptr()]
            if exact:  # the input itself, or a view of it from its first element
                x = tensors[exact[0]]
                whole = meta == (x.dtype, tuple(x.shape), tuple(x.stride()))
                return _View((kind, exact[0]), 0, *meta, whole=whole)
            if len(same) > 1:  # inside memory several inputs share: whose view is unknown
                raise _NotReplayableError("a view of memory that several inputs share")
            if same:
                offset = t.data_ptr() - tensors[same[0]].data_ptr()
                if offset % t.element_size():
                    raise _NotReplayableError("a view at an offset that is not whole elements")
                return _View((kind, same[0]), offset, *meta)
        return _Const(t.data_ptr(), *meta, tensor=t)


@dataclass(frozen=True)
class _Recording:
    launches: tuple[tuple[Any, Any, Any, Any], ...]  # kernel, grid, args, kwargs (templates)
    allocs: tuple[_Alloc, ...]  # what the call allocated, in order
    result: Any  # the returned value's template: a _View or a tuple of them


def _record(
    inputs: Sequence[torch.Tensor], call: Callable[[], R]
) -> tuple[R, _Recording | None, bool]:
    """Run ``call``, recording its launches. Returns the result, the recording (None when
    the call is not replayable) and whether recording was possible at all (False while
    another thread intercepts launches: nothing can be concluded then)."""
    log: list[tuple[Any, Any, Args, Kwargs]] = []

    watch = _Watch()

    def action(run: Run, kernel: Any, args: Args, kwargs: Kwargs, grid: Any) -> Any:
        log.append((kernel, grid, args, kwargs))
        watch.launching = True
        try:
            return run(kernel, *args, grid=grid, warmup=False, **kwargs)
        finally:
            watch.launching = False

    with intercept(action, busy="run") as intercepting:
        if not intercepting:
            return call(), None, False
        with watch:
            result = call()
    if watch.impure is not None or not log:
        return result, None, True
    try:
        allocated = watch.allocated
        if any(t.storage_offset() for t in allocated):
            raise _NotReplayableError("an allocation at an offset")
        src = _Sources(inputs, allocated)
        launches = tuple(
            (kernel, src.template(grid), src.template(args), src.template(tuple(kwargs.items())))
            for kernel, grid, args, kwargs in log
        )
        allocs = tuple(
            _Alloc(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in allocated
        )
        rec = _Recording(launches, allocs, _result_template(result, src))
    except _NotReplayableError:
        return result, None, True
    return result, rec, True


def _result_template(result: Any, src: _Sources) -> Any:
    """The returned tensor (or tuple of tensors) as views of inputs or allocations; None
    for a call that returns None."""
    if result is None:
        return None

    def one(t: object) -> _View:
        view = src.template(t) if isinstance(t, torch.Tensor) else None
        if not isinstance(view, _View):
            raise _NotReplayableError("a result that is not a view of an input or allocation")
        return view

    return tuple(one(t) for t in result) if isinstance(result, tuple) else one(result)


def _same(a: _Recording, b: _Recording) -> bool:
    """Whether two recordings are one function of the inputs: equal templates, the same
    kernels (by identity) and constant tensors at the same addresses."""
    if len(a.launches) != len(b.launches) or (a.allocs, a.result) != (b.allocs, b.result):
        return False
    return all(
        ka is kb and (ga, xa, wa) == (gb, xb, wb)
        for (ka, ga, xa, wa), (kb, gb, xb, wb) in zip(a.launches, b.launches, strict=True)
    )


class Pointer:
    """What a compiled launch needs of a tensor argument: its address and dtype.

    Triton's launch path reads only ``data_ptr()`` and ``dtype`` of a pointer argument
    (to specialize and to launch), so a replay on a GPU passes this instead of a tensor
    view: a few hundred nanoseconds instead of microseconds for ``as_strided``. It keeps
    no reference to the memory, like the address a launch records.
    """

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: torch.dtype) -> None:
        self.address = address
        self.dtype = dtype

    def data_ptr(self) -> int:
        return self.address


class _Gen:
    """Writes a plan's build as one Python function of (inputs, allocations): each
    distinct view once, objects rebuilt, constants bound by name (no per-element calls).

    With ``pointers``, a launch argument that is a view (not an input passed whole) is a
    ``Pointer``; the result is always made of tensors."""

    def __init__(self, pointers: bool) -> None:
        self.lines: list[str] = []
        self.names: dict[str, Any] = {
            "_new": object.__new__, "_set": object.__setattr__, "_ptr": Pointer,
        }  # fmt: skip
        self._views: dict[tuple[_View, bool], str] = {}
        self._bases: dict[tuple[str, int], str] = {}
        self.pointers = pointers

    def const(self, value: Any) -> str:
        name = f"c{len(self.names)}"
        self.names[name] = value
        return name

    def _view(self, t: _View, tensor: bool) -> str:
        pointer = self.pointers and not tensor and not t.whole
        if (t, pointer) in self._views:
            return self._views[t, pointer]
        kind, i = t.src
        src = f"news[{i}]" if kind == "new" else f"ins[{i}]"
        name = f"v{len(self._views)}"
        self._views[t, pointer] = name
        if t.whole:
            self.lines.append(f"{name} = {src}")
        elif pointer:
            if t.src not in self._bases:
                self._bases[t.src] = f"a{len(self._bases)}"
                self.lines.append(f"{self._bases[t.src]} = {src}.data_ptr()")
            d = self.const(t.dtype)
            self.lines.append(f"{name} = _ptr({self._bases[t.src]} + {t.offset}, {d})")
        else:
            d = self.const(t.dtype)
            shape, stride = self.const(t.shape), self.const(t.stride)
            offset = t.offset // t.dtype.itemsize
            self.lines.append(f"x = {src}")
            self.lines.append(f"x = x if x.dtype is {d} else x.view({d})")
            self.lines.append(
                f"{name} = x.as_strided({shape}, {stride}, x.storage_offset() + {offset})"
            )
        return name

    def expr(self, t: Any, tensor: bool = False) -> str:
        """An expression for the value ``t`` stands for (lines it needs are written);
        ``tensor``: views as tensors even with ``pointers``."""
        if isinstance(t, _View):
            return self._view(t, tensor)
        if isinstance(t, _Const):
            return self.const(t.tensor)
        if isinstance(t, _Obj):
            fields = [(n, self.expr(f)) for n, f in t.fields if _dynamic(f)]
            replaced = {n for n, _ in fields}  # the recorded call's tensors are not kept
            static = {k: v for k, v in vars(t.proto).items() if k not in replaced}
            name = f"o{len(self.lines)}"
            kind, state = self.const(t.kind), self.const(static)
            self.lines.append(f"{name} = _new({kind})")  # the checked object, tensors replaced
            self.lines.append(f"{name}.__dict__.update({state})")
            self.lines += [f"_set({name}, {field!r}, {e})" for field, e in fields]
            return name
        if isinstance(t, _List):
            return "[" + "".join(f"{self.expr(x, tensor)}, " for x in t.items) + "]"
        if isinstance(t, tuple) and _dynamic(t):
            return "(" + "".join(f"{self.expr(x, tensor)}, " for x in t) + ")"
        return self.const(t)

    def function(self, body: str) -> Callable[..., Any]:
        source = "def build(ins, news):\n" + "".join(f"    {ln}\n" for ln in self.lines)
        source += f"    return {body}\n"
        space = dict(self.names)
        exec(compile(source, "<mla_triton replay plan>", "exec"), space)
        return space["build"]  # type: ignore[no-any-return]


def _dynamic(template: Any) -> bool:
    """Whether ``template`` holds a tensor or an object rebuilt per call."""
    if isinstance(template, (_View, _Const, _Obj, _List)):
        return True
    return isinstance(template, tuple) and any(_dynamic(t) for t in template)


def _bound(kernel: Any, args: Args, kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A launch's arguments as Triton binds them: every parameter of ``kernel`` in order
    (constexprs included, defaults applied), what a compiled kernel's launcher takes;
    None where ``kernel`` is not a ``JITFunction`` or the arguments do not bind."""
    params = getattr(kernel, "params", None) if isinstance(kernel, JITFunction) else None
    if params is None or len(args) > len(params):
        return None
    bound = []
    for i, param in enumerate(params):
        if i < len(args):
            bound.append(args[i])
        elif param.name in kwargs:
            bound.append(kwargs[param.name])
        elif param.has_default:
            bound.append(param.default)
        else:
            return None
    return tuple(bound)


def _grid3(grid: Any) -> tuple[int, int, int] | None:
    """``grid`` as the three dimensions a launcher takes (None: not a constant grid)."""
    if not isinstance(grid, tuple) or not 1 <= len(grid) <= 3:
        return None
    if not all(type(g) is int for g in grid):
        return None
    return (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)


class _Plan:
    """A key's launches, built by one generated function on a new call's tensors
    (``pointers``: views passed to launches as ``Pointer``, for compiled kernels; the
    interpreter reads the tensors).

    Launching: the first replays go through each kernel's ``run`` (Triton binds the
    arguments, looks up the compiled kernel and launches it), which returns the compiled
    kernels; ``adopt`` keeps them, and later replays on the same device launch them
    directly (``direct``) with the arguments bound by the plan itself, in the order
    ``_bound`` gives: what ``run`` would have launched, without binding the arguments
    and computing the cache key again at every call. Direct launches need the Triton
    release the kernels are tested with and no launch hook of Triton's that binding
    would run."""

    def __init__(self, rec: _Recording, pointers: bool) -> None:
        gen = _Gen(pointers)
        launches = []
        for kernel, grid, args, kwargs in rec.launches:
            static = {k: v for k, v in kwargs if not _dynamic(v)}
            dynamic = "".join(f"{k!r}: {gen.expr(v)}, " for k, v in kwargs if _dynamic(v))
            kw = f"{{**{gen.const(static)}, {dynamic}}}"
            launches.append(f"({gen.const(kernel)}, {gen.expr(grid)}, {gen.expr(args)}, {kw})")
        result = gen.expr(rec.result, tensor=True)
        self.build_fn = gen.function(f"[{', '.join(launches)}], {result}")
        self.allocs = rec.allocs
        self.direct_fn: Callable[..., Any] | None = None
        self.compiled: tuple[Any, ...] = ()
        self.device: object = None
        direct = []
        for kernel, grid, args, kwargs in rec.launches:
            bound, grid3 = _bound(kernel, args, dict(kwargs)), _grid3(grid)
            if not pointers or bound is None or grid3 is None or kernel.pre_run_hooks:
                return
            direct.append(f"({gen.const(grid3)}, {gen.expr(bound)})")
        self.direct_fn = gen.function(f"[{', '.join(direct)}], {result}")

    def _news(self) -> list[torch.Tensor]:
        return [
            torch.empty_strided(a.shape, a.stride, dtype=a.dtype, device=a.device)
            for a in self.allocs
        ]

    def build(self, inputs: Sequence[torch.Tensor]) -> tuple[list[Any], Any]:
        """Every launch's arguments on ``inputs`` and the result (no launch yet)."""
        return self.build_fn(inputs, self._news())  # type: ignore[no-any-return]

    def adopt(self, compiled: Sequence[Any]) -> None:
        """Keep the compiled kernels ``run`` returned (for this device) for direct launches;
        tried once: a plan that cannot launch directly keeps going through ``run``."""
        direct_fn, self.direct_fn = self.direct_fn, None
        if direct_fn is None or triton_release() != GLUON_TRITON:
            return
        if not all(hasattr(c, "function") and hasattr(c, "__getitem__") for c in compiled):
            return
        if knobs.runtime.add_stages_inspection_hook is not None:
            return
        self.direct_fn = direct_fn
        self.compiled = tuple(compiled)
        self.device = driver.active.get_current_device()

    def direct(self) -> bool:
        """Whether this call may launch the adopted compiled kernels directly (not while
        launches are intercepted, nor on another device)."""
        if not self.compiled or LOCK.locked():
            return False
        return bool(driver.active.get_current_device() == self.device)

    def build_direct(self, inputs: Sequence[torch.Tensor]) -> tuple[list[Any], Any]:
        """``(grid, bound arguments)`` of each adopted kernel on ``inputs``, and the result."""
        return self.direct_fn(inputs, self._news())  # type: ignore[misc,no-any-return]


def _compiled(rec: _Recording) -> bool:
    """Whether every launch of ``rec`` goes to a compiled kernel (not the interpreter,
    which reads its tensor arguments' memory through the tensors)."""
    return not any(isinstance(kernel, InterpretedFunction) for kernel, *_ in rec.launches)


def _launch(calls: list[Any]) -> list[Any]:
    """Launch through each kernel's ``run`` (looked up now: a warm-up may patch it);
    what each returned (the compiled kernel, where Triton compiled one)."""
    return [
        kernel.run(*args, grid=grid, warmup=False, **kwargs) for kernel, grid, args, kwargs in calls
    ]


_NEVER = object()
"""A key whose calls are not replayable: run in full."""
_SEEN = object()
"""A key called once: its next call is recorded."""


class Replay:
    """Plans by key: ``replay(key, inputs, call)`` runs ``call()`` or replays its launches.

    ``key`` must determine everything ``call`` decides on apart from the inputs' addresses
    and values (``key_of``: each tensor's metadata, every other argument, the forced
    implementation); ``inputs`` are the tensors the call may take views of; ``keep``
    holds the objects whose ``id`` is part of the key (alive while their plan is). At
    most ``_MAX_PLANS`` keys are kept (least recently used first out).
    """

    def __init__(self) -> None:
        self._plans: OrderedDict[Hashable, tuple[Any, object]] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()

    def planned(self, key: Hashable) -> bool:
        """Whether ``key``'s calls are replayed."""
        entry = self._plans.get(key)
        return entry is not None and isinstance(entry[0], _Plan)

    def __call__(
        self, key: Hashable, inputs: Sequence[torch.Tensor], call: Callable[[], R],
        keep: object = None,
    ) -> R:  # fmt: skip
        try:
            held = self._plans.get(key)
        except TypeError:  # an unhashable argument: nothing to key by
            return call()
        entry = held[0] if held is not None else None
        if isinstance(entry, _Plan):
            direct = entry.direct()
            try:
                calls, result = entry.build_direct(inputs) if direct else entry.build(inputs)
            except RuntimeError:  # a view the new addresses cannot take: the full call
                return call()
            if direct:
                stream = driver.active.get_current_stream(entry.device)
                for compiled, (grid, bound) in zip(entry.compiled, calls, strict=True):
                    compiled[grid](*bound, stream=stream)
                return result  # type: ignore[no-any-return]
            compiled = _launch(calls)
            if entry.direct_fn is not None and not entry.compiled:
                entry.adopt(compiled)
            return result  # type: ignore[no-any-return]
        if entry is _NEVER:
            return call()
        if entry is None:  # a key seen once costs nothing more: record from its second call
            with self._lock:
                self._plans[key] = (_SEEN, keep)
                self._evict()
            return call()
        got: tuple[R, _Recording | None, bool] = _record(inputs, call)
        result, rec, recorded = got
        if not recorded:
            return result
        with self._lock:
            if rec is None:  # a first call fills the memos of the launch paths: try again
                tries = entry + 1 if isinstance(entry, int) else 1
                new: Any = tries if tries < _TRIES else _NEVER
            elif not isinstance(entry, _Recording):
                new = rec  # the first clean recording: a plan once a second one agrees
            else:
                new = _Plan(rec, _compiled(rec)) if _same(entry, rec) else _NEVER
            self._plans[key] = (new, keep)
            self._plans.move_to_end(key)
            self._evict()
        return result

    def _evict(self) -> None:
        while len(self._plans) > _MAX_PLANS:
            self._plans.popitem(last=False)


REPLAY = Replay()
"""The plans of ``decode``, ``decode_shadow`` and ``update_cache`` (keys start with the
op's name)."""


def replayable(check_values: object, seq_lens: object) -> bool:
    """Whether a decode call may replay: it checks no values on the host (``check_values``
    False, or None with ``seq_lens`` on a GPU): value checks need the full call."""
    if check_values is False:
        return True
    return (
        check_values is None
        and isinstance(seq_lens, torch.Tensor)
        and seq_lens.device.type != "cpu"
    )


def capacity(block_table: object, kv_cache: object) -> int:
    """The block table's capacity in tokens (0 for arguments the checks refuse)."""
    if not (isinstance(block_table, torch.Tensor) and isinstance(kv_cache, torch.Tensor)):
        return 0
    if block_table.dim() != 2 or kv_cache.dim() != 3:
        return 0
    return int(block_table.shape[1] * kv_cache.shape[1])


def key_of(head: tuple[object, ...], *values: object) -> tuple[list[torch.Tensor], Hashable]:
    """The tensors among ``values`` (a pair's members too) and the key of a call: ``head``
    (the op and its other arguments, each with its type) and each tensor's shape, strides,
    dtype, device and address modulo 16 (the alignment the launch paths check).
    The key may hold an unhashable argument: ``Replay`` then runs the call in full."""
    inputs: list[torch.Tensor] = []
    parts: list[Hashable] = [tuple([(type(h), h) for h in head])]
    for v in values:
        if isinstance(v, torch.Tensor):
            inputs.append(v)
            parts.append((v.shape, v.stride(), v.dtype, v.device, v.data_ptr() & 15))
        elif isinstance(v, (tuple, list)) and all(isinstance(x, torch.Tensor) for x in v):
            inputs.extend(v)
            parts.append(tuple([(x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15)
                                for x in v]))  # fmt: skip
        else:
            parts.append((type(v), v if isinstance(v, Hashable) else id(v)))
    return inputs, tuple(parts)
