"""``lm_eval_run --repeats N --seed S``: N runs of lm-eval's own command line, one engine.

The command line stands in for lm-eval's ``run``: lm-eval's own parser and
``EvaluatorConfig`` read ``sys.argv``, then it calls ``lm_eval.simple_evaluate`` as
lm-eval's ``run`` does (its output tracker needs packages the CPU test venv lacks). lm-eval's
``simple_evaluate`` and model creation are replaced: the stand-in records what it gets
and writes a hand-made samples file under the output path, and ``mla-compare tasks``
reads the repeats back.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from mla_vllm.compare import lm_eval_run
from mla_vllm.compare.tasks_cli import run as tasks_run

QUESTIONS = 8


def _fake(calls: list[dict[str, Any]], made: list[Any], lost: int) -> tuple[Any, Any]:
    """``simple_evaluate`` and model creation stand-ins. Repeat with seed s answers
    question i right unless i < lost or (i + s) % 4 == 0."""

    def make_model(name: str, model_args: Any, extra: dict[str, Any]) -> object:
        made.append((name, model_args, extra))
        return object()

    def evaluate(**kwargs: Any) -> None:
        seed = kwargs["gen_kwargs"]["seed"]
        out = Path(kwargs["evaluation_tracker"].output_path)
        calls.append({"seed": seed, "model": kwargs["model"], "out": out, **kwargs})
        folder = out / "model"
        folder.mkdir(parents=True)
        rows = [
            {
                "doc_id": i,
                "filter": "strict-match",
                "exact_match": float(i >= lost and (i + seed) % 4 != 0),
            }
            for i in range(QUESTIONS)
        ]
        name = f"samples_gsm8k_2026-01-31T12-00-0{seed % 10}.123456.jsonl"
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        return  # lm-eval's CLI then writes nothing itself

    return evaluate, make_model


def cli_evaluate() -> None:
    """lm-eval's ``run`` up to its ``simple_evaluate`` call (``_cli/run.py``)."""
    from lm_eval._cli.harness import HarnessCLI  # type: ignore[import-untyped]
    from lm_eval.config.evaluate_config import EvaluatorConfig  # type: ignore[import-untyped]

    cfg = EvaluatorConfig.from_cli(HarnessCLI()._parser.parse_args(sys.argv[1:]))
    from lm_eval import simple_evaluate  # type: ignore[import-untyped]

    simple_evaluate(
        model=cfg.model,
        model_args=cfg.model_args,
        tasks=cfg.tasks,
        batch_size=cfg.batch_size,
        max_batch_size=cfg.max_batch_size,
        device=cfg.device,
        log_samples=cfg.log_samples,
        evaluation_tracker=SimpleNamespace(output_path=cfg.output_path),
        gen_kwargs=cfg.gen_kwargs,
    )


def _run(
    monkeypatch: pytest.MonkeyPatch, out: Path, argv: list[str], lost: int = 0
) -> tuple[list[dict[str, Any]], list[Any], list[int]]:
    calls: list[dict[str, Any]] = []
    made: list[Any] = []
    codes: list[int] = []
    evaluate, make_model = _fake(calls, made, lost)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    base = ["run", "--model", "vllm", "--model_args", "pretrained=/m,seed=1", "--tasks", "gsm8k"]
    base += ["--gen_kwargs", "temperature=0.6", "--log_samples", "--output_path", str(out)]
    lm_eval_run.main(
        [*base, *argv],
        cli=cli_evaluate,
        exit_=codes.append,
        evaluate=evaluate,
        make_model=make_model,
    )
    return calls, made, codes


def test_repeats_write_one_samples_file_each_and_compare(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls, made, codes = _run(monkeypatch, tmp_path / "native", ["--repeats", "3", "--seed", "5"])
    assert codes == [0]
    assert [c["seed"] for c in calls] == [5, 6, 7]
    assert all(c["gen_kwargs"]["temperature"] == 0.6 for c in calls)
    assert len(made) == 1 and made[0][0] == "vllm"  # one engine for all repeats
    assert len({id(c["model"]) for c in calls}) == 1 and calls[0]["model"] is not None
    assert [c["out"].name for c in calls] == [
        "repeat000_seed5",
        "repeat001_seed6",
        "repeat002_seed7",
    ]
    files = sorted((tmp_path / "native").rglob("samples_*.jsonl"))
    assert len(files) == 3

    _run(monkeypatch, tmp_path / "nvfp4", ["--repeats", "3", "--seed", "5"], lost=2)
    report = tasks_run(
        [
            "--task",
            "gsm8k",
            "--native",
            str(tmp_path / "native"),
            "--recipe",
            f"nvfp4={tmp_path / 'nvfp4'}",
        ],
        console=Console(file=io.StringIO()),
    )
    assert report["native"]["repeats"] == 3 and report["native"]["questions"] == QUESTIONS
    flips = report["recipes"]["nvfp4"]["flips"]
    # questions 0 and 1 lost in every repeat where native had them right
    native_right = sum(1 for s in (5, 6, 7) for i in (0, 1) if (i + s) % 4 != 0)
    assert flips["lost"] == native_right and flips["gained"] == 0


def test_without_repeats_arguments_pass_through(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["run", "--model", "vllm", "--seed", "0,None,8,52", "--output_path", "x"]
    seen: list[list[str]] = []
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    lm_eval_run.main(argv, cli=lambda: seen.append(sys.argv[1:]), exit_=lambda code: None)
    assert seen == [argv]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--repeats", "0", "--log_samples", "-o", "out"], "--repeats: expected >= 1"),
        (["--repeats", "two", "--log_samples", "-o", "out"], "--repeats: expected an integer"),
        (["--repeats", "2", "--seed", "0,1", "--log_samples", "-o", "o"], "--seed: expected one"),
        (["--repeats", "2", "--log_samples"], "--output_path: required"),
        (["--repeats", "2", "-o", "out"], "--repeats: needs --log_samples"),
        (["--repeats", "2", "--log_samples", "-o", "r.json"], "--output_path: .* not a folder"),
    ],
)
def test_bad_repeats_fail_before_anything_runs(
    argv: list[str], match: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    ran: list[str] = []
    with pytest.raises(ValueError, match=match):
        lm_eval_run.main(["run", *argv], cli=lambda: ran.append("cli"), exit_=lambda code: None)
    assert ran == []


def test_output_folder_with_samples_is_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--output_path: .* not a folder"):
        lm_eval_run.parse_repeats(["--repeats", "1", "-s", "-o", str(tmp_path / "file")])
    old = tmp_path / "out" / lm_eval_run.repeat_folder(1, 4) / "m"
    old.mkdir(parents=True)
    (old / "samples_gsm8k_2026-01-31T12-00-00.1.jsonl").write_text("")
    with pytest.raises(ValueError, match="already holds samples"):
        lm_eval_run.parse_repeats(
            ["--repeats", "2", "--seed", "3", "-s", "--output_path", str(tmp_path / "out")]
        )
    got = lm_eval_run.parse_repeats(["--repeats", "1", "--seed", "3", "-s", "-o", "o"])
    assert got is not None and got.seeds() == [3]
