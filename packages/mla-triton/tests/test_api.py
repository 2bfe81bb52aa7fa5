"""The package's public surface: ``mla_triton.__all__``, no rollout switches left in any
module, every module importable on its own (no import cycle), and ``mla_triton.tuning.use``
forcing an implementation and its tiles (CPU, interpreter)."""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

import mla_triton
from mla_formats import AttentionQuant
from mla_triton import tuning
from mla_triton.common.intercept import intercept

PACKAGE = Path(mla_triton.__file__).parent
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the interpreter")


def _module_names() -> list[str]:
    """Every module of the package, by its source file."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _module_names()


def test_all_is_the_public_api() -> None:
    assert mla_triton.__all__ == [
        "ShadowLayout", "allocate_shadow", "decode", "decode_shadow", "decode_workspace_size",
        "prefill", "shadow_layout", "update_cache", "warmup",
    ]  # fmt: skip
    for name in mla_triton.__all__:
        assert getattr(mla_triton, name) is not None, name
    assert callable(mla_triton.warmup) and mla_triton.warmup.__module__ == "mla_triton.precompile"


def test_the_modules_are_found() -> None:
    """The scans below see the op packages and their implementations."""
    for name in ("mla_triton", "mla_triton.tuning", "mla_triton.precompile",
                 "mla_triton.common.splitk", "mla_triton.ops.decode.gluon_ws",
                 "mla_triton.ops.prefill.gluon", "mla_triton.ops.shadow"):  # fmt: skip
        assert name in MODULES, name


def test_no_module_has_a_switch() -> None:
    """No module-level UPPER_CASE name of any module is bound to a bool: the implementation
    choice is a function of the platform, the call and ``tuning.use``, never a flag."""
    switches = []
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if attr in vars(typing):  # TYPE_CHECKING, imported from typing
                continue
            if attr.isupper() and isinstance(value, bool):
                switches.append(f"{name}.{attr} = {value}")
    assert not switches, switches


# Imports torch, triton and mla_formats (none of mla_triton), then forks one child per
# module, which imports that module first and exits: each mla_triton module is the first
# of the package imported in its process, as in a fresh interpreter, without paying for
# torch's import once per module. A marker line on stderr opens each child's report.
_IMPORT_EACH = """
import os, sys, traceback
import torch, triton, mla_formats
assert not any(m.startswith("mla_triton") for m in sys.modules)
status = {}
for name in sys.argv[1:]:
    sys.stderr.write(f"@@ {name}\\n")
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            __import__(name)
            code = 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    status[name] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
print(status)
"""


def test_every_module_imports_on_its_own() -> None:
    """Each module imported first of the package in its own process (an import cycle
    fails for the module entered mid-cycle); ``-X importtime`` lists it as imported."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", _IMPORT_EACH, *MODULES],
        capture_output=True, text=True, check=False, env=os.environ | {"TRITON_INTERPRET": "1"},
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    status = ast.literal_eval(done.stdout.strip().splitlines()[-1])  # printed above
    reports = dict(part.split("\n", 1) for part in done.stderr.split("@@ ")[1:])
    failed = {name: reports.get(name, "")[-2000:] for name, code in status.items() if code}
    assert not failed, failed
    assert set(status) == set(MODULES)
    for name in MODULES:
        assert re.search(rf"\|\s+{re.escape(name)}$", reports[name], re.MULTILINE), name


# -- tuning.use -------------------------------------------------------------------------


