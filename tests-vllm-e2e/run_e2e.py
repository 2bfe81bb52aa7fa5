"""End-to-end check of MLA_QUANT in a real vLLM 0.33 engine on CUDA GPUs.

The entry point of the ``mla_e2e`` package next to this file (its docstring
describes the configurations, checks, outputs and exit codes); ``nox -s vllm_e2e``
runs it. Usage: ``python tests-vllm-e2e/run_e2e.py [--out DIR] [--tol 0.05]
[--jobs 3] [--deadline 400] [--tp 1] [--only NAME ...]``, or ``--compare-tp A,B``.
Every configuration runs in a child process that starts this file again.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The package's folder first: this process, the children this file starts, and
# (through multiprocessing's spawn, which copies sys.path and runs this file) the
# engines' TP worker processes, which unpickle the probes by reference.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mla_e2e.cli import main

if __name__ == "__main__":
    main()
