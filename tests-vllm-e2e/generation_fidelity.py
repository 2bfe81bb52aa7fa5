"""Generation fidelity on the e2e's tiny seeded model, on one CUDA GPU.

``python tests-vllm-e2e/generation_fidelity.py [--out DIR] [--prompts 64] [--tokens 1024]
[--jobs 5] [--backend FLASHMLA] [-- MLA-COMPARE ARGS ...]`` writes the e2e's seeded
2-layer DeepSeek-V2-style model (``mla_e2e.checkpoint``: real safetensors, no
tokenizer) and ``--prompts`` seeded token-id prompts of 16 to 256 tokens, then runs
``mla-compare --generate`` against ``--backend`` for the recipes none, fp8 and nvfp4,
each with K/V rounded on read and through the shadow, with CUDA graphs and
``--ignore-eos`` (every prompt generates ``--tokens`` tokens). Arguments after ``--`` go
to mla-compare as well (``--turns 2 --follow-up '[5, 6, 7]'``, ``--calibration ...``).

Results: ``DIR/compare/report.json``, ``report.png``, ``generation.png``, and
``DIR/generation_fidelity.json`` with the command and the check: the recipe ``none``
must stay at float-noise level at every generated position (its KL mean below 1e-3
nats in every generated-position bucket). Exit code 0 when mla-compare ran every
engine and the check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mla_e2e.checkpoint import write_checkpoint  # noqa: E402
from mla_e2e.configs import CONFIG, KV_CACHE_BYTES, SEED, VOCAB  # noqa: E402

RECIPES = (
    "none",
    "fp8",
    'fp8-shadow={"recipe": "fp8", "kv_path": "shadow"}',
    "nvfp4",
    'nvfp4-shadow={"recipe": "nvfp4", "kv_path": "shadow"}',
)
NOISE_KL = 1e-3  # nats: none's KL mean in every generated-position bucket stays below


def write_prompts(path: Path, count: int, low: int = 16, high: int = 256) -> None:
    """``count`` seeded token-id prompts of ``low`` to ``high`` tokens, one a line."""
    rng = random.Random(SEED + 1)
    lines = []
    for _ in range(count):
        n = rng.randint(low, high)
        lines.append(json.dumps([rng.randrange(2, VOCAB) for _ in range(n)]))
    path.write_text("\n".join(lines) + "\n")


def compare_command(
    model_dir: Path,
    prompts_file: Path,
    out: Path,
    *,
    tokens: int,
    jobs: int,
    backend: str,
    extra: list[str],
) -> list[str]:
    """The ``mla-compare`` command line of the run."""
    return [
        sys.executable,
        "-m",
        "mla_vllm.compare",
        str(model_dir),
        "--prompts",
        str(prompts_file),
        *(word for r in RECIPES for word in ("--recipe", r)),
        "--backend",
        backend,
        "--generate",
        str(tokens),
        "--ignore-eos",
        "--cuda-graphs",
        "--top-k",
        "20",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(CONFIG["max_position_embeddings"]),
        "--gpu-memory-utilization",
        "0.15",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--jobs",
        str(jobs),
        "--timeout",
        "420",
        "--out",
        str(out),
        *extra,
    ]


def check_none(report: dict[str, Any]) -> tuple[bool, str]:
    """Recipe none's generated KL at float-noise level in every position bucket."""
    none = report.get("recipes", {}).get("none", {})
    gen = none.get("generation")
    if gen is None:
        return False, none.get("error", "no generation figures for none")[:300]
    buckets = {
        **gen["by_position"],
        **{f"turn {t}": f["overall"] for t, f in gen.get("by_turn", {}).items()},
    }
    worst = max(f["kl"]["mean"] for f in buckets.values())
    detail = ", ".join(
        f"{label}: KL mean {f['kl']['mean']:.3g}, max {f.get('kl_max', float('nan')):.3g}, "
        f"top-1 {f['top1']['mean']:.4f}"
        for label, f in buckets.items()
    )
    return worst < NOISE_KL, detail


def main(argv: list[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, extra = args_in[:cut], args_in[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="generation-fidelity-out")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--jobs", type=int, default=5)
    p.add_argument("--backend", default="FLASHMLA", choices=("FLASHMLA", "TRITON_MLA"))
    args = p.parse_args(args_in)
    out = Path(args.out)
    model_dir = out / "model"
    write_checkpoint(model_dir)
    prompts_file = out / "prompts.jsonl"
    write_prompts(prompts_file, args.prompts)
    cmd = compare_command(
        model_dir,
        prompts_file,
        out / "compare",
        tokens=args.tokens,
        jobs=args.jobs,
        backend=args.backend,
        extra=extra,
    )
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.time()
    rc = subprocess.call(cmd)
    seconds = round(time.time() - t0, 1)
    report_file = out / "compare" / "report.json"
    report = json.loads(report_file.read_text()) if report_file.is_file() else {}
    passed, detail = check_none(report) if report else (False, "no report.json")
    doc = {
        "command": cmd[1:],
        "exit_code": rc,
        "seconds": seconds,
        "check": {
            "name": f"none: generated KL mean < {NOISE_KL} in every bucket",
            "passed": passed,
            "detail": detail,
        },
    }
    (out / "generation_fidelity.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"mla-compare exit code {rc} after {seconds} s; none at noise level: {passed} ({detail})")
    return 0 if rc == 0 and passed else 1


if __name__ == "__main__":
    sys.exit(main())
