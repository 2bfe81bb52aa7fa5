"""``benchmarks/serve.py`` on CPU: arguments, configurations, log scan, JSON and plot.

The plot and JSON are written from a made-up result list (a test of the writing
code, not a result); without a GPU the benchmark exits 2 with a message.
"""

from __future__ import annotations

import importlib.util
import json
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
    configs = "FLASHMLA:fresh,quant-nvfp4kv-shadow,quant-fp8:nowarm:fresh"
    args = serve.parse_args(["--configs", configs, "--capture-sizes", "1,2,64"])
    flash, kv, fp8 = args.config_list
    assert (flash.backend, flash.mla_quant, flash.warmup, flash.fresh_cache) == (
        "FLASHMLA", None, True, True,
    )  # fmt: skip
    assert kv.mla_quant == {"k": "nvfp4", "v": "nvfp4", "kv_path": "shadow"}
    assert not kv.fresh_cache
    assert (fp8.mla_quant, fp8.warmup, fp8.fresh_cache) == ({"recipe": "fp8"}, False, True)
    assert args.capture_list == [1, 2, 64]
    assert args.tag == "L4-b64-p4096-g256"
    assert serve.parse_config("quant-none").mla_quant == {}
    args = serve.parse_args(["--configs", "quant-fp8:nowarm:fresh,quant-fp8:restart:nowarm"])
    fresh, restart = args.config_list
    assert restart.restart and not restart.fresh_cache and not restart.warmup
    assert fresh.cache_key == restart.cache_key == "quant-fp8:nowarm"
    args = serve.parse_args(["--configs", "quant-nvfp4,quant-nvfp4:noearly"])
    early, late = args.config_list
    assert early.early and not late.early and late.warmup
    assert serve._env(early, args)["MLA_QUANT_WARMUP_EARLY"] == "1"
    assert serve._env(late, args)["MLA_QUANT_WARMUP_EARLY"] == "0"


def test_restart_reuses_its_fresh_cache(serve: ModuleType, tmp_path: Path) -> None:
    """``:restart`` gets the directory its ``:fresh`` run was given; another
    configuration's ``:fresh`` gets a new one."""
    args = serve.parse_args(["--configs", "FLASHMLA:fresh,quant-fp8:fresh,FLASHMLA:restart"])
    flash, fp8, again = args.config_list
    first = serve._env(flash, args)["TRITON_CACHE_DIR"]
    other = serve._env(fp8, args)["TRITON_CACHE_DIR"]
    assert serve._env(again, args)["TRITON_CACHE_DIR"] == first != other
    assert Path(first).is_dir() and not any(Path(first).iterdir())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "quant-nvfp5"], "unknown configuration 'quant-nvfp5'"),
        (["--configs", "quant-none-shadow"], "recipe none stores no shadow"),
        (["--configs", "TRITON_MLA:nowarm"], "only apply to quant-*"),
        (["--configs", "FLASHMLA:noearly"], "only apply to quant-*"),
        (["--configs", "quant-fp8:cold"], "unknown modifier(s) ['cold']"),
        (["--configs", "quant-fp8:fresh:restart"], ":fresh and :restart exclude each other"),
        (["--configs", "quant-fp8:restart,quant-fp8:fresh"], ":restart needs quant-fp8:fresh"),
        (["--capture-sizes", "1,x"], "--capture-sizes: expected comma-separated ints"),
        (["--gen", "1"], "--gen: expected at least 2"),
        (["--batch", "0"], "--batch: expected a positive int"),
        (["--block-size", "0"], "--block-size: expected a positive int"),
    ],
)
def test_bad_arguments(
    serve: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_model_is_deepseek_v3_attention(serve: ModuleType) -> None:
    config = serve.model_config(6, 33000)
    assert config["num_hidden_layers"] == config["first_k_dense_replace"] == 6
    assert (config["hidden_size"], config["num_attention_heads"], config["q_lora_rank"]) == (
        7168, 128, 1536,
    )  # fmt: skip
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"], config["v_head_dim"]) == (
        512,
        64,
        128,
    )
    assert config["intermediate_size"] == 18432 and config["max_position_embeddings"] == 33000


