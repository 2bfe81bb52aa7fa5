"""``mla-compare MODEL --prompts FILE --recipe R [--recipe R ...]``: the command line.

Every input is checked here before any engine starts (prompts, their lengths, the
recipes, through ``mla_vllm.config``); then the native engine and one engine per
recipe run, each in its own process (``launch.launch``), ``--jobs`` at a time, under
a rich progress display; the report is written as JSON and PNG and shown as a table.
Each engine's results are saved under ``--out`` with ``result_key`` (a hash of its spec):
a rerun reuses them unless ``--no-resume``. ``mla-compare tasks ...`` goes to
``tasks_cli``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mla_vllm.compare.inputs import (
    add_calibrated,
    check_layer_names,
    check_lengths,
    check_model,
    check_out_dir,
    follow_up_ids,
    load_prompts,
    model_max_len,
    parse_recipes,
    tokenize,
)
from mla_vllm.compare.launch import launch
from mla_vllm.compare.report import (
    build_report,
    calibration_recovery,
    generation_table,
    plot,
    plot_generation,
    table,
)

__all__ = ["BACKENDS", "DEFAULT_FOLLOW_UP", "build_parser", "main", "result_key", "run"]

BACKENDS = ("TRITON_MLA", "FLASHMLA")
NATIVE = "native"
DEFAULT_FOLLOW_UP = "\n\nCheck your answer step by step, then give it again."
"""The follow-up turn's text when ``--turns`` > 1 and no ``--follow-up`` is given."""
Launcher = Callable[[Mapping[str, Any], Path], dict[str, Any]]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0.0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after each option's help, but where the help says the default
    itself (a default of None or an empty list) or the option is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        unset = action.default is None or action.default is False or action.default == []
        if unset or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mla-vllm")
    except PackageNotFoundError:  # sources on PYTHONPATH
        from mla_vllm import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mla-compare``."""
    p = argparse.ArgumentParser(
        prog="mla-compare",
        description="KL, top-1 agreement, perplexity and per-layer attention error of "
        "MLA_QUANT recipes against the native MLA backend, on one model. Every input is "
        "checked before the first engine starts; each engine runs in its own process.",
        epilog="'mla-compare tasks --help': a task's accuracy, answer flips and McNemar's "
        "test from lm-eval --log_samples files.",
        formatter_class=_HelpFormatter,
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="the model: a local directory holding config.json, or a Hugging Face hub id",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s (mla-vllm {_version()})")
    p.add_argument(
        "--prompts",
        required=True,
        metavar="FILE",
        help="prompts: .jsonl (one a line: text, a list of token ids or an object), .json "
        "(a list of the same) or a text file (one prompt per non-empty line)",
    )
    p.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="[NAME=]RECIPE",
        help="a recipe to compare: an mla_quant JSON object, a JSON file, or a format name "
        "(nvfp4, fp8, none); repeat for more; at least one",
    )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="TRITON_MLA",
        help="the native MLA backend the recipes are compared against",
    )
    p.add_argument("--top-k", type=int, default=20, help="prompt logprobs per position (>= 2)")
    p.add_argument(
        "--greedy-tokens",
        type=int,
        default=0,
        help="greedy tokens generated per prompt after the forced pass (0: no greedy pass)",
    )
    p.add_argument(
        "--generate",
        type=int,
        default=0,
        metavar="N",
        help="generation fidelity: each recipe's engine generates N tokens per prompt with "
        "top-k logprobs, then the native engine scores those tokens (0: prompt scoring only)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of --generate (0: greedy); request i is seeded with i",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="--generate: go on past the end-of-sequence token, so every prompt gives N tokens "
        "(default: stop there)",
    )
    p.add_argument(
        "--turns",
        type=_positive_int,
        default=1,
        help="--generate: turns per prompt; turn t + 1 feeds turn t's context and answer "
        "back with --follow-up, in the same engine (prefix cache, chunked context), and "
        "the figures are reported per turn",
    )
    p.add_argument(
        "--follow-up",
        default=None,
        metavar="TEXT|IDS",
        help="--turns: what follows each answer, text (tokenized like the prompts) or a JSON "
        f"list of token ids (default: the text {DEFAULT_FOLLOW_UP!r})",
    )
    p.add_argument(
        "--bootstrap",
        type=_positive_int,
        default=1000,
        metavar="RESAMPLES",
        help="bootstrap resamples of the generation figures' 95%% confidence intervals",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="GPUs per engine (vLLM's tensor_parallel_size)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="the engines' context length (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16"),
        help="the model's activation dtype (auto: the checkpoint's)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for text prompts, a directory or hub id (default: the model's)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="fraction of GPU memory an engine may take, in (0, 1]",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=_positive_int,
        default=None,
        metavar="BYTES",
        help="KV-cache size per GPU in bytes (default: sized from --gpu-memory-utilization)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=None,
        help="sequences per engine step (default: vLLM's)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture CUDA graphs (decode steps replayed from a graph are not observed); "
        "default: eager",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's prefix caching in every engine (default: on with --turns > 1, so later "
        "turns read earlier ones from the cache; else off)",
    )
    p.add_argument(
        "--chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's chunked prefill in every engine (default: vLLM's)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=None,
        help="tokens per engine step; with chunked prefill, longer prompts are prefilled "
        "in chunks that read the earlier chunks as context (default: vLLM's)",
    )
    p.add_argument(
        "--calibration",
        action="append",
        default=[],
        metavar="[RECIPE=]SOURCE",
        help="compare each recipe (or RECIPE) also with static amaxes from SOURCE, as "
        "RECIPE-calibrated beside it: a calibrate() file, 'checkpoint' (the model's "
        "ModelOpt KV scales) or a calibration JSON object such as "
        '\'{"from": "modelopt", "path": "amax.pt"}\'; repeat for more (default: none)',
    )
    p.add_argument(
        "--observe-interval",
        type=_positive_int,
        default=1,
        help="observe every N-th attention call (recipes without their own observe)",
    )
    p.add_argument(
        "--tie-margin",
        type=float,
        default=0.05,
        help="top-2 margin (nats) below which a position is a near tie",
    )
    p.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="engines at once (small models can share one GPU)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="SECONDS",
        help="seconds an engine may run, start-up included (default: no limit)",
    )
    p.add_argument(
        "--out",
        default="mla-compare-out",
        metavar="DIR",
        help="output directory: report.json, report.png, engines/ (logs, results)",
    )
    p.add_argument(
        "--resume",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse an engine's results saved in --out by an earlier run with the same model, "
        "recipe, prompts, sampling and engine settings (--no-resume: run every engine)",
    )
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.top_k < 2:
        raise ValueError(f"--top-k: expected >= 2, got {args.top_k}")
    if args.greedy_tokens < 0:
        raise ValueError(f"--greedy-tokens: expected >= 0, got {args.greedy_tokens}")
    if args.generate < 0:
        raise ValueError(f"--generate: expected >= 0, got {args.generate}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0.0):
        raise ValueError(f"--temperature: expected a finite number >= 0, got {args.temperature}")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        raise ValueError(
            f"--gpu-memory-utilization: expected in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.turns > 1 and not args.generate:
        raise ValueError("--turns: multi-turn needs --generate N (tokens per turn)")
    if args.follow_up is not None and args.turns < 2:
        raise ValueError("--follow-up: only used with --turns 2 or more")
    if not args.tie_margin >= 0.0:
        raise ValueError(f"--tie-margin: expected >= 0, got {args.tie_margin}")
    check_out_dir(args.out, "--out")


def _with_observe(config: Mapping[str, Any], interval: int) -> dict[str, Any]:
    out = dict(config)
    out.setdefault("observe", {"enabled": True, "interval": interval})
    return out


def _prefix_caching(args: argparse.Namespace) -> bool:
    """``--prefix-caching``, or its default: on for multi-turn, else off."""
    return bool(args.turns > 1 if args.prefix_caching is None else args.prefix_caching)


def _specs(
    args: argparse.Namespace, prompts: list[list[int]], recipes: Any, follow_up: list[int]
) -> dict[str, dict[str, Any]]:
    common = {
        "model": args.model,
        "prompts": prompts,
        "top_k": args.top_k,
        "greedy_tokens": args.greedy_tokens,
        "tensor_parallel_size": args.tensor_parallel_size,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "enforce_eager": not args.cuda_graphs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": _prefix_caching(args),
        "enable_chunked_prefill": args.chunked_prefill,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": 0,
    }
    specs = {NATIVE: {**common, "name": NATIVE, "backend": args.backend, "mla_quant": None}}
    generate = None
    if args.generate:
        generate = {
            "max_tokens": args.generate,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "seed": 0,
            "turns": args.turns,
            "follow_up": follow_up,
        }
    for r in recipes:
        specs[r.name] = {
            **common,
            "name": r.name,
            "backend": "MLA_QUANT",
            "mla_quant": _with_observe(r.config, args.observe_interval),
            "generate": generate,
        }
    return specs


def _check_generate(
    prompts: Sequence[Sequence[int]],
    generate: int,
    max_len: int | None,
    turns: int = 1,
    follow_up: int = 0,
) -> None:
    """Every prompt plus its ``turns`` answers of ``--generate`` tokens and the follow-ups
    between them fits the context the native engine scores."""
    if not generate or max_len is None:
        return
    longest = max(len(p) for p in prompts)
    total = longest + turns * generate + (turns - 1) * follow_up
    if total > max_len:
        what = f"{generate} generated tokens"
        if turns > 1:
            what = f"{turns} turns of {generate} generated and {follow_up} follow-up tokens"
        raise ValueError(
            f"--generate: the longest prompt ({longest} tokens) plus {what} exceeds "
            f"max_model_len {max_len} (lower --generate or --turns, or raise --max-model-len)"
        )


def _score_spec(
    native: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]], prompts: list[list[int]]
) -> dict[str, Any]:
    """The native spec with ``score``: each recipe's generations, to score."""
    score = {
        name: [
            [g.get("context", prompts[i % len(prompts)]), g["tokens"]]
            for i, g in enumerate(r["generated"])
        ]
        for name, r in results.items()
        if r.get("generated")
    }
    return {**native, "score": score}


