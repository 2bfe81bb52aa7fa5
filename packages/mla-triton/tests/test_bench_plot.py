"""``benchmarks/plot.py``: which commit's rows the charts and the docs' tables show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import plot  # noqa: E402


def _row(commit: str, date: str, gpu: str = "NVIDIA H100 80GB HBM3") -> dict[str, str]:
    return {"commit": commit, "date": date, "gpu": gpu}


def _head() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=BENCH, capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    return done.stdout.strip()


def test_a_commit_in_history_wins_over_a_later_measured_unknown_one() -> None:
    """Rows of a baseline tree timed after this tree's (a later date) do not replace
    them: git knows HEAD, not the made-up commit, so HEAD's rows are the newest."""
    head = _head()
    rows = [
        _row(head, "2026-01-01T00:00:00Z", gpu="NVIDIA H200"),
        _row("0000000", "2026-01-02T00:00:00Z"),
    ]
    assert plot.newest(rows, None, None) == (head, "NVIDIA H200")


def test_unknown_commits_go_by_date_and_choices_win() -> None:
    rows = [_row("0000000", "2026-01-01T00:00:00Z"), _row("1111111", "2026-01-02T00:00:00Z")]
    assert plot.newest(rows, None, None) == ("1111111", "NVIDIA H100 80GB HBM3")
    assert plot.newest(rows, "0000000", "NVIDIA H200") == ("0000000", "NVIDIA H200")
    assert plot.history_depth("0000000") == -1
    assert plot.history_depth(_head()) >= 1


