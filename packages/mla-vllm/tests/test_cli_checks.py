"""``mla-compare`` and ``calibrate``: self-explaining options, progress, and every path,
pattern and number checked before any engine starts (the engine is a recording stand-in)."""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

import mla_vllm
from mla_vllm.calibration import calibrate
from mla_vllm.compare import launch as launch_module
from mla_vllm.compare.cli import build_parser, main, run
from mla_vllm.compare.inputs import check_model, layer_names


class NoEngine:
    """A launcher that must not be reached."""

    def __init__(self) -> None:
        self.specs: list[Mapping[str, Any]] = []

    def __call__(self, spec: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
        self.specs.append(spec)
        raise AssertionError(f"engine {spec['name']} started")


def _model(tmp_path: Path, layers: int = 2) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_hidden_layers": layers,
        "max_position_embeddings": 32,
    }
    (model / "config.json").write_text(json.dumps(config))
    return model


def _prompts(tmp_path: Path, text: bool = False) -> Path:
    path = tmp_path / ("prompts.txt" if text else "prompts.jsonl")
    path.write_text("the cat sat\n" if text else "[1, 2, 3, 4]\n")
    return path


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


# --- help and version -------------------------------------------------------------------


def test_every_option_has_help_and_shows_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    options = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(options) >= 20
    for action in options:
        assert action.help, f"{action.option_strings or action.dest}: no help"
        if isinstance(action, argparse._VersionAction) or action.required:
            continue  # --version, MODEL and --prompts have no default
        if action.default is None or action.default is False or action.default == []:
            # the help says what happens by default in words
            assert "default" in action.help or "at least one" in action.help, action.dest
        else:
            assert f"(default: {action.default})" in text, action.dest
    for shown in ("(default: 20)", "(default: TRITON_MLA)", "(default: 0.85)", "(default: 1)"):
        assert shown in text
    assert "(default: None)" not in text


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(["--version"], launcher=NoEngine(), console=_quiet())
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"mla-compare (mla-vllm {mla_vllm.__version__})"


# --- MODEL --------------------------------------------------------------------------------


def test_mistyped_model_path_is_a_model_error_before_any_engine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text prompts would need the model's tokenizer: the error still names MODEL."""
    engine = NoEngine()
    missing = str(tmp_path / "modle")
    argv = [missing, "--prompts", str(_prompts(tmp_path, text=True)), "--recipe", "fp8"]
    with pytest.raises(ValueError, match=r"^MODEL: no such model directory") as info:
        run(argv, launcher=engine, console=_quiet())
    assert missing in str(info.value) and "prompts" not in str(info.value)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mla-compare: error: MODEL: no such model directory {missing!r}")
    assert engine.specs == []


def test_model_directory_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    for model, message in {
        "models/deepseek-tiny": r"^MODEL: no such model directory 'models/deepseek-tiny'",
        "./tiny": r"^MODEL: no such model directory './tiny'",
        "~/no/such/model": r"^MODEL: no such model directory '~/no/such/model'",
        "a/b/c": r"^MODEL: no such model directory 'a/b/c'",
        "models/empty": r"^MODEL: 'models/empty' is a directory without config\.json",
        "weights.bin": r"^MODEL: 'weights\.bin' is a file",
    }.items():
        with pytest.raises(ValueError, match=message):
            check_model(model)
    for hub_id in ("deepseek-ai/DeepSeek-V2-Lite", "gpt2"):
        check_model(hub_id)  # not local: vLLM downloads it
    check_model(str(_model(tmp_path)))


# --- recipes' layer patterns --------------------------------------------------------------


