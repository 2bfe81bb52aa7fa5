"""``benchmarks/plot.py``: which commit's rows the charts and the docs' tables show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