def _csv(path: Path, op: str, gpu: str, recipe: str) -> None:
    from harness import COLUMNS

    base = dict.fromkeys(COLUMNS, "")
    rows = []
    for impl, time_us, ratio in (("auto", "100.0", "1.10"), ("flashmla", "110.0", "")):
        rows.append({**base, "date": "2026-01-01T00:00:00Z", "commit": "0000000", "gpu": gpu,
                     "op": op, "shape": "b8-h128-L32768-p64", "recipe": recipe, "impl": impl,
                     "mode": "graph", "time_us": time_us, "ratio": ratio})  # fmt: skip
    with path.open("w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for r in rows:
            f.write(",".join(r[c] for c in COLUMNS) + "\n")


def test_decode_tables_of_two_gpus_are_not_joined(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Decode on read measured on one GPU and the shadow on another print as two tables,
    each under its GPU, never as columns of one table."""
    _csv(tmp_path / "decode.csv", "decode", "NVIDIA H200", "none")
    _csv(tmp_path / "shadow.csv", "decode_shadow", "NVIDIA H100 80GB HBM3", "fp8-fp16")
    assert plot.main(["--results", str(tmp_path), "--serve", str(tmp_path / "none.csv"),
                      "--markdown"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    tables = [t for t in out.split("<!-- ")[1:] if t.startswith("NVIDIA")]
    assert len(tables) == 2
    assert tables[0].startswith("NVIDIA H200") and "| none |" in tables[0]
    assert "shadow" not in tables[0]
    assert tables[1].startswith("NVIDIA H100") and "fp8 shadow" in tables[1]


def _serve_csv(path: Path, rows: list[tuple[str, str, str, str, str, str, str]]) -> None:
    """Rows of (date, commit, shape, recipe, impl, time_us, ratio) in serve.csv's format."""
    from harness import COLUMNS

    with path.open("w") as f:
        f.write(",".join(COLUMNS) + "\n")
        for date, commit, shape, recipe, impl, time_us, ratio in rows:
            tok_s = f"{1e6 / float(time_us) * 64:.0f}" if time_us else ""
            r = {**dict.fromkeys(COLUMNS, ""), "date": date, "commit": commit,
                 "gpu": "NVIDIA H200", "op": "serve", "shape": shape, "recipe": recipe,
                 "impl": impl, "mode": "graph", "time_us": time_us, "tok_s": tok_s,
                 "ratio": ratio, "notes": "" if time_us else "engine failed: timeout"}  # fmt: skip
            f.write(",".join(r[c] for c in COLUMNS) + "\n")


def test_serving_rows_are_one_run_each_with_readable_labels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per shape the newest run only (rows sharing a date), never a configuration of an
    older run of the same commit; recipes and shapes in words; a failed engine says so."""
    k4, k32 = "b64-L4096-g256-l4", "b8-L32768-g256-l4"
    old, new, other = "2026-01-01T00:00:00Z", "2026-01-01T01:00:00Z", "2026-01-01T02:00:00Z"
    _serve_csv(tmp_path / "serve.csv", [
        (old, "0000000", k4, "none", "flashmla", "3000", "1.000"),
        (old, "0000000", k4, "fp8-fp16", "mla_quant", "3000", "1.000"),  # older run only
        (old, "0000000", k4, "nvfp4-packed", "mla_quant", "6000", "0.500"),
        (new, "0000000", k4, "none", "flashmla", "4000", "1.000"),
        (new, "0000000", k4, "nvfp4-fp16", "mla_quant", "3200", "1.250"),
        (new, "0000000", k4, "none", "mla_quant", "", ""),
        (other, "0000000", k32, "none", "flashmla", "2900", "1.000"),
        (other, "0000000", k32, "fp8", "mla_quant", "3000", "0.967"),
    ])  # fmt: skip
    assert plot.main(["--results", str(tmp_path), "--serve", str(tmp_path / "serve.csv"),
                      "--markdown"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert table[0] == (
        "| serving, decode tok/s | none | fp8 on read | fp8 shadow | nvfp4 shadow "
        "| nvfp4 shadow (packed) |"
    )
    assert table[2] == (
        "| 4096-token prompts + 256 generated, batch 64, 4 layers (FLASHMLA 16000 tok/s) "
        "| failed | - | - | 1.25x | - |"
    )
    assert table[3].startswith("| 32768-token prompts + 256 generated, batch 8, 4 layers (")
    assert table[3].endswith("| - | 0.97x | - | - | - |")
    assert f"{k4} NVIDIA H200 0000000 {new}" in out


def test_newest_rows_of_one_gpu_or_what_the_csv_holds(tmp_path: Path) -> None:
    _csv(tmp_path / "shadow.csv", "decode_shadow", "NVIDIA H100 80GB HBM3", "fp8-fp16")
    commit, gpu, rows = plot.newest_rows("shadow", results=tmp_path)
    assert (commit, gpu) == ("0000000", "NVIDIA H100 80GB HBM3")
    assert float(rows[("b8-h128-L32768-p64", "fp8-fp16")]["ratio"]) == 1.10
    anchor = plot.newest_rows("shadow", results=tmp_path, impl="flashmla")[2]
    assert ("b8-h128-L32768-p64", "fp8-fp16") in anchor
    with pytest.raises(LookupError, match=r"no decode_shadow rows on NVIDIA H200.*H100"):
        plot.newest_rows("shadow", "NVIDIA H200", results=tmp_path)
    with pytest.raises(ValueError, match="kernel op"):
        plot.newest_rows("serve", results=tmp_path)


def test_home_chart_stops_on_a_missing_row(tmp_path: Path) -> None:
    """docs/scripts/plot_home.py draws no made-up value: a row the CSVs lack stops it."""
    scripts = Path(__file__).parents[3] / "docs" / "scripts"
    if not (scripts / "plot_home.py").exists():
        pytest.skip("no docs/scripts beside this package")
    sys.path.insert(0, str(scripts))
    import plot_home

    _csv(tmp_path / "decode.csv", "decode", "NVIDIA H200", "none")
    with pytest.raises(SystemExit, match=r"shadow\.csv: no decode_shadow rows on NVIDIA H200"):
        plot_home.speeds(results=tmp_path)
    _csv(tmp_path / "shadow.csv", "decode_shadow", "NVIDIA H200", "fp8-fp16")
    _csv(tmp_path / "prefill.csv", "prefill", "NVIDIA H200", "none")
    with pytest.raises(SystemExit, match=r"decode\.csv has no ratio of impl auto for b128"):
        plot_home.speeds(results=tmp_path)
