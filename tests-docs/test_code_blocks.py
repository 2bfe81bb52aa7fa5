"""Every code block of the documentation and the READMEs runs (see ``blocks.py``).

Python blocks run each in a fresh interpreter (Triton reads ``TRITON_INTERPRET`` at
import), on the CPU through Triton's interpreter unless marked ``gpu`` or ``vllm``,
with the repository root as working directory's parent: a block sees an empty
temporary folder as its working directory. Bash blocks run only when marked ``run``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from blocks import ROOT, Block, all_blocks

TIMEOUT_S = 900


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _programs() -> list[tuple[Block, str]]:
    """(block, program) for every block that runs; ``continue`` blocks join the previous."""
    programs: list[tuple[Block, str]] = []
    previous: dict[Path, str] = {}
    for block in all_blocks():
        if block.lang == "python":
            source = block.source
            if "continue" in block.markers:
                if block.path not in previous:
                    raise ValueError(f"{block.id}: 'continue' without an earlier python block")
                source = previous[block.path] + source
            previous[block.path] = source
            if "norun" not in block.markers:
                programs.append((block, source))
        elif block.lang in ("bash", "sh", "console") and "run" in block.markers:
            programs.append((block, block.source))
    return programs


def _param(block: Block, program: str) -> object:
    marks = []
    if "vllm" in block.markers:
        marks.append(pytest.mark.vllm)
    elif "gpu" in block.markers:
        marks.append(pytest.mark.gpu)
    return pytest.param(block, program, id=block.id, marks=marks)


PROGRAMS = _programs()


def test_blocks_were_found() -> None:
    assert len(PROGRAMS) >= 10, "the extraction found almost no runnable block"


@pytest.mark.parametrize(("block", "program"), [_param(b, p) for b, p in PROGRAMS])
def test_code_block(block: Block, program: str, tmp_path: Path) -> None:
    env = dict(os.environ)
    # the interpreter's scripts (mla-report, ...) first, as in an activated environment
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if "vllm" in block.markers:
        if os.environ.get("MLA_DOCS_VLLM") != "1" or not _cuda():
            pytest.skip("needs vLLM 0.33 on a CUDA GPU and model weights (MLA_DOCS_VLLM=1)")
        env.pop("TRITON_INTERPRET", None)
    elif "gpu" in block.markers:
        if not _cuda():
            pytest.skip("needs a CUDA GPU (run with -m gpu on one)")
        env.pop("TRITON_INTERPRET", None)
    else:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(program)
        command = [sys.executable, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", program]
        env["MLA_REPO"] = str(ROOT)
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    if result.returncode != 0:
        pytest.fail(
            f"{block.id} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
            f"\n--- stderr\n{result.stderr[-6000:]}",
            pytrace=False,
        )
