"""Start one engine process per configuration (the parent's side; no vLLM import).

``launch(spec, workdir)`` writes the spec as JSON and runs ``python -m
mla_vllm.compare.engine SPEC OUT`` with the engine's output in ``workdir/NAME.log``.
One process per engine: GPU memory and vLLM's global state are released between
configurations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

__all__ = ["EngineError", "child_env", "has_entry_point", "launch"]


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


def launch(
    spec: Mapping[str, Any], workdir: Path, *, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``spec`` in a fresh ``python -m mla_vllm.compare.engine`` process (parent side).

    The child's output goes to ``workdir/<name>.log``; a failure raises ``EngineError``
    with the log's last lines.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    name = str(spec["name"])
    spec_file = workdir / f"{name}.spec.json"
    out_file = workdir / f"{name}.out.json"
    log_file = workdir / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    out_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mla_vllm.compare.engine", str(spec_file), str(out_file)]
    env = child_env(spec)
    with log_file.open("w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, check=False, env=env
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc != 0 or not out_file.is_file():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-15:])
        raise EngineError(f"{name}: engine process exited with {rc} (log {log_file}):\n{tail}")
    result: dict[str, Any] = json.loads(out_file.read_text())
    return result
