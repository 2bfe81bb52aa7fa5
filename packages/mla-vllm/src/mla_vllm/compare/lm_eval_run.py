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
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["blocking_threads", "child_processes", "exit_report", "main", "shutdown_engines"]

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


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def main(
    argv: Sequence[str] | None = None,
    *,
    cli: Callable[[], None] | None = None,
    exit_: Callable[[int], Any] = os._exit,
) -> int:
    """Run lm-eval's CLI with ``argv`` (default ``sys.argv[1:]``), then exit as described.

    ``cli`` replaces ``lm_eval.__main__.cli_evaluate`` and ``exit_`` replaces
    ``os._exit`` (tests). Returns what ``exit_`` returns when it returns.
    """
    raw = os.environ.get(TIMEOUT_ENV, "60")
    try:
        timeout = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}: expected seconds, got {raw!r}") from None
    if timeout <= 0:
        raise ValueError(f"{TIMEOUT_ENV}: expected > 0, got {raw!r}")
    if cli is None:
        from lm_eval.__main__ import cli_evaluate  # type: ignore[import-untyped]

        cli = cli_evaluate
    sys.argv = [sys.argv[0] if sys.argv else "lm_eval", *(sys.argv[1:] if argv is None else argv)]
    try:
        cli()
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
