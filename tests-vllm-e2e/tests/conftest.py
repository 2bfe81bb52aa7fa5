"""The e2e package (``tests-vllm-e2e/mla_e2e``) on sys.path, as ``run_e2e.py`` puts it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
