"""pytest hooks of mla-triton's tests: ``MLA_REQUIRE_GPU=1`` turns GPU skips into failures.

The GPU suites (``test_*_gpu.py``) skip without a CUDA GPU, which is right on a CPU
machine and wrong on the GPU machine that is meant to run them (``nox -s gpu``
sets ``MLA_REQUIRE_GPU=1``): there a skip would read as a pass. With the variable
set to ``1``, a skipped test fails when it belongs to a ``*_gpu.py`` file or its
skip reason names a GPU or CUDA; the failure carries the skip reason (a skip by a
``skipif`` mark happens at setup, so pytest counts it as an error). Expected
failures (xfail) are left alone.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator

import pytest

_GPU_REASON = re.compile(r"\b(gpu|cuda)\b", re.IGNORECASE)


def _gpu_skip(item: pytest.Item, report: pytest.TestReport) -> str | None:
    """The skip reason when ``report`` is a skip of a GPU test, else None."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    if item.path.name.endswith("_gpu.py") or _GPU_REASON.search(reason):
        return reason
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if os.environ.get("MLA_REQUIRE_GPU") == "1":
        reason = _gpu_skip(item, report)
        if reason is not None:
            report.outcome = "failed"
            report.longrepr = f"MLA_REQUIRE_GPU=1 and this GPU test was skipped: {reason}"
    return report


# The slowest tests on a 2-core CPU machine (seconds, `pytest --durations`, 2026-12-02; the
# Gluon compiles run in child processes): started first, so that pytest-xdist's workers do
# not end with one of them running alone while the other worker idles.
SLOW_FIRST = (
    "test_gluon_decode_ws.py::test_compile_test_in_child",  # 110
    "test_gluon_prefill.py::test_every_variant_compiles_for_sm90a",  # 90
    "test_gluon_decode.py::test_compile_tests_in_child",  # 45
    "test_api.py::test_every_module_imports_on_its_own",  # 35
    "test_shadow.py::test_tail_tile_lengths",  # 14-45
    "test_shadow.py::test_tail_tile_wide_head_group",  # 14
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run ``SLOW_FIRST`` ahead of the rest (their order otherwise kept)."""

    def rank(item: pytest.Item) -> int:
        name = f"{item.path.name}::{item.originalname}" if hasattr(item, "originalname") else ""
        return next((i for i, slow in enumerate(SLOW_FIRST) if name == slow), len(SLOW_FIRST))

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _fresh_replay_plans() -> None:
    """Every test starts without decode plans (``common.replay``): a test that patches
    the platform must not replay a plan another test recorded."""
    from mla_triton.common.replay import REPLAY

    REPLAY.clear()


@pytest.fixture
def as_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dispatch CPU tensors as on an H200 (decode's facts, prefill's capability), for tests
    that look at launches without running them."""
    from dataclasses import replace

    from mla_triton.common import device as dev
    from mla_triton.ops.decode import gluon as gd

    real = gd.gluon_facts

    def facts(*args: object) -> gd.GluonFacts:
        return replace(real(*args), device_type="cuda", capability=(9, 0), interpreting=False,
                       api_missing=None)  # fmt: skip

    monkeypatch.setattr(gd, "gluon_facts", facts)
    monkeypatch.setattr(dev, "capability", lambda device: (9, 0))
    monkeypatch.setattr(dev, "interpreted_bf16", lambda dtype: False)
