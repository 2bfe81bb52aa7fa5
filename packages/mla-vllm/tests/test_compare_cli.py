"""mla-compare end to end on CPU with the engine process replaced (the only part that needs a GPU).

The stand-in engine computes each configuration's next-token distributions from
seeded logits (the native one exact, a recipe's perturbed by a recipe-sized amount),
so the report's numbers can be checked against a direct computation.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from mla_vllm.compare.cli import main, run
from mla_vllm.compare.metrics import TopK, summarize

VOCAB = 40
NOISE = {None: 0.0, "none": 0.0, "fp8": 0.05, "nvfp4": 0.4}


def _logits(prompt: list[int], recipe: str | None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(prompt) * 31 + len(prompt))
    base = 3.0 * torch.randn(len(prompt) - 1, VOCAB, generator=gen, dtype=torch.float64)
    noise = torch.randn(base.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return base + NOISE[recipe] * noise


def _forced(prompt: list[int], recipe: str | None, k: int) -> dict[str, list[Any]]:
    lp = torch.log_softmax(_logits(prompt, recipe), -1)
    values, ids = lp.topk(k, -1)
    target = lp.gather(-1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return {"ids": ids.tolist(), "logprobs": values.tolist(), "target": target.tolist()}


class FakeEngine:
    """Records each spec; answers like ``engine.run_spec`` from seeded logits."""

    def __init__(self, fail: str | None = None) -> None:
        self.specs: list[Mapping[str, Any]] = []
        self.fail = fail

    def __call__(self, spec: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
        self.specs.append(spec)
        if spec["name"] == self.fail:
            raise RuntimeError(f"{spec['name']}: engine process exited with 1")
        quant = spec["mla_quant"]
        recipe = None if quant is None else quant["recipe"]
        k = spec["top_k"]
        stats = {}
        if quant is not None:
            err = NOISE[recipe]
            stats = {
                f"model.layers.{i}.self_attn.attn": {
                    "prefill": {"rel_l2_mean": err * (i + 1), "rel_l2_max": err * (i + 2)},
                    "decode": {"rel_l2_mean": err / 2, "rel_l2_max": err},
                }
                for i in (1, 0)
            }
        greedy = [
            [p[-1], p[-1] + (1 if recipe == "nvfp4" and i == 0 else 0), 3]
            for i, p in enumerate(spec["prompts"])
        ]
        return {
            "name": spec["name"],
            "forced": [_forced(p, recipe, k) for p in spec["prompts"]],
            "greedy": greedy if spec["greedy_tokens"] else None,
            "stats": stats,
            "amax": {},
            "engine": {"backend": spec["backend"], "impl": ["X"], "start_s": 0.0},
        }


def _write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 32}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3, 4, 5, 6]\n[7, 8, 9, 10]\n")
    return model, prompts


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


def test_report_against_a_direct_computation(tmp_path: Path) -> None:
    model, prompts = _write_inputs(tmp_path)
    engine = FakeEngine()
    console = _quiet()
    out = tmp_path / "out"
    report = run(
        [
            str(model),
            "--prompts",
            str(prompts),
            "--recipe",
            "none",
            "--recipe",
            "fp8",
            "--recipe",
            "nvfp4",
            "--top-k",
            "5",
            "--greedy-tokens",
            "3",
            "--out",
            str(out),
            "--tensor-parallel-size",
            "2",
            "--jobs",
            "2",
        ],
        launcher=engine,
        console=console,
    )
    specs = {s["name"]: s for s in engine.specs}
    assert set(specs) == {"native", "none", "fp8", "nvfp4"}
    assert specs["native"]["backend"] == "TRITON_MLA" and specs["native"]["mla_quant"] is None
    assert specs["fp8"]["backend"] == "MLA_QUANT"
    assert specs["fp8"]["mla_quant"] == {
        "recipe": "fp8",
        "observe": {"enabled": True, "interval": 1},
    }
    assert all(
        s["tensor_parallel_size"] == 2 and s["prompts"] == specs["native"]["prompts"]
        for s in engine.specs
    )
    saved = json.loads((out / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ps = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]

    def topk(recipe: str | None) -> TopK:
        parts = [_forced(p, recipe, 5) for p in ps]
        return TopK.cat([TopK.from_lists(f["ids"], f["logprobs"], f["target"]) for f in parts])

    for name in ("none", "fp8", "nvfp4"):
        want = summarize(topk(None), topk(name), tie_margin=0.05)
        got = report["recipes"][name]
        for key, value in want.items():
            assert got[key] == pytest.approx(value, nan_ok=True), (name, key)
    r = report["recipes"]
    assert r["none"]["kl_max"] == 0.0 and r["none"]["top1_agreement"] == 1.0
    assert 0.0 < r["fp8"]["kl_mean"] < r["nvfp4"]["kl_mean"]
    assert r["nvfp4"]["greedy"] == {
        "tokens": 3.0,
        "agreed_mean": 2.0,
        "agreed_min": 1.0,
        "identical_fraction": 0.5,
    }
    assert list(r["nvfp4"]["layers"]) == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert r["nvfp4"]["attention_error"]["prefill_rel_l2_mean"] == pytest.approx(0.4 * 1.5)
    assert report["native"]["positions"] == 8 and report["prompt_tokens"] == 10
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "nvfp4" in text and "report.json" in text


def test_failed_recipe_is_reported_and_exit_code(tmp_path: Path) -> None:
    model, prompts = _write_inputs(tmp_path)
    args = [
        str(model),
        "--prompts",
        str(prompts),
        "--recipe",
        "fp8",
        "--recipe",
        "nvfp4",
        "--out",
        str(tmp_path / "o"),
    ]
    report = run(args, launcher=FakeEngine(fail="fp8"), console=_quiet())
    assert "engine process exited" in report["recipes"]["fp8"]["error"]
    assert "kl_mean" in report["recipes"]["nvfp4"]
    with pytest.raises(RuntimeError, match="the native engine failed"):
        # the first run's native results are in --out: --no-resume runs the engine again
        run([*args, "--no-resume"], launcher=FakeEngine(fail="native"), console=_quiet())


def test_bad_inputs_fail_before_any_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, prompts = _write_inputs(tmp_path)
    long = tmp_path / "long.json"
    long.write_text(json.dumps([list(range(40))]))
    engine = FakeEngine()
    cases = {
        "no such recipe file": ["--prompts", str(prompts), "--recipe", "missing.json"],
        "longer than max_model_len 32": ["--prompts", str(long), "--recipe", "fp8"],
        "has no tokenizer": ["--prompts", str(_text(tmp_path)), "--recipe", "fp8"],
        "--top-k: expected >= 2": ["--prompts", str(prompts), "--recipe", "fp8", "--top-k", "1"],
        "names the native run": ["--prompts", str(prompts), "--recipe", "native=fp8"],
    }
    for message, argv in cases.items():
        with pytest.raises(ValueError, match=message):
            run([str(model), *argv], launcher=engine, console=_quiet())
    assert engine.specs == []
    assert main([str(model), "--prompts", str(prompts), "--recipe", "nope"]) == 2
    assert "mla-compare: error: --recipe 'nope'" in capsys.readouterr().err


def _text(tmp_path: Path) -> Path:
    path = tmp_path / "text.txt"
    path.write_text("hello world\n")
    return path


def test_engine_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the entry point an engine runs in-process at TP=1 and is refused at TP > 1."""
    from mla_vllm.compare import launch

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(launch, "has_entry_point", lambda: False)
    env = launch.child_env({"name": "a", "tensor_parallel_size": 1})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    with pytest.raises(launch.EngineError, match=r"a: no 'vllm\.general_plugins' entry point"):
        launch.child_env({"name": "a", "tensor_parallel_size": 2})
    monkeypatch.setattr(launch, "has_entry_point", lambda: True)
    env = launch.child_env({"name": "a", "tensor_parallel_size": 2})
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_flashmla_native_backend(tmp_path: Path) -> None:
    """``--backend FLASHMLA`` serves the native run on FLASHMLA; the recipes stay MLA_QUANT."""
    model, prompts = _write_inputs(tmp_path)
    engine = FakeEngine()
    argv = [str(model), "--prompts", str(prompts), "--recipe", "none", "--recipe", "nvfp4"]
    report = run(
        [*argv, "--backend", "FLASHMLA", "--out", str(tmp_path / "o")],
        launcher=engine,
        console=_quiet(),
    )
    backends = {s["name"]: s["backend"] for s in engine.specs}
    assert backends == {"native": "FLASHMLA", "none": "MLA_QUANT", "nvfp4": "MLA_QUANT"}
    assert report["native"]["backend"] == "FLASHMLA"
    assert report["recipes"]["none"]["kl_max"] == 0.0
    with pytest.raises(SystemExit):  # argparse: not a native MLA backend of mla-compare
        run([*argv, "--backend", "FLASH_ATTN"], launcher=engine, console=_quiet())
    assert len(engine.specs) == 3


