"""``mla-compare tasks``: one task's answers under native and each recipe, compared.

Reads lm-evaluation-harness ``--log_samples`` outputs (``tasks.load_lm_eval_samples``),
one samples file per repeat, and prints per recipe the accuracy with a bootstrap
interval, the paired difference to native, the answer flips both ways and the exact
McNemar test (``tasks.compare_runs``); ``--out FILE`` writes all of it as JSON.

A ``--native`` or ``--recipe`` path is a samples file or a directory: a directory gives
every ``samples_TASK_DATE.jsonl`` under it (``--task``), each one repeat, in name order.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "main", "run", "sample_files"]

FORMAT = "mla-compare-tasks"
# lm-eval's samples file name: samples_<task>_<date as 2025-01-31T12-00-00.123456>.jsonl
_SAMPLES = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")
_NAME = re.compile(r"^(?P<name>[A-Za-z0-9_.+-]+)=(?P<path>.+)$")


def sample_files(path: str | Path, task: str | None, where: str) -> list[Path]:
    """The samples files of ``path``: itself when a file, else every lm-eval samples file
    of ``task`` under the directory, in name order (a ``ValueError`` naming ``where``
    when there is none, or a directory is given without ``task``)."""
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ValueError(f"{where}: no such file or directory {str(path)!r}")
    if task is None:
        raise ValueError(f"{where}: {str(path)!r} is a directory; name the task with --task")
    found = sorted(
        f for f in p.rglob("samples_*.jsonl") if (m := _SAMPLES.match(f.name)) and m["task"] == task
    )
    if not found:
        raise ValueError(
            f"{where}: no samples_{task}_DATE.jsonl under {str(path)!r} (run lm-eval with "
            "--log_samples)"
        )
    return found


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mla-compare tasks``."""
    p = argparse.ArgumentParser(
        prog="mla-compare tasks",
        description="Accuracy with confidence intervals, answer flips and McNemar's test of "
        "one task under native and each recipe, from lm-eval --log_samples files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--native",
        action="append",
        required=True,
        metavar="PATH",
        help="the native run's samples: a samples file or a directory; repeat for repeats",
    )
    p.add_argument(
        "--recipe",
        action="append",
        required=True,
        metavar="NAME=PATH",
        help="a recipe's samples, as --native; repeat a NAME for its repeats, NAMEs for recipes",
    )
    p.add_argument(
        "--task",
        default=None,
        help="the lm-eval task whose samples files a directory gives (e.g. gsm8k)",
    )
    p.add_argument(
        "--metric", default="exact_match", help="the sample's key that is 1 when correct"
    )
    p.add_argument(
        "--filter",
        default=None,
        help="lm-eval's filter (e.g. strict-match), needed when the files hold several",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=2000,
        metavar="RESAMPLES",
        help="bootstrap resamples of the 95%% intervals",
    )
    p.add_argument("--out", default=None, metavar="FILE", help="write the comparison as JSON")
    return p


def _recipes(values: Sequence[str], task: str | None) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {}
    for value in values:
        match = _NAME.match(value)
        if match is None:
            raise ValueError(f"--recipe {value!r}: expected NAME=PATH")
        if match["name"] == "native":
            raise ValueError(f"--recipe {value!r}: 'native' names the --native run")
        files = sample_files(match["path"], task, f"--recipe {value!r}")
        out.setdefault(match["name"], []).extend(files)
    return out


def run(argv: Sequence[str] | None = None, *, console: Any = None) -> dict[str, Any]:
    """Parse, read every samples file, compare each recipe with native, print, return."""
    from rich.console import Console

    from mla_vllm.compare.tasks import compare_runs, load_lm_eval_samples

    args = build_parser().parse_args(argv)
    if args.bootstrap < 1:
        raise ValueError(f"--bootstrap: expected >= 1, got {args.bootstrap}")
    if args.out is not None and Path(args.out).is_dir():
        raise ValueError(f"--out: {args.out!r} is a directory; expected a JSON file's path")
    native_files = [f for v in args.native for f in sample_files(v, args.task, "--native")]
    recipe_files = _recipes(args.recipe, args.task)

    def load(files: list[Path], where: str) -> Any:
        try:
            return load_lm_eval_samples(files, args.metric, args.filter)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    native = load(native_files, "--native")
    report: dict[str, Any] = {
        "format": FORMAT,
        "version": 1,
        "task": args.task,
        "metric": args.metric,
        "filter": args.filter,
        "native": {"files": [str(f) for f in native_files]},
        "recipes": {},
    }
    for name, files in recipe_files.items():
        runs = load(files, f"--recipe {name}")
        try:
            result = compare_runs(native, runs, resamples=args.bootstrap)
        except ValueError as exc:
            raise ValueError(f"--recipe {name}: {exc}") from None
        report["native"]["accuracy"] = result["accuracy_native"]
        report["native"]["questions"] = result["questions"]
        report["native"]["repeats"] = result["repeats"]
        report["recipes"][name] = {"files": [str(f) for f in files], **result}
    console = console or Console()
    console.print(table(report))
    if args.out is not None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        console.print(f"report: {out}")
    return report


def _ci(figure: Mapping[str, float], spec: str) -> str:
    return f"{figure['mean']:{spec}} [{figure['low']:{spec}}, {figure['high']:{spec}}]"


def table(report: Mapping[str, Any]) -> Any:
    """A ``rich.table.Table``: native's accuracy, then per recipe its accuracy, the
    difference, flips both ways and McNemar."""
    from rich.table import Table

    native = report["native"]
    title = f"{report.get('task') or 'task'}: {native['questions']} questions x "
    title += f"{native['repeats']} repeat(s), {report['metric']}, mean [95% interval]"
    tbl = Table(title=title, title_justify="left")
    columns = ("engine", "accuracy", "Δ vs native", "lost", "gained", "flip rate")
    for column in (*columns, "McNemar b/c", "p"):
        tbl.add_column(column, justify="left" if column == "engine" else "right")
    tbl.add_row("native", _ci(native["accuracy"], ".3f"), *["-"] * 6)
    for name, r in report["recipes"].items():
        f, m = r["flips"], r["mcnemar"]
        tbl.add_row(
            name,
            _ci(r["accuracy"], ".3f"),
            _ci(r["delta"], "+.3f"),
            str(f["lost"]),
            str(f["gained"]),
            f"{f['flip_rate']:.3f}",
            f"{m['b']}/{m['c']}",
            f"{m['p_value']:.3g}",
        )
    return tbl


def main(argv: Sequence[str] | None = None) -> int:
    """``mla-compare tasks``: 0, or 2 on bad input."""
    try:
        run(argv)
    except ValueError as exc:
        print(f"mla-compare tasks: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