def test_layer_pattern_that_matches_nothing_fails_before_any_engine(tmp_path: Path) -> None:
    model = _model(tmp_path, layers=2)
    assert layer_names(str(model)) == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    recipe = {"recipe": "nvfp4", "layers": [{"pattern": "model.layers.7.*", "recipe": "none"}]}
    engine = NoEngine()
    argv = [str(model), "--prompts", str(_prompts(tmp_path)), "--recipe", json.dumps(recipe)]
    message = (
        r"^--recipe nvfp4: mla_quant\.layers\[0\]\.pattern: 'model\.layers\.7\.\*' matches "
        r"no MLA layer \(layers: model\.layers\.0\.self_attn\.attn, "
    )
    with pytest.raises(ValueError, match=message):
        run([*argv, "--out", str(tmp_path / "o")], launcher=engine, console=_quiet())
    assert engine.specs == [] and not (tmp_path / "o").exists()


def test_layer_patterns_are_not_guessed_for_unknown_architectures(tmp_path: Path) -> None:
    model = _model(tmp_path)
    (model / "config.json").write_text(json.dumps({"architectures": ["Other"]}))
    assert layer_names(str(model)) is None
    assert layer_names("deepseek-ai/DeepSeek-V2-Lite") is None


# --- numbers ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--timeout", "-1", "argument --timeout: expected a finite number > 0, got -1"),
        ("--timeout", "0", "argument --timeout: expected a finite number > 0, got 0"),
        ("--timeout", "nan", "argument --timeout: expected a finite number > 0, got nan"),
        ("--timeout", "soon", "argument --timeout: expected a number > 0, got 'soon'"),
        (
            "--kv-cache-memory-bytes",
            "-1024",
            "argument --kv-cache-memory-bytes: expected an integer >= 1, got -1024",
        ),
        (
            "--kv-cache-memory-bytes",
            "0",
            "argument --kv-cache-memory-bytes: expected an integer >= 1, got 0",
        ),
        ("--max-num-seqs", "0", "argument --max-num-seqs: expected an integer >= 1, got 0"),
        ("--max-model-len", "-5", "argument --max-model-len: expected an integer >= 1, got -5"),
    ],
)
def test_bad_numbers_fail_before_any_engine(
    option: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    engine = NoEngine()
    argv = [str(_model(tmp_path)), "--prompts", str(_prompts(tmp_path)), "--recipe", "fp8"]
    with pytest.raises(SystemExit) as info:
        run([*argv, f"{option}={value}"], launcher=engine, console=_quiet())
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"mla-compare: error: {message}"
    assert engine.specs == []


# --- --out ----------------------------------------------------------------------------------


def test_out_naming_a_file_fails_before_any_engine(tmp_path: Path) -> None:
    engine = NoEngine()
    argv = [str(_model(tmp_path)), "--prompts", str(_prompts(tmp_path)), "--recipe", "fp8"]
    (tmp_path / "taken").write_text("")
    with pytest.raises(ValueError, match=r"^--out: '.*taken' is a file; expected a directory"):
        run([*argv, "--out", str(tmp_path / "taken")], launcher=engine, console=_quiet())
    with pytest.raises(ValueError, match=r"^--out: cannot make '.*taken/o': '.*taken' is a file"):
        run([*argv, "--out", str(tmp_path / "taken" / "o")], launcher=engine, console=_quiet())
    assert engine.specs == []


# --- progress of an engine process ----------------------------------------------------------

CHILD = """
import json, sys, time
phase = "mla-compare phase: "
print(phase + "starting vLLM (MLA_QUANT, TP=1)", flush=True)
print("INFO 12-02 10:00:00 [loader.py:12] Loading weights took 1.25 seconds", flush=True)
time.sleep(1.5)
print(phase + "teacher-forcing 2 prompts", flush=True)
time.sleep(1.5)
json.dump({"name": "x", "ok": True}, open(sys.argv[2], "w"))
"""


def _child(script: str) -> Callable[[Path, Path], list[str]]:
    def command(spec_file: Path, out_file: Path) -> list[str]:
        return [sys.executable, "-c", script, str(spec_file), str(out_file)]

    return command


def test_launch_reports_each_phase_as_it_comes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launch_module, "_command", _child(CHILD))
    seen: list[str] = []
    result = launch_module.launch({"name": "x"}, tmp_path, on_phase=seen.append)
    assert result == {"name": "x", "ok": True}
    start = seen.index("starting vLLM (MLA_QUANT, TP=1): Loading weights took 1.25 seconds")
    assert seen.index("teacher-forcing 2 prompts") > start


