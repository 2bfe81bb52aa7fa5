"""The command line: preflight, the checkpoint, the lanes, the checks and the summary."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from . import __doc__ as PACKAGE_DOC
from .checkpoint import write_checkpoint
from .checks import evaluate
from .configs import CONFIG, EXPECT, RUNS, SEED, TP_DEFAULT, VLLM_VERSION
from .engine import run_one
from .probes import entry_point
from .schedule import log_tail, run_lanes
from .tp import compare_tp


def fail(message: str, code: int = 1) -> None:
    print(f"vllm_e2e: FAIL: {message}", flush=True)
    sys.exit(code)


def preflight(tp: int = 1) -> dict[str, str]:
    """Exit 2 with a clear message unless ``tp`` CUDA GPUs and vLLM 0.33.0 are there.

    At ``tp > 1`` the workers are separate processes that register ``MLA_QUANT``
    only through the ``vllm.general_plugins`` entry point: it must be installed.
    """
    try:
        import torch
    except ImportError:
        fail("torch is not installed", 2)
    if not torch.cuda.is_available():
        fail(
            "needs a CUDA GPU (torch.cuda.is_available() is False); this check does not run on CPU",
            2,
        )
    try:
        import vllm
    except ImportError as exc:
        fail(f"needs vLLM {VLLM_VERSION} ({exc})", 2)
    if vllm.__version__ != VLLM_VERSION:
        fail(f"needs vLLM {VLLM_VERSION}, found {vllm.__version__}", 2)
    try:
        import mla_triton  # noqa: F401
        import mla_vllm.backend  # noqa: F401
    except ImportError as exc:
        fail(f"needs mla_vllm and mla_triton importable ({exc})", 2)
    count = torch.cuda.device_count()
    if count < tp:
        fail(f"--tp {tp} needs {tp} CUDA GPUs, found {count}", 2)
    if tp > 1 and entry_point() is None:
        fail(
            f"--tp {tp}: vLLM's worker processes register MLA_QUANT only through the "
            "'vllm.general_plugins' entry point, and none is installed (packages on "
            "PYTHONPATH have no dist-info). Install the wheels, e.g. `python3 -m pip "
            "install --no-deps --no-index --target /tmp/mla-site .e2e-pin/wheels/*.whl` "
            "and put /tmp/mla-site first on PYTHONPATH (docs/contributing.md)",
            2,
        )
    return {"torch": torch.__version__, "vllm": vllm.__version__, "gpus": str(count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=(PACKAGE_DOC or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("vllm-e2e-out"))
    parser.add_argument("--tol", type=float, default=0.05, help="max |Δ logprob| in nats")
    parser.add_argument("--only", nargs="*", default=None, help="run these configurations")
    parser.add_argument("--jobs", type=int, default=1, help="lanes of configurations at once")
    parser.add_argument(
        "--deadline", type=float, default=None, help="end everything within this many seconds"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    parser.add_argument(
        "--compare-tp",
        default=None,
        metavar="A,B",
        help="compare two result folders (no GPU needed); the table goes to --out",
    )
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_model", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out: Path = args.out
    if args._child:
        out.mkdir(parents=True, exist_ok=True)
        try:
            result = run_one(args._child, out, args._model, args.tp)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        (out / f"{args._child}.json").write_text(json.dumps(result, indent=1))
        print(f"vllm_e2e child {args._child}: done", flush=True)
        os._exit(0)  # skip the engine's teardown: the process is done
    if args.compare_tp is not None:
        folders = [Path(x) for x in args.compare_tp.split(",")]
        if len(folders) != 2:
            parser.error("--compare-tp takes two result folders: A,B")
        ok, table, rows = compare_tp(folders[0], folders[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "tp_compare.txt").write_text("\n".join(table) + "\n")
        (out / "tp_compare.json").write_text(
            json.dumps({"a": str(folders[0]), "b": str(folders[1]), "passed": ok, "checks": rows})
        )
        print("\n".join(table), flush=True)
        sys.exit(0 if ok else 1)
    unknown = sorted(set(args.only or []) - set(RUNS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; expected some of {list(RUNS)}")
    if args.tp < 1 or int(CONFIG["num_attention_heads"]) % args.tp:
        parser.error(f"--tp {args.tp}: must divide the {CONFIG['num_attention_heads']} heads")
    started = time.time()
    versions = preflight(args.tp)
    deadline = started + (args.deadline if args.deadline is not None else 24 * 3600.0)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="mla-e2e-model-"))
    sha = write_checkpoint(model_dir)
    weights = {"format": "safetensors", "seed": SEED, "sha256": sha}
    (model_dir / "weights.json").write_text(json.dumps(weights))
    default = [n for n in RUNS if n not in EXPECT] if args.tp == 1 else list(TP_DEFAULT)
    names = [n for n in RUNS if (n in default if args.only is None else n in args.only)]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_list = gpus.split(",") if gpus else [str(i) for i in range(int(versions["gpus"]))]
    print(
        f"vllm_e2e: {len(names)} configurations at TP={args.tp}, {args.jobs} at once, tol "
        f"{args.tol} nats, weights sha256 {sha[:12]}, out {out}",
        flush=True,
    )
    results, outcomes = run_lanes(names, out, model_dir, args.jobs, deadline, args.tp, gpu_list)
    checks, lines = evaluate(results, args.tol, out, args.tp)
    runs_ok = all(o.status == "ok" for o in outcomes)
    passed = runs_ok and all(c["ok"] for c in checks)

    report = [
        f"vllm_e2e summary: torch {versions['torch']}, vllm {versions['vllm']}, "
        f"{len(outcomes)} configurations at TP={args.tp} in {time.time() - started:.0f} s "
        f"(--jobs {args.jobs}), weights sha256 {sha[:12]}",
        "runs:",
    ]
    for o in outcomes:
        r = results.get(o.name, {})
        info = ""
        if r:
            info = (
                f"; engine start {r.get('engine_seconds', 0):.0f} s, cudagraph_mode "
                f"{r.get('cudagraph_mode')}, {r.get('registered')}"
            )
        detail = f" ({o.detail})" if o.detail else ""
        report.append(f"  {o.name:18s} {o.status:8s} {o.seconds:5.0f} s{detail}{info}")
    report.append("checks:")
    report += lines
    report.append(f"vllm_e2e: {'PASS' if passed else 'FAIL'}")
    failures = [o for o in outcomes if o.status in ("error", "timeout")]
    for o in failures:
        tail = log_tail(out / f"{o.name}.log")
        print(f"---- last lines of {o.name}.log ({o.status}) ----\n{tail}")
    text = "\n".join(report)
    (out / "summary.txt").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "versions": versions,
                "tp": args.tp,
                "weights": weights,
                "tol": args.tol,
                "runs": [dict(o.__dict__, seconds=round(o.seconds, 1)) for o in outcomes],
                "checks": checks,
                "passed": passed,
            },
            indent=1,
        )
    )
    print(text, flush=True)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
