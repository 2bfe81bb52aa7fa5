"""``python -m mla_vllm.compare.lm_eval_run ARGS``: ``lm_eval ARGS`` that always exits.

lm-eval 0.4.13 with ``--model vllm`` (vLLM 0.33) scored the task and wrote its
results, then its process did not exit (seen on an H200; docs/accuracy.md).
This wrapper runs lm-eval's own command line (``lm_eval.__main__.cli_evaluate``, the
same arguments) and then, in order:

1. reports to stderr what could keep the interpreter from exiting: every thread that
   is not a daemon, with its Python stack, and every live child process of this one
   (``/proc``: pid, state, command line);
2. shuts down every live ``vllm.LLM`` engine explicitly (``engine_core.shutdown``:
   SIGTERM, a bounded join, then SIGKILL of the engine process tree);
3. flushes stdout and stderr and leaves with ``os._exit`` and lm-eval's exit code,
   so no thread or exit hook that is left can block.

``MLA_LM_EVAL_EXIT_TIMEOUT`` (seconds, default 60) bounds steps 1 and 2: past it,
``faulthandler`` prints every thread's stack and the process exits with code 1.
lm-eval's results are written before any of this (its ``--output_path``).

``--repeats N`` (with ``--seed S``, default 0) runs the task N times in this process,
for sampled tasks: repeat ``r`` gets the sampling seed ``S + r`` (vLLM's per-request
``SamplingParams.seed``, through lm-eval's ``gen_kwargs``) and writes under
``OUTPUT_PATH/repeatRRR_seedS`` (``--output_path``, required, with ``--log_samples``),
one samples file per repeat where ``mla-compare tasks`` finds them. The model (the
vLLM engine) is created once, by the first repeat, and reused by the others. Without
``--repeats``, ``--seed`` is lm-eval's own and every argument goes to lm-eval as given.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "Repeats",
    "blocking_threads",
    "child_processes",
    "exit_report",
    "main",
    "parse_repeats",
    "repeat_folder",
    "shutdown_engines",
]

TIMEOUT_ENV = "MLA_LM_EVAL_EXIT_TIMEOUT"


def blocking_threads() -> list[dict[str, Any]]:
    """Live non-daemon threads other than the main one: name, ident, class, Python stack."""
    frames = sys._current_frames()
    out = []
    for t in threading.enumerate():
        if t.daemon or t is threading.main_thread() or not t.is_alive():
            continue
        frame = frames.get(t.ident) if t.ident is not None else None
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        out.append({"name": t.name, "ident": t.ident, "class": type(t).__name__, "stack": stack})
    return out


def _proc_stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state letter) of ``pid`` from ``/proc/PID/stat``; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), fields[0]


def child_processes(pid: int | None = None) -> list[dict[str, Any]]:
    """Every live descendant of ``pid`` (default: this process): pid, ppid, state, cmdline."""
    root = os.getpid() if pid is None else pid
    table: dict[int, tuple[int, str]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (st := _proc_stat(int(entry.name))) is not None:
            table[int(entry.name)] = st
    out = []
    todo = [root]
    while todo:
        parent = todo.pop()
        for child, (ppid, state) in sorted(table.items()):
            if ppid != parent:
                continue
            try:
                raw = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                raw = b""
            cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
            out.append({"pid": child, "ppid": ppid, "state": state, "cmdline": cmd})
            todo.append(child)
    return out


def exit_report(stream: TextIO) -> dict[str, Any]:
    """Write what could block the interpreter's exit to ``stream``; return it as a dict."""
    threads = blocking_threads()
    children = child_processes()
    print(
        f"[mla lm_eval_run] at exit: {len(threads)} non-daemon thread(s), "
        f"{len(children)} child process(es)",
        file=stream,
    )
    for t in threads:
        print(f"[mla lm_eval_run] thread {t['name']!r} ({t['class']}):\n{t['stack']}", file=stream)
    for c in children:
        print(
            f"[mla lm_eval_run] child pid {c['pid']} (parent {c['ppid']}, state {c['state']}): "
            f"{c['cmdline'][:300]}",
            file=stream,
        )
    return {"threads": threads, "children": children}