def result_key(spec: Mapping[str, Any]) -> str:
    """What an engine's results depend on, hashed: its whole spec (model, backend, recipe
    configuration, prompts, sampling, engine settings and, for the native engine, the
    generations it scores) and the mla-vllm and vLLM versions."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version: str | None = version("vllm")
    except PackageNotFoundError:
        vllm_version = None
    text = json.dumps(
        {"spec": spec, "mla_vllm": _version(), "vllm": vllm_version},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).hexdigest()


def _saved(path: Path, key: str) -> dict[str, Any] | None:
    """The results saved at ``path`` under ``key``; None when absent, unreadable or for
    another key."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("key") != key:
        return None
    if not isinstance(doc.get("result"), dict):
        return None
    result: dict[str, Any] = doc["result"]
    return result


def _save_result(workdir: Path, name: str, key: str, result: Mapping[str, Any]) -> None:
    """``workdir/NAME.result.json``: the results and their ``result_key``, written whole
    (a temporary file renamed), so an interrupted run leaves no half file."""
    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / f"{name}.result.json.tmp"
    tmp.write_text(json.dumps({"key": key, "result": result}))
    tmp.replace(workdir / f"{name}.result.json")
    (workdir / f"{name}.out.json").unlink(missing_ok=True)  # launch's copy, now redundant


