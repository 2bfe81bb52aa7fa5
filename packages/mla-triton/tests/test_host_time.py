"""``tools/host_time.py`` runs and reports each case's host time in its three modes (CPU).

The tool replaces Triton's driver and compiles for its measurement, so it runs in a child
process. Only that it runs and what it reports are checked, not the times.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[3]
SCRIPT = ROOT / "packages" / "mla-triton" / "tools" / "host_time.py"


def test_host_time_reports_every_case() -> None:
    src = [ROOT / "packages" / p / "src" for p in ("mla-formats", "mla-triton")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(map(str, src))}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--batch", "2", "--calls", "4"], env=env,
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line[:26].strip(): line[26:].split() for line in done.stdout.splitlines()[1:]}
    assert set(rows) == {
        "decode none h128", "decode fp8 h128", "decode nvfp4 h16", "shadow fp8 h128",
        "shadow nvfp4 h128 packed", "prefill none h128", "prefill fp8 h128", "prefill nvfp4 h128",
    }  # fmt: skip
    for name, times in rows.items():
        assert len(times) == 3, (name, times)
        assert all(float(t) > 0 for t in times)
