"""Cross-package tests run on the CPU through Triton's interpreter (or on a GPU)."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip everything unless a GPU or ``TRITON_INTERPRET=1`` can run the kernels."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="needs a GPU or TRITON_INTERPRET=1")
    for item in items:
        item.add_marker(skip)