def run(
    argv: Sequence[str] | None = None,
    *,
    launcher: Launcher | None = None,
    console: Any = None,
) -> dict[str, Any]:
    """Parse, check, run every engine (``launcher``, default ``launch.launch``), report."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    args = build_parser().parse_args(argv)
    _check_args(args)
    console = console or Console()
    check_model(args.model)
    max_len = model_max_len(args.model, args.max_model_len)
    prompts = tokenize(load_prompts(args.prompts), args.model, args.tokenizer)
    check_lengths(prompts, max_len)
    recipes = parse_recipes(args.recipe, args.model)
    if NATIVE in {r.name for r in recipes}:
        raise ValueError(f"--recipe: {NATIVE!r} names the native run; choose another name")
    check_layer_names(recipes, args.model, args.model)
    recipes = add_calibrated(recipes, args.calibration, args.model, args.model)
    follow_up: list[int] = []
    if args.turns > 1:
        follow_up = follow_up_ids(args.follow_up or DEFAULT_FOLLOW_UP, args.model, args.tokenizer)
    ids = [list(p.ids or ()) for p in prompts]
    _check_generate(ids, args.generate, max_len, args.turns, len(follow_up))
    specs = _specs(args, ids, recipes, follow_up)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"--out: cannot make {args.out!r}: {exc.strerror or exc}") from None
    resumed: list[str] = []

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task(f"{len(specs)} engines", total=len(specs))
        tasks = {name: progress.add_task(f"{name}: waiting", total=1) for name in specs}

        def phase(name: str) -> Callable[[str], None]:
            def update(text: str) -> None:
                progress.update(tasks[name], description=f"{name}: {text}")

            return update

        def one(name: str, spec: Mapping[str, Any]) -> dict[str, Any]:
            workdir = out / "engines"
            key = result_key(spec)
            saved = _saved(workdir / f"{name}.result.json", key) if args.resume else None
            if saved is not None:
                resumed.append(name)
                progress.update(tasks[name], completed=1)
                progress.advance(overall)
                phase(name)("done earlier (results in --out reused)")
                return saved
            phase(name)("starting the engine process")
            try:
                if launcher is None:
                    result = launch(spec, workdir, timeout=args.timeout, on_phase=phase(name))
                else:
                    result = launcher(spec, workdir)
                _save_result(workdir, name, key, result)
            except Exception:
                phase(name)("failed")
                raise
            finally:
                progress.update(tasks[name], completed=1)
                progress.advance(overall)
            phase(name)("done")
            return result

        # with --generate the native engine scores the recipes' generations: it runs last
        rounds = [[n for n in specs if n != NATIVE], [NATIVE]] if args.generate else [list(specs)]
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for names in rounds:
                futures: dict[str, Future[dict[str, Any]]] = {}
                for n in names:
                    spec = specs[n]
                    if n == NATIVE and args.generate:
                        spec = _score_spec(spec, results, ids)
                    futures[n] = pool.submit(one, n, spec)
                for name, future in futures.items():
                    try:
                        results[name] = future.result()
                    except Exception as exc:  # one failed recipe does not hide the others
                        errors[name] = str(exc)
    if NATIVE in errors:
        raise RuntimeError(f"the native engine failed: {errors[NATIVE]}")
    meta = {
        "model": args.model,
        "prompts_file": args.prompts,
        "prompts": len(ids),
        "prompt_tokens": sum(map(len, ids)),
        "top_k": args.top_k,
        "greedy_tokens": args.greedy_tokens,
        "generate": args.generate,
        "temperature": args.temperature,
        "ignore_eos": args.ignore_eos,
        "turns": args.turns,
        "follow_up": follow_up,
        "tensor_parallel_size": args.tensor_parallel_size,
        "cuda_graphs": args.cuda_graphs,
        "prefix_caching": _prefix_caching(args),
        "chunked_prefill": args.chunked_prefill,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "calibration": list(args.calibration),
        "resumed": sorted(resumed),
    }
    report = build_report(
        results[NATIVE],
        {n: r for n, r in results.items() if n != NATIVE},
        recipes={r.name: specs[r.name]["mla_quant"] for r in recipes},
        errors=errors,
        meta=meta,
        tie_margin=args.tie_margin,
        resamples=args.bootstrap,
    )
    calibration_recovery(report, {r.name: r.calibration_of for r in recipes if r.calibration_of})
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    plot(report, out / "report.png")
    console.print(table(report))
    plots = f"{out / 'report.png'}"
    if any("generation" in e for e in report["recipes"].values()):
        plot_generation(report, out / "generation.png")
        console.print(generation_table(report))
        plots += f", {out / 'generation.png'}"
    console.print(f"report: {out / 'report.json'}, plots: {plots}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: 0 when every engine ran, 1 when a recipe failed, 2 on bad input.

    ``mla-compare tasks ...`` is the task-level comparison (``tasks_cli``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["tasks"]:
        from mla_vllm.compare.tasks_cli import main as tasks_main

        return tasks_main(args[1:])
    try:
        report = run(args)
    except ValueError as exc:
        print(f"mla-compare: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"mla-compare: {exc}", file=sys.stderr)
        return 1
    return 1 if any("error" in e for e in report["recipes"].values()) else 0
