"""CPU check: wheels installed with ``pip --target`` register MLA_QUANT in spawned workers.

The lent GPU machine has no package index: vLLM sits in a ``--target`` folder on
PYTHONPATH, and our packages must come as wheels installed the same way, so that
``mla_vllm-0.1.0.dist-info/entry_points.txt`` exists and vLLM's worker processes
(spawned, at tensor-parallel size > 1) run ``mla_vllm.plugin:register`` through
``vllm.plugins.load_general_plugins()``.

This script reproduces that layout here: it installs the given wheels (default:
builds them from the working tree with ``uv build --offline``) into a fresh
``--target`` folder, makes a copy of the vLLM environment's site-packages without
our packages (symbolic links), and in a fresh ``python -S`` with only those two
folders on PYTHONPATH, and again in a ``spawn``-ed child of it (how vLLM starts
TP workers), checks that the entry point is found in the target folder and that
``load_general_plugins()`` registers ``MLA_QUANT`` and its prefill backend.

Run: ``cd /work/main && python3 tests-vllm-e2e/check_plugin_target.py``
(``--wheels DIR`` to test built wheels, ``--python`` for the vLLM interpreter).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mla-formats", "mla-reference", "mla-triton", "mla-vllm")
OURS = ("mla_formats", "mla_reference", "mla_triton", "mla_vllm", "_editable_impl_mla")

PROBE = r"""
import json, multiprocessing, os, sys

def probe(tag):
    from importlib.metadata import entry_points
    found = [
        str(e.dist._path) for e in entry_points(group="vllm.general_plugins")
        if e.value == "mla_vllm.plugin:register"
    ]
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum
    import mla_vllm
    backend = AttentionBackendEnum["MLA_QUANT"].get_class()
    prefill = MLAPrefillBackendEnum["MLA_QUANT"].get_class()
    return {
        "where": tag, "pid": os.getpid(), "entry_points": found,
        "backend": f"{backend.__module__}.{backend.__name__}",
        "prefill": f"{prefill.__module__}.{prefill.__name__}",
        "mla_vllm": mla_vllm.__file__,
    }

def child(queue):
    queue.put(probe("spawned child"))

if __name__ == "__main__":
    print(json.dumps(probe("fresh process")))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue,))
    p.start()
    print(json.dumps(queue.get(timeout=300)))
    p.join()
"""


def build_wheels(dest: Path) -> None:
    for name in PACKAGES:
        subprocess.run(
            [
                "uv",
                "build",
                "--offline",
                "--wheel",
                "--no-sources",
                str(ROOT / "packages" / name),
                "-o",
                str(dest),
            ],
            check=True,
            capture_output=True,
        )


def site_without_ours(python: str, dest: Path) -> Path:
    """A folder of links to the vLLM environment's site-packages, less our packages."""
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    dest.mkdir(parents=True)
    for entry in Path(site).iterdir():
        if entry.name.startswith(OURS) or entry.suffix == ".pth":
            continue  # PYTHONPATH folders run no .pth files: as on the GPU machine
        (dest / entry.name).symlink_to(entry)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--wheels", type=Path, default=None, help="built wheels (default: build)")
    parser.add_argument("--python", default=str(ROOT / ".nox" / "vllm" / "bin" / "python"))
    parser.add_argument("--pip", default=f"{shutil.which('python3') or 'python3'} -m pip")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mla-plugin-"))
    wheels = args.wheels
    if wheels is None:
        wheels = work / "wheels"
        build_wheels(wheels)
    files = sorted(str(w) for w in wheels.glob("*.whl"))
    target = work / "target"
    subprocess.run(
        [
            *args.pip.split(),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--target",
            str(target),
            *files,
        ],
        check=True,
    )
    vllm_site = site_without_ours(args.python, work / "vllm-site")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {
        "PYTHONPATH": f"{target}{os.pathsep}{vllm_site}",
        "VLLM_TARGET_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_LOGGING_LEVEL": "ERROR",
    }
    script = work / "probe.py"
    script.write_text(PROBE)
    proc = subprocess.run(
        [args.python, "-S", str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    print(proc.stdout)
    if proc.returncode != 0:
        print(proc.stderr[-4000:])
        print("check_plugin_target: FAIL (probe exited with", proc.returncode, ")")
        return 1
    import json

    replies = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    problems = []
    for reply in replies:
        where = reply["where"]
        if len(reply["entry_points"]) != 1 or not reply["entry_points"][0].startswith(str(target)):
            problems.append(
                f"{where}: entry points {reply['entry_points']}, expected one in {target}"
            )
        if reply["backend"] != "mla_vllm.backend.MLAQuantBackend":
            problems.append(f"{where}: MLA_QUANT is {reply['backend']}")
        if reply["prefill"] != "mla_vllm.prefill.MLAQuantPrefillBackend":
            problems.append(f"{where}: prefill MLA_QUANT is {reply['prefill']}")
        if not reply["mla_vllm"].startswith(str(target)):
            problems.append(f"{where}: mla_vllm imported from {reply['mla_vllm']}")
    if len(replies) != 2:
        problems.append(f"{len(replies)} replies, expected 2")
    for p in problems:
        print("FAIL:", p)
    print(
        f"check_plugin_target: {'PASS' if not problems else 'FAIL'} ({len(files)} wheels, {target})"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
