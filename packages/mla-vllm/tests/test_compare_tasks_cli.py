"""``mla-compare tasks`` on hand-made lm-eval ``--log_samples`` files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from mla_vllm.compare.cli import main
from mla_vllm.compare.tasks import mcnemar_exact
from mla_vllm.compare.tasks_cli import run, sample_files

# 10 questions: native right on 0-7; the recipe loses 6 and 7 and gains 9
NATIVE = [1, 1, 1, 1, 1, 1, 1, 1, 0, 0]
RECIPE = [1, 1, 1, 1, 1, 1, 0, 0, 0, 1]


def _samples(path: Path, correct: list[int], task: str = "gsm8k") -> Path:
    """An lm-eval samples file: each question under two filters (only strict-match's
    outcome is ``correct``; flexible-extract says right everywhere)."""
    rows = []
    for i, c in enumerate(correct):
        for name, value in (("strict-match", c), ("flexible-extract", 1)):
            rows.append(
                {
                    "doc_id": i,
                    "doc": {"question": f"q{i}"},
                    "target": "1",
                    "filter": name,
                    "metrics": ["exact_match"],
                    "exact_match": float(value),
                }
            )
    path.mkdir(parents=True, exist_ok=True)
    file = path / f"samples_{task}_2026-01-31T12-00-00.123456.jsonl"
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return file


def test_tasks_compares_accuracy_flips_and_mcnemar(tmp_path: Path) -> None:
    native_dir = tmp_path / "native" / "model"
    native_dir.mkdir(parents=True)
    _samples(native_dir, NATIVE)
    _samples(native_dir, [0] * 10, task="gsm8k_cot")  # another task: not picked
    recipe_file = _samples(tmp_path / "nvfp4", RECIPE)
    out = tmp_path / "cmp" / "tasks.json"
    console = Console(file=io.StringIO(), width=200)
    argv = ["--task", "gsm8k", "--native", str(tmp_path / "native"), "--filter", "strict-match"]
    argv += ["--recipe", f"nvfp4={recipe_file}", "--bootstrap", "200", "--out", str(out)]
    report = run(argv, console=console)
    assert report["native"]["files"] == [str(next(native_dir.glob("samples_gsm8k_2026*")))]
    assert report["native"]["accuracy"]["mean"] == pytest.approx(0.8)
    r = report["recipes"]["nvfp4"]
    assert r["accuracy"]["mean"] == pytest.approx(0.7)
    assert r["delta"]["mean"] == pytest.approx(-0.1)
    assert r["delta"]["low"] <= -0.1 <= r["delta"]["high"]
    assert r["flips"] == {"lost": 2, "gained": 1, "pairs": 10, "flip_rate": 0.3}
    assert r["mcnemar"] == {"b": 2, "c": 1, "p_value": mcnemar_exact(2, 1)}
    assert r["mcnemar"]["p_value"] == pytest.approx(1.0)
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "gsm8k: 10 questions x 1 repeat(s)" in text and "2/1" in text


def test_tasks_repeats_and_the_console_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two repeats per engine: repeated --native and --recipe NAME=PATH
    runs = {"native": (NATIVE, NATIVE), "fp8": (NATIVE, RECIPE)}
    files = {
        name: [_samples(tmp_path / name / str(r), c) for r, c in enumerate(cs)]
        for name, cs in runs.items()
    }
    argv = ["tasks", "--filter", "strict-match", "--bootstrap", "50"]
    argv += [w for f in files["native"] for w in ("--native", str(f))]
    argv += [w for f in files["fp8"] for w in ("--recipe", f"fp8={f}")]
    assert main(argv) == 0
    assert "1 repeat" not in capsys.readouterr().out
    report = run(argv[1:], console=Console(file=io.StringIO()))
    r = report["recipes"]["fp8"]
    assert r["repeats"] == 2 and r["flips"]["lost"] == 2 and r["flips"]["pairs"] == 20
    # majority outcome: questions 6, 7 right in 1 of 2 repeats (not > half): only-native 2
    assert r["mcnemar"]["b"] == 2 and r["mcnemar"]["c"] == 0


def test_tasks_input_errors_name_the_argument(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    native = _samples(tmp_path / "native", NATIVE)
    short = _samples(tmp_path / "short", NATIVE[:5])
    cases = {
        "--native: .* is a directory; name the task with --task": [
            "--native", str(tmp_path / "native"), "--recipe", f"x={native}",
        ],
        "--recipe 'x': expected NAME=PATH": ["--native", str(native), "--recipe", "x"],
        "--recipe 'x=.*missing': no such file": [
            "--native", str(native), "--recipe", f"x={tmp_path / 'missing'}",
        ],
        r"--native: no samples_mmlu_DATE.jsonl under": [
            "--task", "mmlu", "--native", str(tmp_path / "native"), "--recipe", f"x={native}",
        ],
        r"--native: filter_name: .* has filters \['flexible-extract', 'strict-match'\]": [
            "--native", str(native), "--recipe", f"x={native}",
        ],
        r"--recipe x: recipe: other questions than native": [
            "--native", str(native), "--recipe", f"x={short}", "--filter", "strict-match",
        ],
    }  # fmt: skip
    for message, argv in cases.items():
        with pytest.raises(ValueError, match=message):
            run(argv, console=Console(file=io.StringIO()))
        assert main(["tasks", *argv]) == 2
        assert "mla-compare tasks: error: " in capsys.readouterr().err
    assert sample_files(native, None, "--native") == [native]
