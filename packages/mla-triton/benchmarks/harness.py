"""Shared pieces of the benchmark harnesses: shapes, recipes, timing, environment facts, CSV.

Every harness (``decode.py``, ``shadow.py``, ``prefill.py`` here, mla-vllm's ``serve.py``)
appends rows of ``COLUMNS`` to one CSV per op under ``results/``. Timing: the median of
``triton.testing.do_bench`` after its warm-up, either of the eager call or of the replay
of a CUDA graph holding one call; ``--rounds`` passes over every case of a shape, round
robin, each row keeping its best pass (a drift of the card's clocks hits every case alike).

Importing this module with ``--smoke`` on the command line sets ``TRITON_INTERPRET=1``
(before mla_triton's kernels are defined): import it before mla_triton.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import importlib.metadata
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

if "--smoke" in sys.argv[1:]:  # the CPU smoke run: Triton's interpreter, set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")

COLUMNS = (
    "date", "commit", "gpu", "torch", "triton", "vllm", "op", "shape", "recipe", "impl",
    "mode", "time_us", "tflops", "gbps", "tok_s", "ratio", "notes",
)  # fmt: skip
"""The CSV columns. ``mode``: ``graph`` (CUDA-graph replays), ``eager`` (one call after
another from Python) or ``host`` (the CPU time of an eager call with the GPU kept busy,
``host_us``: the host's own time per call);
``time_us``: microseconds a call; ``tflops``/``gbps``: FLOPs (FlashMLA's count) and bytes
moved per call over the time; ``tok_s``: tokens a second (decode: requests of the batch;
prefill: tokens of the batch; serving: the engine's decode tokens/s); ``ratio``: the
anchor's time over this row's, both timed in the same process and mode (empty without
an anchor); ``notes``: checks and whatever did not run."""

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE_RE = re.compile(r"b(\d+)-h(\d+)-L(\d+)(?:-p(\d+))?")
RECIPE_RE = re.compile(r"(none|fp8|nvfp4)(?:\+(\d+):(\d+))?")
MODES = ("graph", "eager")
HOST_CALLS = 32
"""Back-to-back calls a host measurement times (``host_us``): few enough that their
launches fit the launch queue, so that no call waits for a free slot."""


# ------------------------------------------------------------------ shapes and recipes


@dataclass(frozen=True)
class Shape:
    """``b{batch}-h{heads}-L{seq}[-p{page}]``: requests (or sequences), heads, tokens each
    (decode: the context; prefill: queries = keys, causal), page size (decode only)."""

    batch: int
    heads: int
    seq: int
    page: int = 64

    @property
    def name(self) -> str:
        return f"b{self.batch}-h{self.heads}-L{self.seq}" + (
            f"-p{self.page}" if self.page != 64 else ""
        )


def parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        m = SHAPE_RE.fullmatch(item)
        if m is None:
            raise SystemExit(f"--shapes: expected b<batch>-h<heads>-L<len>[-p<page>], got {item!r}")
        b, h, n, p = (int(g) if g else 64 for g in m.groups())
        if min(b, h, n, p) < 1:
            raise SystemExit(f"--shapes: {item!r}: every number must be positive")
        shapes.append(Shape(b, h, n, p))
    return shapes


def parse_recipe(name: str) -> tuple[Any, Any]:
    """``none``, ``fp8``, ``nvfp4``, each optionally ``+N:M``: ``(AttentionQuant.uniform(fmt)
    or None, NMSparsity(N, M) or None)``."""
    from mla_formats import AttentionQuant, NMSparsity

    m = RECIPE_RE.fullmatch(name)
    if m is None:
        raise SystemExit(f"--recipes: expected none|fp8|nvfp4 with an optional +N:M, got {name!r}")
    quant = None if m.group(1) == "none" else AttentionQuant.uniform(m.group(1))
    sparsity = NMSparsity(int(m.group(2)), int(m.group(3))) if m.group(2) else None
    return quant, sparsity


def split_list(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma-separated choice of ``allowed`` (``all``: every one), in the order given."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if items == ["all"]:
        return list(allowed)
    unknown = [s for s in items if s not in allowed]
    if unknown or not items:
        raise SystemExit(f"--{what}: unknown {unknown or text!r}; expected some of {list(allowed)}")
    return list(dict.fromkeys(items))


# ------------------------------------------------------------------ baseline tree

BASELINE = "baseline"
"""The ``impl`` of rows timed with another source tree's ``mla_triton`` (``--baseline``)."""


def load_baseline(folder: Path) -> ModuleType:
    """``mla_triton`` of another source tree, imported beside this one as
    ``mla_triton_baseline``, so that both are timed in one process (same clocks, same
    inputs). ``folder`` holds that tree's package folder ``mla_triton``, e.g. from
    ``git archive REV packages/mla-triton/src | tar -x -C DIR`` then
    ``DIR/packages/mla-triton/src``. It must take the same arguments as this tree's."""
    src = folder / "mla_triton"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"--baseline: no mla_triton package (mla_triton/__init__.py) in {folder}")
    dest = Path(tempfile.mkdtemp(prefix="mla-baseline-"))
    name = re.compile(r"\bmla_triton\b")
    for path in src.rglob("*"):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        out = dest / "mla_triton_baseline" / path.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text() if path.suffix == ".py" else None
        if text is None:
            out.write_bytes(path.read_bytes())
        else:
            out.write_text(name.sub("mla_triton_baseline", text))
    sys.path.insert(0, str(dest))
    return importlib.import_module("mla_triton_baseline")


def add_baseline(parser: argparse.ArgumentParser) -> None:
    """``--baseline DIR`` and ``--baseline-label``."""
    parser.add_argument(
        "--baseline", type=Path, default=None,
        help="a folder holding another tree's mla_triton package: timed in this process "
        f"as impl {BASELINE!r} (its auto dispatch), e.g. to measure a change's cost",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-label", default=None,
        help="what the baseline is (its commit), written into its rows' notes",
    )  # fmt: skip


# ------------------------------------------------------------------ environment


def commit() -> str:
    """``MLA_COMMIT`` when set, else ``git rev-parse --short HEAD`` here, else ``unknown``."""
    if os.environ.get("MLA_COMMIT"):
        return os.environ["MLA_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
            capture_output=True, text=True, check=True, timeout=10,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def version(module: str) -> str:
    """An installed distribution's version ("" when it is not installed)."""
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        mod = sys.modules.get(module)
        return str(getattr(mod, "__version__", "")) if mod is not None else ""


def environment(device: Any) -> dict[str, str]:
    """The facts every row carries: date (UTC, the run's start), commit, GPU, versions."""
    import torch
    import triton

    gpu = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else "cpu (TRITON_INTERPRET=1)"
        if os.environ.get("TRITON_INTERPRET") == "1"
        else "cpu"
    )
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm": version("vllm"),
    }


# ------------------------------------------------------------------ timing


def bench_us(fn: Callable[[], Any], device: Any, warmup_ms: int, rep_ms: int) -> float:
    """Microseconds a call: ``do_bench``'s median on CUDA; on the CPU (the smoke run, whose
    interpreter is slow) one call's wall time."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    import triton.testing

    ms = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return float(ms) * 1e3


def host_us(fn: Callable[[], Any], calls: int = HOST_CALLS, repeats: int = 5) -> float:
    """Microseconds of CPU wall time an eager call costs the host, however long its kernels run.

    A ``torch.cuda._sleep`` queued first holds the stream; ``calls`` calls are then timed
    back to back with ``time.perf_counter`` (each returns once its work is queued) and the
    stream is synchronized. An event recorded after the sleep says whether the sleep
    outlasted the timed calls; if not (the queue could have drained, a call could have
    waited for the GPU) the pass is dropped and the sleep made 4x longer. The best of
    ``repeats`` passes. Unlike eager minus graph, which shows only what the host adds
    beyond the GPU's time, this is the host's whole time a call.
    """
    import torch

    cycles = 1 << 22  # about 2.5 ms at 1.7 GHz, grown as needed
    best, done = float("inf"), 0
    while done < repeats:
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        slept = torch.cuda.Event()
        slept.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        drained = slept.query()
        torch.cuda.synchronize()
        if drained:
            if cycles >= 1 << 36:
                raise RuntimeError("host_us: the GPU sleep never outlasted the timed calls")
            cycles *= 4
            continue
        best = min(best, elapsed / calls * 1e6)
        done += 1
    return best


def capture_graph(fn: Callable[[], Any]) -> Any:
    """A CUDA graph of one call of ``fn`` (warmed on a side stream first, as capture wants),
    replayed once."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


@dataclass
class Case:
    """One timed call of a shape: ``run`` makes it (``view`` of its result: the output to
    check); ``context`` is entered around every call (``tuning.use``); ``flops``,
    ``nbytes`` and ``tokens`` count one call."""

    recipe: str
    impl: str
    run: Callable[[], Any]
    view: Callable[[Any], Any] = lambda result: result
    """``run``'s result to the output tensor the check compares."""
    flops: float = 0.0
    nbytes: float = 0.0
    tokens: int = 0
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    notes: list[str] = field(default_factory=list)
    times: dict[str, list[float]] = field(default_factory=dict)
    graph: Any = None

    def best(self, mode: str) -> float | None:
        got = self.times.get(mode)
        return min(got) if got else None


def prepare(cases: list[Case], skipped: list[str]) -> list[Case]:
    """Run each case once (compiles, and a forced implementation that cannot take the call
    raises ``ValueError`` before any launch): the cases that ran; the others' reasons are
    appended to ``skipped``."""
    kept = []
    for case in cases:
        try:
            with case.context():
                case.run()
        except Exception as exc:  # a forced impl refused, an anchor missing: noted, run on
            why = f"{case.impl} {case.recipe} not run: {type(exc).__name__}: {exc}"
            skipped.append(why.splitlines()[0][:300])
            print(f"  skipped: {skipped[-1]}", flush=True)
            continue
        kept.append(case)
    return kept


def measure(
    cases: list[Case], modes: Sequence[str], rounds: int, device: Any, warmup_ms: int, rep_ms: int
) -> None:
    """Time every case in every mode, ``rounds`` passes round robin (each pass starting one
    case later); graphs are captured once, before the first pass. On CUDA, with ``eager``,
    each pass also takes the host's time a call (``host_us``, mode ``host``)."""
    if "graph" in modes:
        for case in cases:
            if device.type != "cuda":
                case.notes.append("no graph on the CPU")
                continue
            try:
                with case.context():
                    case.graph = capture_graph(case.run)
            except Exception as exc:  # noted in the row; the eager time stands
                case.notes.append(f"graph capture failed: {type(exc).__name__}: {exc}"[:200])
    for r in range(rounds):
        shift = r % max(1, len(cases))
        for case in cases[shift:] + cases[:shift]:
            with case.context():
                for mode in modes:
                    if mode == "graph" and case.graph is None:
                        continue
                    fn = case.graph.replay if mode == "graph" else case.run
                    case.times.setdefault(mode, []).append(bench_us(fn, device, warmup_ms, rep_ms))
                if "eager" in modes and device.type == "cuda":
                    case.times.setdefault("host", []).append(host_us(case.run))


def precompile(job: Callable[[Any], str], specs: Sequence[Any], workers: int) -> None:
    """Run ``job(spec)`` for every spec in ``workers`` spawned processes (each compiles its
    kernels into Triton's on-disk cache, which the timed process then loads)."""
    if workers < 1 or not specs:
        return
    t0 = time.time()
    with mp.get_context("spawn").Pool(min(workers, len(specs))) as pool:
        for line in pool.imap_unordered(job, specs):
            print(f"  compiled {line}", flush=True)
    print(f"precompiled {len(specs)} jobs in {time.time() - t0:.0f} s", flush=True)


# ------------------------------------------------------------------ rows


def fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def case_rows(
    env: dict[str, str],
    op: str,
    shape: str,
    cases: Iterable[Case],
    modes: Sequence[str],
    anchor: str | None,
    anchor_note: str = "",
    rounds: int = 1,
) -> list[dict[str, str]]:
    """Rows of one shape: per case and mode its best time, rates and ratio to the case
    whose impl is ``anchor`` (same mode); then per case timed on CUDA eagerly a ``host``
    row (``host_us``; its notes give eager minus graph too where both ran). ``anchor_note``
    goes into every row when the anchor did not run."""
    cases = list(cases)
    base = next((c for c in cases if c.impl == anchor), None)
    rows = []
    for case in cases:
        for mode in (*modes, "host"):
            us = case.best(mode)
            if us is None:
                continue
            notes = list(case.notes)
            ratio = None
            if mode != "host":
                ref = base.best(mode) if base is not None else None
                if ref is not None and us > 0:
                    ratio = ref / us
                elif anchor_note and case is not base:
                    notes.append(anchor_note)
                if rounds > 1:
                    notes.append(f"best of {rounds} rounds")
            else:
                notes = [f"CPU time a call, the GPU kept busy ({HOST_CALLS} calls back to back)"]
                eager, graph = case.best("eager"), case.best("graph")
                if eager is not None and graph is not None:
                    notes.append(f"eager minus graph {eager - graph:.2f}")
            per_s = 1e6 / us if us and us > 0 and mode != "host" else None
            rows.append(
                env
                | {
                    "op": op,
                    "shape": shape,
                    "recipe": case.recipe,
                    "impl": case.impl,
                    "mode": mode,
                    "time_us": fmt(us),
                    "tflops": fmt(case.flops * per_s / 1e12) if per_s and case.flops else "",
                    "gbps": fmt(case.nbytes * per_s / 1e9, 1) if per_s and case.nbytes else "",
                    "tok_s": fmt(case.tokens * per_s, 0) if per_s and case.tokens else "",
                    "ratio": fmt(ratio, 3),
                    "notes": "; ".join(notes),
                }
            )
    return rows


def print_rows(rows: Sequence[dict[str, str]]) -> None:
    for r in rows:
        rates = "".join(
            f" {r[key]:>9s} {unit}" for key, unit in
            (("tflops", "TFLOP/s"), ("gbps", "GB/s"), ("tok_s", "tok/s")) if r[key]
        )  # fmt: skip
        ratio = f" {r['ratio']}x" if r["ratio"] else ""
        print(f"{r['op']:13s} {r['shape']:18s} {r['recipe']:13s} {r['impl']:10s} {r['mode']:5s} "
              f"{r['time_us']:>10s} us{rates}{ratio}  {r['notes']}", flush=True)  # fmt: skip


def write_rows(rows: Sequence[dict[str, str]], path: Path, dry_run: bool) -> None:
    """Print the rows, and unless ``dry_run`` append them to ``path`` (a header first when
    the file is new; an existing file with other columns is refused)."""
    print_rows(rows)
    if dry_run or not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="") as f:
            header = next(csv.reader(f), [])
        if tuple(header) != COLUMNS:
            raise SystemExit(f"{path}: its columns differ from this harness's; pass another --out")
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            writer.writeheader()
        writer.writerows(rows)
    print(f"appended {len(rows)} rows to {path}", flush=True)


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ command line