def test_launch_timeout_kills_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch_module, "_command", _child("import time; time.sleep(60)"))
    t0 = time.monotonic()
    with pytest.raises(launch_module.EngineError, match=r"^x: engine process ran past --timeout"):
        launch_module.launch({"name": "x"}, tmp_path, timeout=1.0)
    assert time.monotonic() - t0 < 20


def test_engine_process_prints_its_phases(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import vllm

    from mla_vllm.compare import engine

    class StopError(Exception):
        pass

    def llm(**kwargs: Any) -> None:
        raise StopError

    monkeypatch.setattr(vllm, "LLM", llm)
    spec = {"name": "n", "model": "/m", "backend": "FLASHMLA", "prompts": [[1, 2]], "top_k": 5}
    with pytest.raises(StopError):
        engine.run_spec(spec)
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "mla-compare phase: starting vLLM (FLASHMLA, TP=1)",
        "mla-compare phase: starting the engine: loading /m",
    ]


# --- calibrate ------------------------------------------------------------------------------


class FakeLLM:
    """Answers ``apply_model`` for the calibration's two functions and records calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.use_tqdm: object = None

    def apply_model(self, func: Callable[..., Any]) -> list[Any]:
        self.calls.append(func.__name__)
        if func.__name__ == "start_calibration":
            return [["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]]
        amax = {"prefill": {"q": 1.0, "k": 2.0, "v": 3.0}, "decode": {"q": 1.0}}
        return [{"model.layers.0.self_attn.attn": amax, "model.layers.1.self_attn.attn": amax}]

    def generate(self, inputs: list[Any], params: Any, use_tqdm: object = True) -> list[Any]:
        self.calls.append("generate")
        self.use_tqdm = use_tqdm
        return []


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("missing/calibration.json", r"^output: the directory '.*missing' does not exist"),
        ("file/calibration.json", r"^output: the directory '.*file' is not a directory"),
        (".", r"^output: '.*' is a directory; expected a file path"),
    ],
)
def test_calibrate_output_is_checked_before_the_engine_runs(
    output: str, message: str, tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("")
    llm = FakeLLM()
    with pytest.raises(ValueError, match=message):
        calibrate(llm, [[1, 2, 3]], output=tmp_path / output)
    assert llm.calls == []


def test_calibrate_shows_progress(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llm = FakeLLM()
    out = tmp_path / "calibration.json"
    document = calibrate(llm, [[1, 2, 3], [4, 5]], output=out, max_tokens=4)
    assert llm.calls == ["start_calibration", "generate", "finish_calibration"]
    assert llm.use_tqdm is True  # vLLM's progress bar over the prompts
    assert json.loads(out.read_text()) == document
    lines = capsys.readouterr().err.splitlines()
    steps = [line.split("] ", 1)[1] for line in lines]
    assert all(line.startswith("mla_vllm.calibrate [") for line in lines)
    assert steps == [
        "recording amax on 2 MLA layers",
        "generating 2 prompts, 4 new tokens each",
        "collected the amax of 2 layers from 1 worker(s)",
        f"wrote {out}",
    ]
    seconds = [float(line.split("[", 1)[1].split(" s]")[0]) for line in lines]
    assert seconds == sorted(seconds) and all(math.isfinite(s) for s in seconds)


def test_calibrate_progress_off(capsys: pytest.CaptureFixture[str]) -> None:
    llm = FakeLLM()
    calibrate(llm, [[1, 2, 3]], progress=False)
    assert llm.use_tqdm is False and capsys.readouterr().err == ""
