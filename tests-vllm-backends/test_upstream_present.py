"""Says why nothing runs when vLLM's own tests have not been placed in ``upstream/``."""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent / "upstream" / "tests"
SUITE = TESTS / "v1" / "attention" / "test_mla_backends.py"


def test_upstream_suite_present() -> None:
    """vLLM's MLA correctness suite is present (else skipped, saying where it goes)."""
    if not SUITE.is_file():
        pytest.skip(
            "vLLM's tests/ at v0.33.0 is not in tests-vllm-backends/upstream/ "
            "(tests-vllm-backends/README.md says how to place it)"
        )
    assert (SUITE.parent / "utils.py").is_file()
    assert (TESTS / "conftest.py").is_file()
