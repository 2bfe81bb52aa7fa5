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
