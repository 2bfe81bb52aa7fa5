"""Smoke test of one installed wheel: import it and make one real call.

Usage: ``python smoke.py <module> [--absent=a,b,...]``; run by ``nox -s build`` in a
venv holding that wheel alone (plus its declared dependencies), so it proves the
package stands on its own. ``--absent`` names modules that must not be installed
there (checked before the import): a package that needs one of them would declare it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def smoke_mla_formats() -> None:
    from mla_formats import qdq

    x = torch.linspace(-3.0, 3.0, 32)
    y = qdq(x, "nvfp4")
    assert y.shape == x.shape and torch.isfinite(y).all()


def smoke_mla_reference() -> None:
    import mla_reference

    q = torch.randn(4, 2, 32)
    k = torch.randn(4, 2, 32)
    v = torch.randn(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out = mla_reference.prefill(q, k, v, cu, cu, softmax_scale=0.2, quant=None)
    assert out.shape == (4, 2, 16) and torch.isfinite(out).all()


def smoke_mla_triton() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import mla_triton

    cache = torch.randn(2, 16, 576, dtype=torch.float16)
    q = torch.randn(1, 2, 576, dtype=torch.float16)
    block_table = torch.tensor([[0, 1]], dtype=torch.int32)
    seq_lens = torch.tensor([20], dtype=torch.int32)
    out, lse = mla_triton.decode(q, cache, block_table, seq_lens, softmax_scale=0.1)
    assert out.shape == (1, 2, 512) and torch.isfinite(out).all() and torch.isfinite(lse).all()


def smoke_mla_report() -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import mla_report

    tiny = mla_report.Case(2, 1, 20, 16, 1, 24, "float16")
    recipe = mla_report.parse_recipe("kv8=k:fp8,v:fp8")
    mla_report.check_recipe(recipe, torch.device("cpu"), tiny)
    none = mla_report.RECIPES[0]
    result = mla_report.run_report((none, recipe), torch.device("cpu"), case=tiny, progress=False)
    rows = {(r["recipe"], r["kind"]): r for r in result["rows"]}
    assert 0.0 < rows["kv8", "decode"]["rel_l2"] < 0.2, rows
    with tempfile.TemporaryDirectory() as out:
        mla_report.write_outputs(result, Path(out))
        assert (Path(out) / "report.png").read_bytes()[:4] == b"\x89PNG"
    script = Path(sys.executable).parent / "mla-report"
    usage = subprocess.run([str(script), "--recipe", "x=k:nvfp5"], capture_output=True, text=True)
    assert usage.returncode == 2 and "recipe 'x', role k: unknown format" in usage.stderr, usage


SMOKES = {
    "mla_formats": smoke_mla_formats,
    "mla_reference": smoke_mla_reference,
    "mla_triton": smoke_mla_triton,
    "mla_report": smoke_mla_report,
}


def check_absent(modules: list[str]) -> None:
    present = [m for m in modules if importlib.util.find_spec(m) is not None]
    assert not present, f"installed beside the wheel, but must not be needed: {present}"


if __name__ == "__main__":
    module = sys.argv[1]
    absent = [m for a in sys.argv[2:] if a.startswith("--absent=") for m in a[9:].split(",") if m]
    check_absent(absent)
    SMOKES[module]()
    also = f"; absent: {', '.join(absent)}" if absent else ""
    print(f"{module}: installed alone, imported and called{also}")