def test_log_scan(serve: ModuleType) -> None:
    log = (
        "(MainProcess pid=3888) INFO 12-02 01:32:44 [startup.py:96] non-default args: {}\n"
        "(MainProcess pid=3888) INFO 12-02 01:33:14 [model.py:744] Resolved architecture: "
        "DeepseekV2ForCausalLM\n"
        "INFO 12-02 01:33:51 [kv_cache_utils.py:1147] GPU KV cache size: 25,751,424 tokens, "
        "Maximum concurrency for 4,352 tokens per request: 5917.15x\n"
        "ERROR 12-02 [warmup.py:360] MLA_QUANT early warmup failed; the first metadata build "
        "warms up\n"
        "INFO 12-01 14:23:35 [jit_monitor.py:84] Kernel JIT monitor activated; monitored JIT "
        "compilations during inference will use mode=warn.\n"
        "INFO 12-01 mla_vllm.warmup: MLA_QUANT warmup: 3 plans (decode, prefill, update) over 4 "
        "layers: 61 kernel variants in 12.3 s\n"
        "WARNING 12-01 [jit_monitor.py:131] Triton kernel JIT compilation during inference: "
        "prefill_fwd_kernel. This causes a latency spike; consider extending warmup to cover "
        "this shape/config.\n"
        "WARNING Triton kernel JIT compilation during inference: decode_split_kernel (x=1). \n"
        "INFO 12-01 16:59:52 [model_runner.py:1163] Graph capturing finished in 14 secs, took "
        "0.08 GiB\nINFO [model_runner.py:1163] Graph capturing finished in 2 secs, took 0.08 GiB\n"
        "INFO 12-01 17:00:09 [core.py:405] init engine (profile, create kv cache, warmup model) "
        "took 65.52 s (compilation: 22.46 s)\n"
    )
    found = serve.scan_log(log)
    assert found["jit_warnings"] == 2
    assert found["jit_kernels"] == ["prefill_fwd_kernel", "decode_split_kernel"]
    assert found["mla_warmup"] == [
        "MLA_QUANT early warmup failed; the first metadata build warms up",
        "MLA_QUANT warmup: 3 plans (decode, prefill, update) over 4 layers: 61 kernel variants "
        "in 12.3 s",
    ]
    assert (found["init_engine_s"], found["compile_s"], found["capture_s"]) == (
        65.52,
        22.46,
        [14, 2],
    )
    assert (found["inspect_s"], found["kv_cache_tokens"]) == (30, 25751424)
    assert serve.scan_log("no warnings")["jit_warnings"] == 0
    over_midnight = (
        "INFO 12-02 23:59:50 [startup.py:96] non-default args: {}\n"
        "INFO 12-03 00:00:05 [model.py:744] Resolved architecture: X\n"
    )
    assert serve.scan_log(over_midnight)["inspect_s"] == 15


def test_results_json_and_plot(serve: ModuleType, tmp_path: Path) -> None:
    args = serve.parse_args(["--out", str(tmp_path), "--tag", "fake"])
    fake = [
        {"name": "FLASHMLA", "status": "ok", "engine_start_s": 46.0, "cold_s": 3.1, "warm_s": 3.4,
         "first_batch_s": 49.1, "prefill_tok_s": 150000.0, "decode_tok_s": 10000.0},
        {"name": "quant-nvfp4", "status": "ok", "engine_start_s": 60.0, "cold_s": 4.0,
         "warm_s": 3.8, "first_batch_s": 64.0, "cold_over_warm": 1.05, "decode_tok_s": 9300.0,
         "jit_warnings": 0},
        {"name": "quant-nvfp4-shadow", "status": "timeout after 200 s", "engine_start_s": 85.0},
        {"name": "FLASHMLA:fresh", "status": "ok", "first_batch_s": 50.0, "capture_s": [2, 1]},
        {"name": "quant-fp8:fresh", "status": "ok", "first_batch_s": 70.0, "init_engine_s": 58.7},
    ]  # fmt: skip
    path = serve.write_results(fake, args, {"command": "test"})
    doc = json.loads(path.read_text())
    assert [r["name"] for r in doc["results"]] == [r["name"] for r in fake]
    lines = doc["summary"].splitlines()
    assert "first/FM" in lines[0] and "capture" in lines[0]
    assert "0.93x" in lines[2] and "1.00x" in lines[1]
    assert "1.30x" in lines[2]  # first batch 64.0 / 49.1, against the FLASHMLA of its state
    assert "[timeout after 200 s]" in lines[3]
    assert "2+1" in lines[4] and "1.40x" in lines[5] and "58.7" in lines[5]  # 70 / 50: fresh
    png = path.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_without_a_gpu_it_exits_2(
    serve: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert serve.main(["--out", str(tmp_path)]) == 2
    assert "serve_bench: FAIL: needs a CUDA GPU" in capsys.readouterr().out
