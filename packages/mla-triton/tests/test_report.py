"""``mla-report``: recipe parsing, a tiny run through the interpreter, its outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mla_formats import AttentionQuant, OperandQuant
from mla_triton.report import RECIPES, Case, main, parse_recipe, run_report, write_outputs

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
        ("nonamebody", "expected name="),
        ("x=", "expected name="),
        ("x=w:fp8", "bad operand 'w:fp8'"),
        ("x=k:int4", "int4"),
        ("x=k:nvfp4@abc", "amax of k"),
        ("x=nm:2", "N:M needs two integers"),
    ],
)
def test_parse_recipe_rejects_bad_text(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_recipe(text)


def test_main_rejects_bad_recipe_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--recipe", "x=w:fp8", "--device", "cpu"])
    assert exit_info.value.code == 2
    assert "--recipe" in capsys.readouterr().err


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
    # N:M changes prefill only (SPEC 5), with windows short enough to bite at 40 tokens
    assert rows["nvfp4+2:4", "decode"]["rel_l2"] == rows["nvfp4", "decode"]["rel_l2"]
    assert rows["nvfp4+2:4", "prefill"]["rel_l2"] != rows["nvfp4", "prefill"]["rel_l2"]

    write_outputs(result, tmp_path)
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["rows"] == result["rows"]
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
