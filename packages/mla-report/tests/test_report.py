"""``mla-report``: recipe parsing, usage errors, a tiny run through the interpreter, outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_formats import AttentionQuant, OperandQuant
from mla_report import RECIPES, Case, check_recipe, main, parse_recipe, run_report, write_outputs

TINY = Case(
    heads=2,
    decode_batch=2,
    decode_len=21,
    page_size=16,
    prefill_batch=1,
    prefill_len=40,
    dtype="float16",
)


def test_parse_recipe_reads_formats_amax_and_nm() -> None:
    recipe = parse_recipe("mix=k:nvfp4@12.5,v:fp8,q:nvfp4@dynamic,nm:2:4")
    assert recipe.name == "mix"
    assert recipe.quant == AttentionQuant(
        k=OperandQuant("nvfp4", 12.5), v=OperandQuant("fp8"), q=OperandQuant("nvfp4", "dynamic")
    )
    assert recipe.sparsity is not None and (recipe.sparsity.n, recipe.sparsity.m) == (2, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nonamebody", "--recipe: expected name="),
        ("x=", "--recipe: expected name="),
        ("x=w:fp8", "recipe 'x': bad operand 'w:fp8'"),
        ("x=k:int4", "recipe 'x', role k: unknown format 'int4'"),
        ("x=k:nvfp5", "recipe 'x', role k: unknown format 'nvfp5'; expected one of"),
        ("x=k:fp8@-3", "recipe 'x', role k: amax must be positive and finite, got -3.0"),
        ("x=k:nvfp4@abc", "recipe 'x', role k: amax must be a number or 'dynamic', got 'abc'"),
        ("x=v:fp8@dynamic", "recipe 'x', role v: a dynamic amax is only defined"),
        ("x=nm:2", "recipe 'x', role nm: N:M needs two integers"),
        ("x=nm:5:4", "recipe 'x', role nm: n: expected 1 <= n < m = 4, got 5"),
        ("x=nm:2:6", "recipe 'x', role nm: m: expected a power of two"),
        ("x=k:fp8,v:fp8,k:nvfp4", "recipe 'x', role k: given twice"),
        ("x=nm:2:4,nm:1:4", "recipe 'x', role nm: given twice"),
    ],
)
def test_parse_recipe_rejects_bad_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_recipe(text)


@pytest.mark.parametrize("name", ["none", "fp8", "nvfp4", "nvfp4-kv", "nvfp4+2:4"])
def test_parse_recipe_refuses_builtin_names(name: str) -> None:
    message = f"recipe '{name}': the name of a built-in recipe"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        parse_recipe(f"{name}=k:fp8")


def test_parse_recipe_refuses_p_amax_below_one() -> None:
    """mla_formats refuses a static P amax below 1 (or the kernels do): named by role."""

    def parse_and_check(text: str) -> None:
        check_recipe(parse_recipe(text), torch.device("cpu"), TINY)

    with pytest.raises(ValueError, match=r"^recipe 'x', role p: .*0\.5") as info:
        parse_and_check("x=k:fp8,p:fp8@0.5")
    assert "at least 1" in str(info.value) or "below 1" in str(info.value)


def test_check_recipe_runs_the_prefill_kernels_nm_check() -> None:
    """The CPU prefill key tile is 32 keys: groups of 32 pass, of 64 are refused."""
    check_recipe(parse_recipe("x=k:nvfp4,nm:2:32"), torch.device("cpu"), TINY)
    recipe = parse_recipe("x=k:nvfp4,nm:2:64")  # NMSparsity itself accepts it
    with pytest.raises(ValueError, match=r"^recipe 'x', role nm: m = 64 must divide the key tile"):
        check_recipe(recipe, torch.device("cpu"), TINY)


@pytest.fixture
def interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """main() on a CPU restarts itself unless the interpreter is on: keep it on."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "x=w:fp8"], "argument --recipe: recipe 'x': bad operand 'w:fp8'"),
        (["--recipe", "x=k:nvfp5"], "argument --recipe: recipe 'x', role k: unknown format"),
        (["--recipe", "x=k:fp8@-3"], "argument --recipe: recipe 'x', role k: amax must be"),
        (["--recipe", "x=k:fp8,k:fp8"], "argument --recipe: recipe 'x', role k: given twice"),
        (["--recipe", "nvfp4=k:fp8"], "argument --recipe: recipe 'nvfp4': the name of a built-in"),
        (["--recipe", "x=p:fp8@0.5"], "--recipe: recipe 'x', role p: "),
        (["--recipe", "x=nm:2:64"], "--recipe: recipe 'x', role nm: m = 64 must divide the key"),
        (["--recipe", "a=k:fp8", "--recipe", "a=v:fp8"], "--recipe: names given twice: a"),
        (["--only", "nope"], "--only: unknown recipes ['nope']"),
        (["--device", "tpu"], "argument --device: expected cpu, cuda, cuda:N or gpu, got 'tpu'"),
    ],
)
def test_main_usage_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", "cpu", "--out", str(tmp_path), *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: mla-report")
    assert err[-1].startswith("mla-report: error: ") and message in err[-1]
    assert not (tmp_path / "report.json").exists()


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("device", ["cuda", "gpu", "cuda:0"])
def test_main_refuses_cuda_without_cuda(
    device: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--device", device])
    assert exit_info.value.code == 2
    assert f"argument --device: {device!r}: no CUDA device here" in capsys.readouterr().err


def test_command_usage_error_is_one_line_before_any_work(tmp_path: Path) -> None:
    """The installed command: exit code 2, usage and one error line, nothing written."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", "mla_report", "--recipe", "x=k:nvfp5", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert errors == [
        "mla-report: error: argument --recipe: recipe 'x', role k: unknown format 'nvfp5'; "
        "expected one of ['fp8', 'none', 'nvfp4']"
    ]
    assert run.stderr.startswith("usage: mla-report") and "Traceback" not in run.stderr
    assert run.stdout == "" and not any(tmp_path.iterdir())


def test_tiny_report_measures_errors_against_none(tmp_path: Path) -> None:
    recipes = tuple(r for r in RECIPES if r.name in ("none", "nvfp4", "nvfp4+2:4"))
    result = run_report(recipes, torch.device("cpu"), case=TINY, progress=False)
    rows = {(r["recipe"], r["kind"]): r for r in result["rows"]}
    names = ("none", "nvfp4", "nvfp4+2:4")
    assert set(rows) == {(n, k) for n in names for k in ("decode", "prefill")}
    assert rows["none", "decode"]["rel_l2"] == 0.0 and rows["none", "prefill"]["cosine"] == 1.0
    for key, row in rows.items():
        # every kernel result is the oracle's recipe, to fp16 output rounding
        assert row["oracle_rel_l2"] < 2e-3, key
        assert "ms" not in row  # no timing on a CPU
    for kind in ("decode", "prefill"):
        assert 0.01 < rows["nvfp4", kind]["rel_l2"] < 0.6
    # N:M changes prefill only (docs/numerics.md "N:M sparsity"), with windows short
    # enough to bite at 40 tokens
    assert rows["nvfp4+2:4", "decode"]["rel_l2"] == rows["nvfp4", "decode"]["rel_l2"]
    assert rows["nvfp4+2:4", "prefill"]["rel_l2"] != rows["nvfp4", "prefill"]["rel_l2"]

    write_outputs(result, tmp_path)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["rows"] == result["rows"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
