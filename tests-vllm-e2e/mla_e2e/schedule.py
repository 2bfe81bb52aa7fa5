"""The parent's side: every configuration in its own child process, in lanes.

Each child has its own log, result JSON and timeout (a failure does not stop the
others); ``--jobs N`` runs N lanes at once and ``--deadline`` stops starting
configurations, and cuts timeouts, so that everything ends in time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .configs import DEPENDS, LANES, LANES_TP, MIN_USEFUL_SECONDS, RUNS

# The script each child runs: the entry point, which puts this package on sys.path.
ENTRY = Path(__file__).resolve().parent.parent / "run_e2e.py"


@dataclass
class Outcome:
    name: str
    status: str  # ok | error | timeout | skipped
    seconds: float
    detail: str = ""


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


# NVLink multicast stays off on the lent multi-GPU machines (device KINDS.md), and
# vLLM's symmetric-memory all-reduce with it; set in every child, whatever the caller.
MULTI_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}


def _child_env(gpu: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: apply_model
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's functions, if pickled
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # TP workers: fresh processes, no fork
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no FlashInfer on the lent GPU
    env.setdefault("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(MULTI_GPU_ENV)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def run_child(
    name: str,
    out: Path,
    model_dir: Path,
    deadline: float,
    results: dict[str, Any],
    tp: int = 1,
    gpu: str | None = None,
) -> Outcome:
    """Run one configuration in its own process (group), with its own timeout."""
    dep = DEPENDS.get(name)
    if dep is not None and dep not in results:
        return Outcome(name, "skipped", 0.0, f"needs {dep}, which did not succeed")
    left = deadline - time.time()
    if left < MIN_USEFUL_SECONDS:
        return Outcome(name, "skipped", 0.0, f"deadline: {left:.0f} s left")
    timeout = min(RUNS[name].timeout, left)
    log = out / f"{name}.log"
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)
    t0 = time.time()
    cmd = [
        sys.executable,
        str(ENTRY),
        "--out",
        str(out),
        "--_child",
        name,
        "--_model",
        str(model_dir),
        "--tp",
        str(tp),
    ]
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, env=_child_env(gpu), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Outcome(name, "timeout", time.time() - t0, f"killed after {timeout:.0f} s")
    seconds = time.time() - t0
    if code != 0 or not result_file.is_file():
        return Outcome(name, "error", seconds, f"exit code {code}")
    results[name] = json.loads(result_file.read_text())
    return Outcome(name, "ok", seconds)


def run_lanes(
    names: list[str],
    out: Path,
    model_dir: Path,
    jobs: int,
    deadline: float,
    tp: int = 1,
    gpus: list[str] | None = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """Run ``names`` in lanes, ``jobs`` lanes at once; at TP=1 lane i on ``gpus[i % n]``."""
    results: dict[str, Any] = {}
    outcomes: list[Outcome] = []
    lanes = [[n for n in lane if n in names] for lane in (LANES if tp == 1 else LANES_TP)]
    lanes = [lane for lane in lanes if lane]
    lock = threading.Lock()

    def worker(index: int) -> None:
        time.sleep(3.0 * index)  # stagger the engines' start (ports, compile caches)
        gpu = gpus[index % len(gpus)] if tp == 1 and gpus and len(gpus) > 1 else None
        while True:
            with lock:
                if not lanes:
                    return
                lane = lanes.pop(0)
            for name in lane:
                print(f"vllm_e2e: {time.strftime('%H:%M:%S')} start {name}", flush=True)
                outcome = run_child(name, out, model_dir, deadline, results, tp, gpu)
                with lock:
                    outcomes.append(outcome)
                extra = f" ({outcome.detail})" if outcome.detail else ""
                print(
                    f"vllm_e2e: {time.strftime('%H:%M:%S')} {name}: {outcome.status} "
                    f"in {outcome.seconds:.0f} s{extra}",
                    flush=True,
                )

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = {n: i for i, n in enumerate(RUNS)}
    outcomes.sort(key=lambda o: order[o.name])
    return results, outcomes
