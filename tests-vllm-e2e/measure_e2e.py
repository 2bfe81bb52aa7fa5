"""mla-compare, lm-eval and ModelOpt amax on the tiny seeded model, on a CUDA GPU.

``python tests-vllm-e2e/measure_e2e.py [--out DIR] [--jobs 3] [--backend FLASHMLA]
[--recipes none,nvfp4] [--skip-lm-eval] [--lm-eval-plain]`` (``nox -s vllm_e2e`` runs
it after ``run_e2e.py``, once against each native backend). It writes the e2e's seeded
2-layer model with a word-level tokenizer trained here (``tokenizers``, no hub
access), a checkpoint-scales directory and a ModelOpt amax state file of known
values, then runs at once:

- ``mla-compare`` (``python -m mla_vllm.compare``) against ``--backend`` (TRITON_MLA or
  FLASHMLA) for the recipes none, fp8, nvfp4, nvfp4 through the shadow, nvfp4 with
  the checkpoint scales and nvfp4 with the ModelOpt state (``--recipes``: a subset),
  on token-id and text prompts;
- the documented lm-eval command, ``python -m mla_vllm.compare.lm_eval_run run --model
  vllm`` (lm-eval's CLI, then an exit that cannot hang), with the ``--model_args`` JSON
  (``attention_backend`` MLA_QUANT, ``additional_config`` nvfp4) on a local task;
- with ``--lm-eval-plain``, also plain ``python -m lm_eval run ...`` under
  ``PYTHONFAULTHANDLER=1``: if it is still alive ``--hang-grace`` seconds after its
  results file appeared, its threads (``/proc``) and child processes are written to
  ``DIR/lm_eval_plain_hang.json`` and it gets SIGABRT (faulthandler then prints every
  Python thread's stack into ``DIR/lm_eval_plain.log``). Diagnostic only: not a check.

Checks (exit code 1 when one fails): none's KL below 1e-3 nats and its top-1
agreement 1.0 on positions whose native top-2 margin exceeds 0.05 nats; nvfp4's KL
above zero and above none's; every layer's amax from the checkpoint and from the
ModelOpt state as written; lm-eval's accuracy reported and MLA_QUANT in its log.
Results: ``DIR/measure.json``, ``DIR/compare/report.{json,png}``, ``DIR/lm_eval/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from mla_e2e.checkpoint import write_checkpoint  # noqa: E402
from mla_e2e.configs import CONFIG, KV_CACHE_BYTES, LAYERS, prompts  # noqa: E402

LAYER = "model.layers.{}.self_attn.attn"
CKPT_AMAX = {"k": (6.5, 7.0), "v": (5.5, 6.0)}  # per layer; prefill K and V
STATE_AMAX = {"q": (5.25, 5.75), "kv_c": (4.75, 4.5), "k_pe": (5.0, 4.25)}
WORDS = [
    *("the", "a", "cat", "dog", "sat", "ran", "on", "to"),
    *("mat", "end", "of", "and", "big", "small", "red", "blue"),
]
TASK = "mla_tiny_mc"
RECIPES = ("none", "fp8", "nvfp4", "nvfp4-shadow", "nvfp4-ckpt", "nvfp4-modelopt")
BACKENDS = ("TRITON_MLA", "FLASHMLA")


def write_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer (ids below the model's vocabulary), saved as transformers reads it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<s>", "</s>", "[UNK]"])
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    )
    fast.save_pretrained(str(model_dir))


def write_sources(root: Path) -> tuple[Path, Path]:
    """A checkpoint-scales directory (ModelOpt export names) and a ModelOpt amax state."""
    import torch
    from safetensors.torch import save_file

    scales = root / "scales"
    scales.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(LAYERS):
        for r in ("k", "v"):
            name = f"model.layers.{i}.self_attn.{r}_proj.{r}_scale"
            tensors[name] = torch.tensor(CKPT_AMAX[r][i] / 448.0, dtype=torch.float32)
    save_file(tensors, str(scales / "model.safetensors"))
    state = {
        f"{LAYER.format(i)}.{q}_bmm_quantizer._amax": torch.tensor(v[i])
        for q, v in STATE_AMAX.items()
        for i in range(LAYERS)
    }
    state_file = root / "amax_dict_rank0-mp1.pt"
    torch.save(state, state_file)
    return scales, state_file


def write_task(root: Path) -> Path:
    """A local lm-eval multiple-choice task (three questions over the tokenizer's words)."""
    rows = [
        {"question": "the cat sat on the", "choices": [" mat", " dog", " end"], "answer": 0},
        {"question": "a dog ran to the", "choices": [" cat", " mat"], "answer": 0},
        {"question": "the end of the", "choices": [" red", " end", " big"], "answer": 1},
        {"question": "a big red", "choices": [" dog", " of"], "answer": 0},
    ]
    task_dir = root / "task"
    task_dir.mkdir(parents=True, exist_ok=True)
    data = task_dir / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (task_dir / f"{TASK}.yaml").write_text(
        f"task: {TASK}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\nmetric_list:\n  - metric: acc\n'
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    return task_dir


def lm_eval_command(
    model_dir: Path, task_dir: Path, out: Path, *, plain: bool = False
) -> list[str]:
    """The documented command (docs/vllm.md), with the small engine settings of this model.

    ``plain``: ``python -m lm_eval`` itself instead of the wrapper (the exit diagnosis).
    """
    model_args = {
        "pretrained": str(model_dir),
        "attention_backend": "MLA_QUANT",
        "additional_config": {"mla_quant": {"recipe": "nvfp4"}},
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": 1024,
        "gpu_memory_utilization": 0.15,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
    }
    return [
        sys.executable,
        "-m",
        "lm_eval" if plain else "mla_vllm.compare.lm_eval_run",
        "run",
        "--model",
        "vllm",
        "--model_args",
        json.dumps(model_args),
        "--tasks",
        TASK,
        "--include_path",
        str(task_dir),
        "--batch_size",
        "auto",
        "--output_path",
        str(out),
    ]


def compare_command(
    model_dir: Path,
    prompts_file: Path,
    scales: Path,
    state: Path,
    out: Path,
    jobs: int,
    *,
    backend: str = "TRITON_MLA",
    recipes: tuple[str, ...] = RECIPES,
) -> list[str]:
    """``mla-compare`` against ``backend`` for ``recipes`` (names of ``RECIPES``)."""
    ckpt = {
        "recipe": "nvfp4",
        "calibration": {"from": "checkpoint", "path": str(scales), "maxbound": 448},
    }
    modelopt = {"recipe": "nvfp4", "calibration": {"from": "modelopt", "path": str(state)}}
    spelled = {
        "none": "none",
        "fp8": "fp8",
        "nvfp4": "nvfp4",
        "nvfp4-shadow": 'nvfp4-shadow={"recipe": "nvfp4", "kv_path": "shadow"}',
        "nvfp4-ckpt": f"nvfp4-ckpt={json.dumps(ckpt)}",
        "nvfp4-modelopt": f"nvfp4-modelopt={json.dumps(modelopt)}",
    }
    unknown = [r for r in recipes if r not in spelled]
    if unknown or not recipes:
        raise ValueError(f"recipes: expected names of {RECIPES}, got {list(recipes)}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    return [
        sys.executable,
        "-m",
        "mla_vllm.compare",
        str(model_dir),
        "--prompts",
        str(prompts_file),
        *(word for r in recipes for word in ("--recipe", spelled[r])),
        "--backend",
        backend,
        "--top-k",
        "20",
        "--greedy-tokens",
        "8",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "1024",
        "--gpu-memory-utilization",
        "0.15",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--jobs",
        str(jobs),
        "--timeout",
        "240",
        "--out",
        str(out),
    ]


IMPLS = {"TRITON_MLA": "TritonMLAImpl", "FLASHMLA": "FlashMLAImpl"}


def check_compare(
    report: dict[str, Any], backend: str = "TRITON_MLA"
) -> list[tuple[str, bool, str]]:
    """The checks on mla-compare's report (name, passed, detail)."""
    r = report["recipes"]
    impl = report.get("native", {}).get("engine", {}).get("impl", [])
    out: list[tuple[str, bool, str]] = [
        (f"native engine ran {IMPLS[backend]}", impl == [IMPLS[backend]], f"impl {impl}")
    ]
    for name, e in r.items():
        out.append((f"{name} ran", "error" not in e, e.get("error", "")[:300]))
    if "error" in r.get("none", {"error": ""}) or "error" in r.get("nvfp4", {"error": ""}):
        return out
    none, nvfp4 = r["none"], r["nvfp4"]
    kl = f"KL mean {none['kl_mean']:.3g}, p99 {none['kl_p99']:.3g}, max {none['kl_max']:.3g}"
    out.append(("none: KL mean < 1e-3 nats", none["kl_mean"] < 1e-3, kl))
    top1 = (
        f"{none['top1_agreement_decisive']} over {none['decisive_positions']:.0f} of "
        f"{none['positions']:.0f}; all positions {none['top1_agreement']:.4f}"
    )
    decisive = none["top1_agreement_decisive"] == 1.0
    out.append(("none: top-1 agreement 1.0 (decisive positions)", decisive, top1))
    above = nvfp4["kl_mean"] > 0.0 and nvfp4["kl_mean"] > none["kl_mean"]
    detail = f"nvfp4 {nvfp4['kl_mean']:.3g} vs none {none['kl_mean']:.3g}"
    out.append(("nvfp4: KL above zero and above none's", above, detail))
    decode_k = tuple(max(a, b) for a, b in zip(STATE_AMAX["kv_c"], STATE_AMAX["k_pe"], strict=True))
    wants: dict[str, dict[tuple[str, str], tuple[float, ...]]] = {
        "nvfp4-ckpt": {("prefill", "k"): CKPT_AMAX["k"], ("prefill", "v"): CKPT_AMAX["v"]},
        "nvfp4-modelopt": {
            ("prefill", "q"): STATE_AMAX["q"],
            ("decode", "k"): decode_k,
            ("decode", "v"): STATE_AMAX["kv_c"],
        },
    }
    for name, want in wants.items():
        if name not in r or "error" in r[name]:
            continue  # not selected (--recipes), or its failure is reported above
        amax = r[name].get("amax", {})
        bad = []
        for (path, role), values in want.items():
            for i, value in enumerate(values):
                got = amax.get(LAYER.format(i), {}).get(path, {}).get(role)
                if got is None or abs(float(got[1]) - value) > 1e-6 * value:
                    bad.append(f"layer {i} {path} {role}: {got} != {value}")
        out.append(
            (
                f"{name}: every layer's amax as written",
                not bad and bool(amax),
                "; ".join(bad) or "all match",
            )
        )
    return out


def check_lm_eval(out: Path, log: str, rc: int) -> list[tuple[str, bool, str]]:
    used = re.search(r"Using \S*MLA_QUANT backend\.", log)  # vLLM's backend selector
    results = sorted(out.rglob("results_*.json"))
    acc = None
    if results:
        acc = json.loads(results[-1].read_text()).get("results", {}).get(TASK, {}).get("acc,none")
    shut = re.search(r"\[mla lm_eval_run\] shut down (\d+) vLLM engine", log)
    return [
        ("lm-eval exited 0", rc == 0, f"exit code {rc}"),
        (
            "lm-eval's wrapper ran its exit path",
            shut is not None,
            shut.group(0) if shut else "no '[mla lm_eval_run] shut down' line in the log",
        ),
        ("lm-eval reported acc", isinstance(acc, (int, float)), f"acc {acc}"),
        (
            "lm-eval's engine selected MLA_QUANT",
            used is not None,
            used.group(0) if used else "no 'Using ... MLA_QUANT backend.' in the log",
        ),
    ]


def _threads(pid: int) -> list[dict[str, str]]:
    """The threads of ``pid`` from ``/proc``: tid, name, state, kernel wait channel."""
    out = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        row = {"tid": task.name}
        for key in ("comm", "wchan", "stat"):
            try:
                row[key] = (task / key).read_text().strip()
            except OSError:
                row[key] = ""
        stat = row.pop("stat").rpartition(")")[2].split()
        row["state"] = stat[0] if stat else ""
        out.append(row)
    return out


def watch_exit(
    proc: subprocess.Popen[bytes], results: Path, grace: float, stop_at: float, report: Path
) -> None:
    """If ``proc`` outlives its results file by ``grace`` s, record its threads and children
    in ``report`` (JSON) and send SIGABRT to the children, then to it (with
    ``PYTHONFAULTHANDLER=1`` each prints every Python thread's stack to its stderr)."""
    from mla_vllm.compare.lm_eval_run import child_processes

    seen_at = None
    while proc.poll() is None and time.time() < stop_at:
        if seen_at is None and any(results.rglob("results_*.json")):
            seen_at = time.time()
        if seen_at is not None and time.time() - seen_at > grace:
            children = [{**c, "threads": _threads(c["pid"])} for c in child_processes(proc.pid)]
            state = {
                "pid": proc.pid,
                "alive_after_results_s": round(time.time() - seen_at, 1),
                "threads": _threads(proc.pid),
                "children": children,
            }
            report.write_text(json.dumps(state, indent=2) + "\n")
            for child in children:  # the engine's stacks too (same log)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child["pid"], signal.SIGABRT)
            time.sleep(2.0)
            os.kill(proc.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the engine processes too
            return
        time.sleep(1.0)
    if seen_at is None:
        report.write_text(json.dumps({"pid": proc.pid, "results_written": False}) + "\n")
    else:
        report.write_text(json.dumps({"pid": proc.pid, "exited_by_itself": proc.poll()}) + "\n")


def _wait(proc: subprocess.Popen[bytes], seconds: float) -> int:
    """The exit code of ``proc``, or -9 after stopping it when ``seconds`` ran out."""
    try:
        return proc.wait(timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own group: the engine processes too
        proc.wait()
        return -9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="measure-e2e-out")
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--skip-lm-eval", action="store_true")
    parser.add_argument("--backend", choices=BACKENDS, default="TRITON_MLA")
    parser.add_argument(
        "--recipes", default=",".join(RECIPES), help=f"comma-separated subset of {RECIPES}"
    )
    parser.add_argument(
        "--lm-eval-plain",
        action="store_true",
        help="also run plain `python -m lm_eval` with the exit-hang diagnosis",
    )
    parser.add_argument("--hang-grace", type=float, default=20.0, help="seconds (--lm-eval-plain)")
    parser.add_argument(
        "--deadline", type=float, default=275.0, help="seconds; then the runs are stopped"
    )
    args = parser.parse_args()
    recipes = tuple(r for r in args.recipes.split(",") if r)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="mla-measure-"))
    t0 = time.time()
    model_dir = work / "model"
    write_checkpoint(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config == CONFIG
    write_tokenizer(model_dir)
    scales, state = write_sources(work)
    prompts_file = work / "prompts.jsonl"
    lines = [json.dumps(p) for p in prompts()] + [
        json.dumps({"text": "the cat sat on the mat and the dog ran to the end"}),
        json.dumps({"text": "a big red dog of the small blue cat"}),
    ]
    prompts_file.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_LOGGING_LEVEL="INFO")
    lm_proc = None
    lm_log = out / "lm_eval.log"
    watcher = plain = None
    if not args.skip_lm_eval:
        task_dir = write_task(work)
        with lm_log.open("w") as log:
            lm_proc = subprocess.Popen(
                lm_eval_command(model_dir, task_dir, out / "lm_eval"),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        if args.lm_eval_plain:
            plain_env = dict(env, PYTHONFAULTHANDLER="1")
            with (out / "lm_eval_plain.log").open("w") as log:
                plain = subprocess.Popen(
                    lm_eval_command(model_dir, task_dir, out / "lm_eval_plain", plain=True),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=plain_env,
                    start_new_session=True,
                )
            watcher = threading.Thread(
                target=watch_exit,
                args=(
                    plain,
                    out / "lm_eval_plain",
                    args.hang_grace,
                    t0 + args.deadline - 5.0,
                    out / "lm_eval_plain_hang.json",
                ),
                daemon=True,
            )
            watcher.start()
    cmp_cmd = compare_command(
        model_dir,
        prompts_file,
        scales,
        state,
        out / "compare",
        args.jobs,
        backend=args.backend,
        recipes=recipes,
    )
    with (out / "compare.log").open("w") as log:
        proc = subprocess.Popen(
            cmp_cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        rc = _wait(proc, args.deadline - (time.time() - t0))
    checks: list[tuple[str, bool, str]] = [("mla-compare exited 0", rc == 0, f"exit code {rc}")]
    report_file = out / "compare" / "report.json"
    if report_file.is_file():
        checks += check_compare(json.loads(report_file.read_text()), args.backend)
    else:
        checks.append(("mla-compare wrote report.json", False, "missing"))
    if lm_proc is not None:
        lm_rc = _wait(lm_proc, args.deadline - (time.time() - t0))
        lm_text = lm_log.read_text(errors="replace")
        checks += check_lm_eval(out / "lm_eval", lm_text, lm_rc)
    diagnostics: dict[str, Any] = {}
    if lm_proc is not None:  # the wrapper's exit report: threads and children left
        said = [line for line in lm_text.splitlines() if line.startswith("[mla lm_eval_run]")]
        diagnostics["lm_eval_wrapper_exit"] = said
    if watcher is not None and plain is not None:
        watcher.join(timeout=max(1.0, args.deadline - (time.time() - t0)))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(plain.pid, signal.SIGKILL)  # whatever of its group is left
        plain.wait()
        hang = out / "lm_eval_plain_hang.json"
        diagnostics["lm_eval_plain"] = {
            "exit_code": plain.returncode,
            "hang": json.loads(hang.read_text()) if hang.is_file() else None,
        }
    summary = {
        "seconds": round(time.time() - t0, 1),
        "commands": {
            "mla-compare": cmp_cmd,
            "lm_eval": None
            if args.skip_lm_eval
            else lm_eval_command(model_dir, work / "task", out / "lm_eval"),
        },
        "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in checks],
        "diagnostics": diagnostics,
    }
    (out / "measure.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"measure_e2e: {summary['seconds']} s")
    for name, ok, detail in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: {detail}")
    for line in diagnostics.get("lm_eval_wrapper_exit", [])[:12]:
        print(f"  [diag] {line[:300]}")
    if "lm_eval_plain" in diagnostics:
        d = diagnostics["lm_eval_plain"]
        info = d["hang"] or {}
        names = sorted({t["comm"] for t in info.get("threads", [])})
        print(
            f"  [diag] plain lm_eval: exit code {d['exit_code']}; "
            + (
                f"alive {info['alive_after_results_s']} s after its results, SIGABRT sent; "
                f"threads {names}; {len(info['children'])} child process(es)"
                if "threads" in info
                else f"{info}"
            )
        )
    table = out / "compare.log"
    if table.is_file():
        print("\n".join(table.read_text(errors="replace").splitlines()[-14:]))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
