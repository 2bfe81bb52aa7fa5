"""Says why nothing runs when vLLM's own tests have not been placed in ``upstream/``."""

from __future__ import annotations

from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent / "upstream" / "tests" / "v1" / "attention" / "mla"


def test_upstream_suite_present() -> None:
    """vLLM's MLA correctness suite is present (else skipped, saying where it goes)."""
    if not (SUITE / "correctness").is_dir():
        pytest.skip(
            "vLLM's tests/ at v0.33.0 is not in tests-vllm-backends/upstream/ "
            "(tests-vllm-backends/README.md says how to place it)"
        )
    assert (SUITE.parent / "_mla_backends.py").is_file()
