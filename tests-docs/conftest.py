"""Markers of the documentation tests (pytest runs with --strict-markers)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: a code block that needs a CUDA GPU")
    config.addinivalue_line("markers", "vllm: a code block that needs vLLM 0.33 on a CUDA GPU")
