"""Start one engine process per configuration (the parent's side; no vLLM import).

``launch(spec, workdir)`` writes the spec as JSON and runs ``python -m
mla_vllm.compare.engine SPEC OUT`` with the engine's output in ``workdir/NAME.log``.
One process per engine: GPU memory and vLLM's global state are released between
configurations.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

__all__ = ["PHASE", "EngineError", "child_env", "has_entry_point", "launch"]


class EngineError(RuntimeError):
    """An engine process failed; the message ends with the tail of its log."""


def has_entry_point() -> bool:
    """True when mla-vllm's ``vllm.general_plugins`` entry point is installed."""
    return any(
        ep.value.startswith("mla_vllm.plugin") for ep in entry_points(group="vllm.general_plugins")
    )


def child_env(spec: Mapping[str, Any]) -> dict[str, str]:
    """The engine process's environment: ``apply_model`` allowed; in-process engine without
    the entry point (sources on PYTHONPATH), which tensor parallelism cannot do."""
    env = dict(os.environ)
    env.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # get_stats, layer_amax
    if not has_entry_point():
        if int(spec.get("tensor_parallel_size", 1)) > 1:
            raise EngineError(
                f"{spec['name']}: no 'vllm.general_plugins' entry point for mla_vllm: "
                "tensor-parallel workers could not register MLA_QUANT; install the package"
            )
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


PHASE = "mla-compare phase: "
"""Prefix of the lines the engine process prints at each phase (``engine.run_spec``)."""
POLL_S = 0.5


def _command(spec_file: Path, out_file: Path) -> list[str]:
    return [sys.executable, "-m", "mla_vllm.compare.engine", str(spec_file), str(out_file)]


def _detail(line: str, width: int = 60) -> str:
    """A log line, shortened for the progress display (vLLM's ``INFO ... [file:N]`` dropped)."""
    text = line.split("] ", 1)[1] if line.startswith(("INFO", "WARNING", "DEBUG")) else line
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


class _Watch:
    """Reads the log as it grows; reports each new phase, and during a phase the latest
    other line (vLLM's start-up messages) after it."""

    def __init__(self, log_file: Path, on_phase: Callable[[str], None] | None) -> None:
        self.log_file = log_file
        self.on_phase = on_phase
        self.offset = 0
        self.partial = ""
        self.phase = ""
        self.shown = ""

    def poll(self) -> None:
        if self.on_phase is None:
            return
        with self.log_file.open("r", errors="replace") as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        lines = (self.partial + chunk).split("\n")
        self.partial = lines.pop()
        detail = ""
        for line in lines:
            if line.startswith(PHASE):
                self.phase, detail = line[len(PHASE) :].strip(), ""
            elif line.strip():
                detail = _detail(line)
        text = f"{self.phase}: {detail}" if self.phase and detail else self.phase or detail
        if text and text != self.shown:
            self.shown = text
            self.on_phase(text)


def launch(
    spec: Mapping[str, Any],
    workdir: Path,
    *,
    timeout: float | None = None,
    on_phase: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m mla_vllm.compare.engine`` process (parent side).

    The child's output goes to ``workdir/<name>.log``; ``on_phase`` gets, as they come,
    the phases it reports (starting the engine, prompts, statistics) and, within one, its
    latest log line (vLLM's start-up progress). A failure, or a run past ``timeout``
    seconds (the process group is then killed), raises ``EngineError`` with the log's
    last lines.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    name = str(spec["name"])
    spec_file = workdir / f"{name}.spec.json"
    out_file = workdir / f"{name}.out.json"
    log_file = workdir / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    out_file.unlink(missing_ok=True)
    env = child_env(spec)
    deadline = None if timeout is None else time.monotonic() + timeout
    with log_file.open("w") as log:
        child = subprocess.Popen(
            _command(spec_file, out_file),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills vLLM's workers too
        )
        watch = _Watch(log_file, on_phase)
        rc: int | None = None
        while rc is None:
            try:
                rc = child.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() > deadline:
                    _kill(child)
                    raise EngineError(
                        f"{name}: engine process ran past --timeout {timeout} s and was "
                        f"killed (log {log_file}):\n{_tail(log_file)}"
                    ) from None
            watch.poll()
    if rc != 0 or not out_file.is_file():
        raise EngineError(
            f"{name}: engine process exited with {rc} (log {log_file}):\n{_tail(log_file)}"
        )
    result: dict[str, Any] = json.loads(out_file.read_text())
    return result


def _kill(child: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):  # gone already
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()


def _tail(log_file: Path, lines: int = 15) -> str:
    return "\n".join(log_file.read_text(errors="replace").splitlines()[-lines:])