def add_common(
    parser: argparse.ArgumentParser,
    *,
    op: str,
    shapes: str,
    recipes: str,
    impls: str,
    modes: str,
    impl_help: str,
) -> None:
    """The options every kernel harness takes."""
    parser.add_argument("--shapes", default=shapes, help=f"comma-separated (default {shapes})")
    parser.add_argument("--recipes", default=recipes, help=f"comma-separated (default {recipes})")
    parser.add_argument("--impl", default=impls, help=impl_help + f" (default {impls}; all)")
    parser.add_argument(
        "--modes", default=modes, help=f"graph and/or eager, comma-separated (default {modes})"
    )
    parser.add_argument("--rounds", type=int, default=3, help="round-robin passes (default 3)")
    parser.add_argument("--warmup-ms", type=int, default=25, help="do_bench warm-up (ms)")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetitions (ms)")
    parser.add_argument(
        "--jobs", type=int, default=min(8, os.cpu_count() or 1),
        help="processes compiling the kernels before timing (0: compile while timing)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=None, help=f"the CSV to append to (default results/{op}.csv)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the rows, write nothing")
    parser.add_argument(
        "--smoke", action="store_true",
        help="CPU smoke test (TRITON_INTERPRET=1): a tiny shape in float16, outputs checked "
        "against mla_reference, no anchors; prints rows, writes only with an explicit --out",
    )  # fmt: skip


def destination(args: argparse.Namespace, op: str) -> tuple[Path, bool]:
    """The CSV path and whether to write nothing (``--dry-run``, or ``--smoke`` without
    ``--out``)."""
    path = args.out if args.out is not None else RESULTS / f"{op}.csv"
    return path, bool(args.dry_run or (args.smoke and args.out is None))


def checked_modes(text: str) -> list[str]:
    return split_list(text, MODES, "modes")


def row_error(got: Any, want: Any) -> float:
    """Relative L2 error ``||got - want|| / ||want||`` (float64), as mla-report's
    ``oracle_rel_l2``: a few elements of P flipping to the next NVFP4 or FP8 code (float32
    against float64 scores) move single outputs by percents but not the norm."""
    g, w = got.double(), want.double()
    return float((g - w).norm() / w.norm().clamp_min(1e-12))


@contextlib.contextmanager
def timer(label: str) -> Iterator[None]:
    t0 = time.time()
    yield
    print(f"{label}: {time.time() - t0:.1f} s", flush=True)


def check(cases: Iterable[Case], want: Any, rows: slice, tol: float) -> bool:
    """Compare each case's output ``[rows]`` with ``want`` (the oracle's); the error goes
    into the case's notes (``CHECK FAILED`` past ``tol``). True when every case passed."""
    ok = True
    for case in cases:
        with case.context():
            got = case.view(case.run())[rows]
        err = row_error(got, want)
        passed = err <= tol
        ok &= passed
        case.notes.append(f"err {err:.1e}" + ("" if passed else f" CHECK FAILED (> {tol:g})"))
    return ok


def build(factory: Callable[[], Case], label: str, skipped: list[str]) -> list[Case]:
    """``[factory()]``, or ``[]`` with the reason in ``skipped`` (an anchor's import failing)."""
    try:
        return [factory()]
    except Exception as exc:  # vLLM or a kernel missing: noted in the rows, the run goes on
        skipped.append(f"{label} not run: {type(exc).__name__}: {exc}".splitlines()[0][:300])
        print(f"  skipped: {skipped[-1]}", flush=True)
        return []


def anchor_note(anchor: str, impls: Sequence[str], skipped: Sequence[str]) -> str:
    """Why no row of a shape has a ratio (empty when the anchor ran)."""
    if anchor not in impls:
        return f"no anchor ({anchor} not in --impl)"
    why = next((s for s in skipped if s.startswith(anchor + " ")), "")
    return f"no anchor: {why}" if why else ""


# ------------------------------------------------------------------ decode: inputs, anchors

D_QK, D_V = 576, 512  # absorbed MLA: kv_lora_rank 512 + rope 64
SCALE = 192**-0.5  # DeepSeek-V3's softmax scale (qk_nope 128 + rope 64)


@dataclass
class DecodeInputs:
    """q ``[B, H, 576]``, a cache of exactly the pages the batch uses (a random permutation
    in the block table), every request at full length ``L``."""

    shape: Shape
    q: Any
    cache: Any
    table: Any
    lens: Any

    @property
    def flops(self) -> float:
        """FlashMLA's count: ``2 H L (576 + 512)`` per request."""
        s = self.shape
        return 2.0 * s.batch * s.heads * s.seq * (D_QK + D_V)

    def nbytes(self, token_bytes: float | None = None) -> float:
        """Bytes a call moves: ``token_bytes`` per cached token (default the raw row), q
        read, out written."""
        s, elem = self.shape, self.q.element_size()
        per = D_QK * elem if token_bytes is None else token_bytes
        return s.batch * s.seq * per + elem * s.batch * s.heads * (D_QK + D_V)


def decode_inputs(shape: Shape, device: Any, dtype: Any, seed: int = 0) -> DecodeInputs:
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    pages = -(-shape.seq // shape.page)
    blocks = shape.batch * pages
    perm = torch.randperm(blocks, generator=g, device=device)
    table = perm.to(torch.int32).reshape(shape.batch, pages)
    cache = torch.randn(blocks, shape.page, D_QK, generator=g, device=device, dtype=dtype)
    q = torch.randn(shape.batch, shape.heads, D_QK, generator=g, device=device, dtype=dtype)
    lens = torch.full((shape.batch,), shape.seq, dtype=torch.int32, device=device)
    return DecodeInputs(shape, q, cache, table, lens)


def flashmla_decode(x: DecodeInputs) -> Case:
    """FlashMLA bf16 (vLLM's ``flash_mla_with_kvcache``) on the same cache, table and q."""
    from vllm.v1.attention.ops import flashmla

    ok, why = flashmla.is_flashmla_dense_supported()
    if not ok:
        raise RuntimeError(f"FlashMLA unavailable: {why}")
    meta, _ = flashmla.get_mla_metadata()
    q4, k4 = x.q.unsqueeze(1), x.cache.unsqueeze(2)  # [B, 1, H, 576], [blocks, page, 1, 576]
    s = x.shape

    def run() -> Any:
        return flashmla.flash_mla_with_kvcache(
            q4, k4, x.table, x.lens, D_V, meta, None, softmax_scale=SCALE, causal=False
        )

    return Case("none", "flashmla", run, view=lambda r: r[0].reshape(s.batch, s.heads, D_V),
                flops=x.flops, nbytes=x.nbytes(), tokens=s.batch)  # fmt: skip


def triton_mla_decode(x: DecodeInputs, num_kv_splits: int = 4) -> Case:
    """vLLM's own Triton MLA decode (``decode_attention_fwd``, as its TRITON_MLA backend calls
    it: 4 KV splits, buffers allocated outside the call)."""
    import torch
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    s, q = x.shape, x.q
    out = torch.empty(s.batch, s.heads, D_V, dtype=q.dtype, device=q.device)
    lse = torch.empty(s.batch, s.heads, dtype=q.dtype, device=q.device)
    logits = torch.empty(s.batch, s.heads, num_kv_splits, D_V + 1, dtype=torch.float32,
                         device=q.device)  # fmt: skip
    k = x.cache.unsqueeze(2)  # [blocks, page, 1, 576]
    v = k[..., :D_V]

    def run() -> Any:
        return decode_attention_fwd(
            q, k, v, out, lse, x.table, x.lens, logits, num_kv_splits, SCALE, s.page
        )

    return Case("none", "triton_mla", run, view=lambda _: out, flops=x.flops,
                nbytes=x.nbytes(), tokens=s.batch)  # fmt: skip


DECODE_ANCHORS: dict[str, Callable[[DecodeInputs], Case]] = {
    "flashmla": flashmla_decode,
    "triton_mla": triton_mla_decode,
}


def reference_decode(x: DecodeInputs, quant: Any, n: int = 2) -> Any:
    """``mla_reference.decode``'s output for the first ``n`` requests (float64 inside)."""
    import mla_reference

    out, _ = mla_reference.decode(
        x.q[:n], x.cache, x.table[:n], x.lens[:n], softmax_scale=SCALE, quant=quant
    )
    return out
