"""``MLA_REQUIRE_GPU=1`` (conftest.py): a GPU test that skips fails instead.

Runs pytest in a subprocess on a copy of this folder's conftest.py and a small test
file that skips like the GPU suites do, on any machine (the skip is forced).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = """
import pytest

pytestmark = pytest.mark.skipif(True, reason="needs a CUDA GPU (compiled kernels, bf16)")


def test_kernel_on_gpu():
    assert 1 + 1 == 2
"""

BODY = """
import pytest


def test_skips_in_its_body():
    pytest.skip("no CUDA device")
"""

OTHER = """
import pytest


@pytest.mark.skip(reason="slow; run by hand")
def test_not_about_gpus():
    pass


@pytest.mark.xfail(reason="a known GPU bug", strict=True)
def test_expected_failure():
    assert False


def test_cpu():
    assert True
"""


def run_pytest(folder: Path, require: str | None) -> subprocess.CompletedProcess[str]:
    shutil.copy(Path(__file__).with_name("conftest.py"), folder / "conftest.py")
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "test_fake_gpu.py").write_text(SUITE)
    (folder / "test_fake_cpu.py").write_text(OTHER)
    env = {k: v for k, v in os.environ.items() if k != "MLA_REQUIRE_GPU"}
    if require is not None:
        env["MLA_REQUIRE_GPU"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", str(folder)],
        capture_output=True,
        text=True,
        cwd=folder,
        env=env,
        check=False,
        timeout=120,
    )


@pytest.mark.parametrize("require", [None, "0"])
def test_gpu_skip_is_a_skip_by_default(tmp_path: Path, require: str | None) -> None:
    run = run_pytest(tmp_path, require)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed, 2 skipped, 1 xfailed" in run.stdout


def test_gpu_skip_fails_with_mla_require_gpu(tmp_path: Path) -> None:
    run = run_pytest(tmp_path, "1")
    assert run.returncode == 1, run.stdout + run.stderr
    # skipif marks act at setup, so pytest reports the failure there: an error
    assert "1 passed, 1 skipped, 1 xfailed, 1 error" in run.stdout
    assert "ERROR test_fake_gpu.py::test_kernel_on_gpu" in run.stdout
    assert (
        "MLA_REQUIRE_GPU=1 and this GPU test was skipped: needs a CUDA GPU (compiled kernels, bf16)"
        in run.stdout
    )
    # a skip whose reason names no GPU, outside a *_gpu.py file, stays a skip
    assert "SKIPPED [1] test_fake_cpu.py" in run.stdout


def test_skip_in_a_test_body_fails_with_mla_require_gpu(tmp_path: Path) -> None:
    (tmp_path / "test_body_gpu.py").write_text(BODY)
    run = run_pytest(tmp_path, "1")
    assert "FAILED test_body_gpu.py::test_skips_in_its_body" in run.stdout
    assert "MLA_REQUIRE_GPU=1 and this GPU test was skipped: no CUDA device" in run.stdout