def _live_engines(objects: Iterable[object]) -> list[Any]:
    vllm = sys.modules.get("vllm")
    llm_class = getattr(vllm, "LLM", None) if vllm is not None else None
    if not isinstance(llm_class, type):
        return []
    # type(), not isinstance: some tracked objects warn when their __class__ is read
    return [o for o in objects if issubclass(type(o), llm_class)]


def shutdown_engines(objects: Iterable[object] | None = None, stream: TextIO | None = None) -> int:
    """Shut down every live ``vllm.LLM`` among ``objects`` (default: all the GC tracks).

    Calls ``llm.llm_engine.engine_core.shutdown()`` (vLLM 0.33: the engine processes get
    SIGTERM, ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` to stop, then SIGKILL). Returns the
    number of engines shut down. Does not import vLLM: without it loaded there is none.
    """
    engines = _live_engines(gc.get_objects() if objects is None else objects)
    for llm in engines:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
    if stream is not None:
        print(f"[mla lm_eval_run] shut down {len(engines)} vLLM engine(s)", file=stream)
    return len(engines)


class Repeats:
    """``--repeats``: how many runs, their first seed, the output folder, lm-eval's
    other arguments."""

    def __init__(self, count: int, seed: int, output: Path, rest: list[str]) -> None:
        self.count, self.seed, self.output, self.rest = count, seed, output, rest

    def seeds(self) -> list[int]:
        """The sampling seed of each repeat."""
        return [self.seed + r for r in range(self.count)]

    def argv(self, r: int) -> list[str]:
        """lm-eval's arguments for repeat ``r``: its own ``--output_path``."""
        folder = self.output / repeat_folder(r, self.seed + r)
        return [*self.rest, "--output_path", str(folder)]


def repeat_folder(r: int, seed: int) -> str:
    """Repeat ``r``'s folder under ``--output_path`` (name order is repeat order)."""
    return f"repeat{r:03d}_seed{seed}"


def parse_repeats(argv: Sequence[str]) -> Repeats | None:
    """``--repeats``, ``--seed`` and ``--output_path`` of ``argv``, checked before anything
    runs (a ``ValueError`` naming the argument); None without ``--repeats``."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--repeats", default=None)
    p.add_argument("--seed", default="0")
    p.add_argument("--output_path", "-o", default=None)
    known, rest = p.parse_known_args(list(argv))
    if known.repeats is None:
        return None
    try:
        count = int(known.repeats)
    except ValueError:
        raise ValueError(f"--repeats: expected an integer, got {known.repeats!r}") from None
    if count < 1:
        raise ValueError(f"--repeats: expected >= 1, got {count}")
    try:
        seed = int(known.seed)
    except ValueError:
        raise ValueError(
            f"--seed: expected one integer with --repeats (the first sampling seed), "
            f"got {known.seed!r}"
        ) from None
    if seed < 0:
        raise ValueError(f"--seed: expected >= 0, got {seed}")
    if "--log_samples" not in rest and "-s" not in rest:
        raise ValueError("--repeats: needs --log_samples (mla-compare tasks reads the samples)")
    if known.output_path is None:
        raise ValueError("--output_path: required with --repeats (one folder per repeat)")
    output = Path(known.output_path).expanduser()
    if output.suffix == ".json" or (output.exists() and not output.is_dir()):
        raise ValueError(f"--output_path: {known.output_path!r} is not a folder")
    out = Repeats(count, seed, output, rest)
    for r, s in enumerate(out.seeds()):
        folder = output / repeat_folder(r, s)
        if folder.is_dir() and any(folder.rglob("samples_*.jsonl")):
            raise ValueError(
                f"--output_path: {str(folder)!r} already holds samples; give an empty folder"
            )
    return out


def _seeded_evaluate(
    real: Callable[..., Any], make_model: Callable[..., Any], seed: list[int]
) -> Callable[..., Any]:
    """``simple_evaluate`` that creates the model once and samples with ``seed[0]``."""
    models: dict[str, Any] = {}

    def evaluate(*args: Any, **kwargs: Any) -> Any:
        gen = kwargs.get("gen_kwargs") or {}
        if isinstance(gen, str):
            from lm_eval.utils import simple_parse_args_string  # type: ignore[import-untyped]

            gen = simple_parse_args_string(gen)
        if "seed" in gen:
            raise ValueError("--gen_kwargs: seed is set by --seed with --repeats")
        kwargs["gen_kwargs"] = {**gen, "seed": seed[0]}
        model = kwargs.get("model", args[0] if args else None)
        if isinstance(model, str):
            if "lm" not in models:
                models["lm"] = make_model(
                    model,
                    kwargs.get("model_args"),
                    {
                        "batch_size": kwargs.get("batch_size"),
                        "max_batch_size": kwargs.get("max_batch_size"),
                        "device": kwargs.get("device"),
                    },
                )
            args = ()
            kwargs["model"] = models["lm"]
        return real(*args, **kwargs)

    return evaluate


def _make_model(model: str, model_args: Any, extra: dict[str, Any]) -> Any:
    """The model as lm-eval's ``simple_evaluate`` creates it from a name."""
    from lm_eval.api.registry import get_model  # type: ignore[import-untyped]

    cls = get_model(model)
    if isinstance(model_args, dict):
        return cls.create_from_arg_obj(model_args, extra)
    return cls.create_from_arg_string(model_args or "", extra)