def _decode_case(heads: int = 16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, heads, 512 + 64, generator=gen).half()
    cache = torch.randn(3, 16, 512 + 64, generator=gen).half()
    table = torch.tensor([[0, 1, 2], [2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    return q, cache, table, lens


def _launches(call: Any, run: bool = False) -> list[tuple[str, dict[str, Any]]]:
    """``(kernel name, keyword arguments)`` of every launch ``call()`` makes (run or not)."""
    seen: list[tuple[str, dict[str, Any]]] = []

    def record(original: Any, kernel: Any, args: Any, kwargs: dict[str, Any], grid: Any) -> Any:
        seen.append((kernel.fn.__name__, kwargs))
        if run:
            return original(kernel, *args, grid=grid, warmup=False, **kwargs)
        return None

    with intercept(record):
        call()
    return seen


@pytest.mark.parametrize("name", ["cuda", "Triton", "", "auto", "gluon-ws"])
def test_use_an_unknown_name_names_impl(name: str) -> None:
    with pytest.raises(ValueError, match=r"^impl: expected one of gluon, gluon_ws, triton"), \
            tuning.use(name):  # fmt: skip
        pass


def test_use_lists_the_implementations() -> None:
    assert tuning.IMPLS == {
        "decode": ("triton", "gluon", "gluon_ws"),
        "prefill": ("triton", "gluon"),
    }


@needs_interpreter
@pytest.mark.parametrize(
    "choice",
    ["gluon", "gluon_ws", tuning.GluonDecode(block_n=32, stages=2), tuning.GluonWsDecode()],
    ids=["gluon", "gluon_ws", "GluonDecode", "GluonWsDecode"],
)
def test_forced_gluon_decode_on_cpu_names_impl_before_any_launch(choice: Any) -> None:
    q, cache, table, lens = _decode_case()

    def call() -> None:
        with pytest.raises(ValueError, match=r"^impl: "), tuning.use(choice):
            mla_triton.decode(q, cache, table, lens, softmax_scale=0.1)

    assert _launches(call) == []


@needs_interpreter
@pytest.mark.parametrize("choice", ["gluon", tuning.GluonPrefill()], ids=["gluon", "GluonPrefill"])
def test_forced_gluon_prefill_on_cpu_names_impl_before_any_launch(choice: Any) -> None:
    q = torch.randn(20, 2, 64).half()
    v = torch.randn(20, 2, 64).half()
    cu = torch.tensor([0, 5, 20], dtype=torch.int32)

    def call() -> None:
        with pytest.raises(ValueError, match=r"^impl: the Gluon prefill cannot run"), \
                tuning.use(choice):  # fmt: skip
            mla_triton.prefill(q, q, v, cu, cu, softmax_scale=0.1)

    assert _launches(call) == []


@needs_interpreter
@pytest.mark.parametrize("block_n", [16, 32])
def test_use_a_triton_decode_config(block_n: int) -> None:
    """The forced config's tiles are those launched (``BLOCK_N``, ``BLOCK_H``, stages),
    not the default's (16 heads, fp8: 32 keys, 2 stages); the output is the default's up
    to the tiles' summation order; outside the block the default comes back."""
    q, cache, table, lens = _decode_case()
    fp8 = AttentionQuant.uniform("fp8")
    config = tuning.TritonDecode(block_h=16, block_n=block_n, num_warps=4, num_stages=1)
    outs: list[torch.Tensor] = []

    def call(forced: bool) -> Any:
        def run() -> None:
            if forced:
                with tuning.use(config):
                    outs.append(mla_triton.decode(q, cache, table, lens, softmax_scale=0.1,
                                                  quant=fp8, num_splits=2)[0])  # fmt: skip
            else:
                outs.append(mla_triton.decode(q, cache, table, lens, softmax_scale=0.1,
                                              quant=fp8, num_splits=2)[0])  # fmt: skip

        return run

    split = "decode_split_kernel"
    forced = [kw for name, kw in _launches(call(True), run=True) if name == split]
    default = [kw for name, kw in _launches(call(False), run=True) if name == split]
    assert len(forced) == 1 and len(default) == 1
    # SHAPE: (kv_lora_rank, rope, page, BLOCK_H, BLOCK_N, head groups, split alignment)
    assert forced[0]["SHAPE"][3:5] == (16, block_n) and forced[0]["num_stages"] == 1
    assert default[0]["SHAPE"][3:5] == (16, 32) and default[0]["num_stages"] == 2
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-3, rtol=2e-3)