class _StopError(Exception):
    """Raised by the stand-in ``vllm.LLM`` once it has its arguments."""


def test_engine_reaches_llm_the_same_way_at_any_tp(monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine.run_spec`` (the engine process's code) up to ``vllm.LLM(...)``: FLASHMLA
    and MLA_QUANT, TP=1 and TP=2 give the same arguments but for the ones they name."""
    import vllm

    from mla_vllm.compare import engine

    seen: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        seen.append(kwargs)
        raise _StopError

    monkeypatch.setattr(vllm, "LLM", record)
    spec = {
        "name": "native",
        "model": "/m",
        "backend": "FLASHMLA",
        "mla_quant": None,
        "prompts": [[1, 2, 3]],
        "top_k": 5,
        "dtype": "bfloat16",
        "max_model_len": 64,
        "kv_cache_memory_bytes": 1 << 20,
    }
    quant = {"recipe": "nvfp4", "observe": {"enabled": True, "interval": 1}}
    for extra in (
        {},
        {"tensor_parallel_size": 2},
        {"backend": "MLA_QUANT", "mla_quant": quant},
        {"backend": "MLA_QUANT", "mla_quant": quant, "tensor_parallel_size": 2},
    ):
        with pytest.raises(_StopError):
            engine.run_spec({**spec, **extra})
    one, two, q1, q2 = seen
    assert one["attention_backend"] == "FLASHMLA" and one["additional_config"] == {}
    assert one["tensor_parallel_size"] == 1 and two["tensor_parallel_size"] == 2
    assert {k: v for k, v in two.items() if k != "tensor_parallel_size"} == {
        k: v for k, v in one.items() if k != "tensor_parallel_size"
    }
    assert q1["attention_backend"] == "MLA_QUANT" and q1["additional_config"] == {
        "mla_quant": quant
    }
    assert q2 == {**q1, "tensor_parallel_size": 2}
    assert one["model"] == "/m" and one["kv_cache_memory_bytes"] == 1 << 20
    assert one["max_logprobs"] == 20 and one["skip_tokenizer_init"] is True