def _run_repeats(
    repeats: Repeats,
    cli: Callable[[], None],
    real: Callable[..., Any] | None,
    make_model: Callable[..., Any] | None,
) -> None:
    """Run ``cli`` once per repeat with ``lm_eval.simple_evaluate`` seeded; stop at the
    first failure (its ``SystemExit`` or exception goes on)."""
    import lm_eval  # type: ignore[import-untyped]

    if real is None:  # lm-eval's (importing it loads every metric)
        from lm_eval.evaluator import (  # type: ignore[import-untyped]
            simple_evaluate as lm_eval_simple_evaluate,
        )

        real = lm_eval_simple_evaluate

    # lm_eval resolves simple_evaluate lazily (module __getattr__): set, then remove
    had = "simple_evaluate" in vars(lm_eval)
    original = vars(lm_eval).get("simple_evaluate")
    seed = [repeats.seed]
    lm_eval.simple_evaluate = _seeded_evaluate(real, make_model or _make_model, seed)
    prog = sys.argv[0]
    try:
        for r, s in enumerate(repeats.seeds()):
            seed[0] = s
            sys.argv = [prog, *repeats.argv(r)]
            print(f"[mla lm_eval_run] repeat {r + 1}/{repeats.count}, seed {s}", file=sys.stderr)
            cli()
    finally:
        if had:
            lm_eval.simple_evaluate = original
        else:
            del lm_eval.simple_evaluate


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def main(
    argv: Sequence[str] | None = None,
    *,
    cli: Callable[[], None] | None = None,
    exit_: Callable[[int], Any] = os._exit,
    evaluate: Callable[..., Any] | None = None,
    make_model: Callable[..., Any] | None = None,
) -> int:
    """Run lm-eval's CLI with ``argv`` (default ``sys.argv[1:]``), then exit as described.

    ``cli`` replaces ``lm_eval.__main__.cli_evaluate`` and ``exit_`` replaces
    ``os._exit``; with ``--repeats``, ``evaluate`` replaces lm-eval's ``simple_evaluate``
    and ``make_model(name, model_args, extra)`` its model creation (tests). Returns what
    ``exit_`` returns when it returns.
    """
    raw = os.environ.get(TIMEOUT_ENV, "60")
    try:
        timeout = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}: expected seconds, got {raw!r}") from None
    if timeout <= 0:
        raise ValueError(f"{TIMEOUT_ENV}: expected > 0, got {raw!r}")
    args = list(sys.argv[1:] if argv is None else argv)
    repeats = parse_repeats(args)
    if cli is None:
        from lm_eval.__main__ import cli_evaluate  # type: ignore[import-untyped]

        cli = cli_evaluate
    sys.argv = [sys.argv[0] if sys.argv else "lm_eval", *args]
    try:
        if repeats is None:
            cli()
        else:
            _run_repeats(repeats, cli, evaluate, make_model)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # report, then still leave cleanly
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    faulthandler.dump_traceback_later(timeout, exit=True, file=sys.__stderr__ or sys.stderr)
    try:
        exit_report(sys.stderr)
        shutdown_engines(stream=sys.stderr)
    except Exception:  # the results are written: a failed cleanup must not hang the exit
        traceback.print_exc()
    finally:
        faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    return int(exit_(code) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
