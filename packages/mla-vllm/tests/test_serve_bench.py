"""``benchmarks/serve.py`` on CPU: arguments, engine configurations and CSV rows.

The rows are built from made-up engine results (a test of the row arithmetic, not a
measurement); without a GPU the benchmark exits 2 with a message and starts nothing.
"""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve.py"


@pytest.fixture(scope="module")
def serve() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench"] = module
    spec.loader.exec_module(module)
    return module


def test_configurations(serve: ModuleType) -> None:
    """FLASHMLA (the anchor) first, one engine per MLA_QUANT recipe and mode, the shadow
    storage in ``mla_quant``."""
    args = serve.parse_args(["--recipes", "none,fp8,nvfp4-packed", "--modes", "graph,eager",
                             "--shapes", "b64-L4096"])  # fmt: skip
    names = [c.name for c in args.configs]
    assert names == [
        "flashmla-none-eager", "mla_quant-none-eager", "mla_quant-fp8-eager",
        "mla_quant-nvfp4-packed-eager", "flashmla-none-graph", "mla_quant-none-graph",
        "mla_quant-fp8-graph", "mla_quant-nvfp4-packed-graph",
    ]  # fmt: skip
    quant = {c.name: c.mla_quant for c in args.configs}
    assert quant["flashmla-none-graph"] is None
    assert quant["mla_quant-none-graph"] == {}
    assert quant["mla_quant-fp8-graph"] == {"recipe": "fp8"}
    assert quant["mla_quant-nvfp4-packed-graph"] == {
        "recipe": "nvfp4", "kv_path": "shadow", "shadow_storage": "packed",
    }  # fmt: skip
    assert args.shape_list == [(64, 4096)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipes", "nvfp5"], "unknown ['nvfp5']"),
        (["--recipes", "none-fp16"], "recipe none stores no shadow"),
        (["--impl", "flashinfer"], "unknown ['flashinfer']"),
        (["--modes", "cold"], "unknown ['cold']"),
        (["--shapes", "64x4096"], "--shapes: expected b<requests>-L<prompt tokens>"),
        (["--gen", "1"], "--gen: expected at least 2"),
    ],
)
def test_bad_arguments(
    serve: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_rows_time_the_decode_steps_against_the_anchor(serve: ModuleType) -> None:
    """A step is (warm batch - its prefill) / (gen - 1); the ratio is FLASHMLA's step time
    over the engine's, same mode; a failed engine gives an empty time and its status."""
    args = serve.parse_args(["--recipes", "fp8,nvfp4", "--gen", "101"])
    flash, fp8, nvfp4 = args.configs
    ok = {"status": "ok", "gpu": "GPU", "engine_start_s": 60.0, "cold_s": 9.0, "prefill_s": 1.0}
    results = [(flash, ok | {"warm_s": 3.0}), (fp8, ok | {"warm_s": 5.0}),
               (nvfp4, {"status": "timeout"})]  # fmt: skip
    env = dict.fromkeys(serve.COLUMNS, "") | {"gpu": "GPU"}
    rows = serve.rows_of(env, "b64-L4096-g101-l4", 64, 4096, 101, results)
    by_recipe = {(r["impl"], r["recipe"]): r for r in rows}
    assert float(by_recipe["flashmla", "none"]["time_us"]) == pytest.approx(2.0 / 100 * 1e6)
    assert float(by_recipe["mla_quant", "fp8"]["time_us"]) == pytest.approx(4.0 / 100 * 1e6)
    assert float(by_recipe["mla_quant", "fp8"]["ratio"]) == pytest.approx(0.5)
    assert float(by_recipe["mla_quant", "fp8"]["tok_s"]) == pytest.approx(64 * 100 / 4.0, rel=1e-3)
    failed = by_recipe["mla_quant", "nvfp4"]
    assert failed["time_us"] == "" and failed["ratio"] == "" and "timeout" in failed["notes"]
    assert all(tuple(r) == serve.COLUMNS for r in rows)


def test_smoke_writes_rows_in_the_csv_columns(serve: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "serve.csv"
    assert serve.main(["--smoke", "--shapes", "b2-L64", "--recipes", "fp8", "--out", str(out)]) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["impl"], r["recipe"]) for r in rows] == [("flashmla", "none"), ("mla_quant", "fp8")]
    assert tuple(rows[0]) == serve.COLUMNS


def test_without_a_gpu_it_exits_2(
    serve: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.csv"
    assert serve.main(["--shapes", "b2-L64", "--recipes", "fp8", "--out", str(out)]) == 2
    assert "serve.py: needs a CUDA GPU" in capsys.readouterr().err
    assert not out.exists()
