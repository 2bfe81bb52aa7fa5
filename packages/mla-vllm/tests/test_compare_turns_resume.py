"""``mla-compare``'s engine settings, multi-turn generation, calibration beside the
uncalibrated recipe, and resume, on CPU: the engine process's real code
(``engine.run_spec``) with ``vllm.LLM`` replaced by the stand-in of
``test_compare_generate_cli`` (vLLM's own ``RequestOutput`` objects)."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from rich.console import Console
from test_compare_generate_cli import PROMPTS, FakeLLM, _flat, _logprobs

from mla_vllm.compare.cli import result_key, run
from mla_vllm.compare.engine import follow_up_contexts
from mla_vllm.compare.generation import Generated, summarize_generation
from mla_vllm.compare.metrics import TopK
from mla_vllm.config import CALIBRATION_FORMAT

K = 5
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


class RecordingLLM(FakeLLM):
    """The stand-in, keeping each engine's arguments; a calibrated recipe answers with
    fp8's error (the calibration recovers part of nvfp4's)."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        RecordingLLM.made.append(kwargs)
        quant = kwargs["additional_config"].get("mla_quant")
        if quant is not None and quant.get("calibration") is not None:
            self.recipe = "fp8"


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``vllm.LLM`` replaced; the keyword arguments of each engine made, in order."""
    import vllm

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    RecordingLLM.made = []
    return RecordingLLM.made


class Launcher:
    """Runs ``engine.run_spec`` in this process (the spec through JSON, as the engine
    process reads it); records the names it ran; ``fail`` names engines that raise."""

    def __init__(self, fail: tuple[str, ...] = ()) -> None:
        self.ran: list[str] = []
        self.specs: list[dict[str, Any]] = []
        self.fail = fail

    def __call__(self, spec: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
        from mla_vllm.compare import engine

        spec = json.loads(json.dumps(spec))
        self.ran.append(spec["name"])
        self.specs.append(spec)
        if spec["name"] in self.fail:
            raise RuntimeError(f"{spec['name']}: engine process exited with 1")
        result: dict[str, Any] = json.loads(json.dumps(engine.run_spec(spec)))
        return result


def _inputs(tmp_path: Path, max_len: int = 512) -> tuple[Path, Path]:
    """A model directory whose layer names are known (two DeepSeek-V2 MLA layers)."""
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "num_hidden_layers": 2,
        "max_position_embeddings": max_len,
    }
    (model / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return model, prompts


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def _topk(rows: list[tuple[torch.Tensor, int]]) -> TopK:
    values, ids = torch.stack([lp for lp, _ in rows]).topk(K, dim=-1)
    return TopK(ids, values, torch.stack([lp[t] for lp, t in rows]))


def _direct_turns(recipe: str, turns: int, n: int, follow: list[int]) -> dict[int, list[Generated]]:
    """Each turn's greedy generations of ``recipe`` and both engines' top-k over them."""
    out: dict[int, list[Generated]] = {t: [] for t in range(1, turns + 1)}
    for prompt in PROMPTS:
        context = list(prompt)
        for turn in range(1, turns + 1):
            seq = list(context)
            native_rows, recipe_rows = [], []
            for _ in range(n):
                q = _logprobs(seq, recipe)
                token = int(q.argmax())
                native_rows.append((_logprobs(seq, None), token))
                recipe_rows.append((q, token))
                seq.append(token)
            out[turn].append(Generated(len(context), _topk(native_rows), _topk(recipe_rows)))
            context = seq + follow
    return out


def test_follow_up_contexts() -> None:
    records = [{"tokens": [7, 8]}, {"tokens": []}]
    assert follow_up_contexts([[1, 2], [3]], records, [5, 6]) == [[1, 2, 7, 8, 5, 6], [3, 5, 6]]
    with pytest.raises(ValueError, match="zip"):
        follow_up_contexts([[1]], records, [5])


def test_multi_turn_feeds_answers_back_and_reports_per_turn(
    tmp_path: Path, engines: list[dict[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path)
    launcher = Launcher()
    n, follow = 20, [11, 12]
    argv = [str(model), "--prompts", str(prompts), "--top-k", str(K), "--out", str(tmp_path / "o")]
    argv += ["--recipe", "none", "--recipe", "nvfp4", "--generate", str(n), "--turns", "2"]
    argv += ["--follow-up", json.dumps(follow), "--bootstrap", "100"]
    report = run(argv, launcher=launcher, console=_quiet())
    # multi-turn turns prefix caching on by default, in every engine
    assert [e["enable_prefix_caching"] for e in engines] == [True, True, True]
    assert report["prefix_caching"] is True and report["turns"] == 2
    assert report["follow_up"] == follow
    # the native engine scores both turns: turn 2 continues prompt + answer 1 + follow-up
    native = launcher.specs[-1]
    pairs = native["score"]["nvfp4"]
    assert len(pairs) == 2 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        first_context, first_answer = pairs[i]
        assert first_context == prompt and len(first_answer) == n
        assert pairs[len(PROMPTS) + i][0] == [*prompt, *first_answer, *follow]
    for name in ("none", "nvfp4"):
        gen = report["recipes"][name]["generation"]
        assert set(gen["by_turn"]) == {"1", "2"}
        assert [p["turn"] for p in gen["per_prompt"]] == [1, 1, 2, 2]
        direct = _direct_turns(name, 2, n, follow)
        for turn in (1, 2):
            want = json.loads(json.dumps(summarize_generation(direct[turn], resamples=100)))
            got = gen["by_turn"][str(turn)]
            for key in ("overall", "by_position", "by_context"):
                assert _flat(got[key]) == pytest.approx(_flat(want[key]), nan_ok=True), (name, turn)
    assert report["recipes"]["none"]["generation"]["by_turn"]["2"]["overall"]["kl_max"] == 0.0
    turn2 = report["recipes"]["nvfp4"]["generation"]["by_turn"]["2"]["overall"]
    assert turn2["positions"] == n * len(PROMPTS) and turn2["kl"]["mean"] > 0.0
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    assert saved["recipes"]["nvfp4"]["generation"]["by_turn"]["2"]["overall"]["positions"] == (
        n * len(PROMPTS)
    )


def test_engine_settings_reach_vllm_and_the_report(
    tmp_path: Path, engines: list[dict[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path)
    argv = [str(model), "--prompts", str(prompts), "--recipe", "fp8", "--out", str(tmp_path / "o")]
    console = _quiet()
    budget = ["--max-num-batched-tokens", "64"]
    report = run(
        [*argv, "--generate", "4", "--no-prefix-caching", "--chunked-prefill", *budget],
        launcher=Launcher(),
        console=console,
    )
    for kwargs in engines:
        assert kwargs["enable_prefix_caching"] is False
        assert kwargs["enable_chunked_prefill"] is True
        assert kwargs["max_num_batched_tokens"] == 64
    assert report["prefix_caching"] is False and report["chunked_prefill"] is True
    assert report["max_num_batched_tokens"] == 64
    assert report["recipes"]["fp8"]["engine"]["enable_chunked_prefill"] is True
    # defaults: one turn, prefix caching off, chunked prefill left to vLLM
    engines.clear()
    report = run([*argv, "--no-resume"], launcher=Launcher(), console=console)
    assert all(e["enable_prefix_caching"] is False for e in engines)
    assert all("enable_chunked_prefill" not in e for e in engines)
    assert report["chunked_prefill"] is None and report["turns"] == 1


def test_multi_turn_inputs_checked_before_any_engine(
    tmp_path: Path, engines: list[dict[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path, max_len=64)
    base = [str(model), "--prompts", str(prompts), "--recipe", "fp8", "--out", str(tmp_path)]
    two_turns = ["--generate", "4", "--turns", "2"]
    three_turns = ["--generate", "20", "--turns", "3"]
    cases = {
        r"^--turns: multi-turn needs --generate": ["--turns", "2"],
        r"^--follow-up: only used with --turns 2": ["--generate", "4", "--follow-up", "[1]"],
        r"^--follow-up: text, but .* has no tokenizer": ["--generate", "4", "--turns", "2"],
        r"^--follow-up: expected a non-empty list": [*two_turns, "--follow-up", "[]"],
        r"^--generate: the longest prompt \(6 tokens\) plus 3 turns of 20 generated and 2 "
        r"follow-up tokens exceeds max_model_len 64": [*three_turns, "--follow-up", "[1, 2]"],
    }
    launcher = Launcher()
    for message, extra in cases.items():
        with pytest.raises(ValueError, match=message):
            run([*base, *extra], launcher=launcher, console=_quiet())
    assert launcher.ran == [] and engines == []


def _calibration(tmp_path: Path, layers: list[str]) -> Path:
    amax = {"prefill": {"q": 9.0, "k": 7.0, "v": 3.0}, "decode": {"q": 40.0, "k": 2.5, "v": 2.0}}
    doc = {"format": CALIBRATION_FORMAT, "version": 1, "layers": dict.fromkeys(layers, amax)}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))
    return path


def test_calibration_beside_the_uncalibrated_recipe(
    tmp_path: Path, engines: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, prompts = _inputs(tmp_path)
    _calibration(tmp_path, LAYERS)
    monkeypatch.chdir(tmp_path)  # a relative calibration path
    launcher = Launcher()
    argv = [str(model), "--prompts", str(prompts), "--top-k", str(K), "--out", str(tmp_path / "o")]
    argv += ["--recipe", "none", "--recipe", "nvfp4", "--calibration", "calibration.json"]
    report = run(
        [*argv, "--generate", "8", "--bootstrap", "50"], launcher=launcher, console=_quiet()
    )
    # none does not quantize: only nvfp4 gets a calibrated copy, right after it
    assert list(report["recipes"]) == ["none", "nvfp4", "nvfp4-calibrated"]
    calibrated = report["recipes"]["nvfp4-calibrated"]
    assert calibrated["config"]["calibration"] == str(tmp_path / "calibration.json")
    assert calibrated["config"]["recipe"] == "nvfp4"
    assert "calibration" not in report["recipes"]["nvfp4"]["config"]
    entry = calibrated["calibration"]
    assert entry["of"] == "nvfp4"
    kl = report["recipes"]["nvfp4"]["kl_mean"]
    assert entry["kl_recovered"] == pytest.approx(1.0 - calibrated["kl_mean"] / kl)
    assert 0.0 < entry["kl_recovered"] < 1.0  # the stand-in's calibration gives fp8's error
    assert entry["generated_kl_recovered"] > 0.0
    assert report["calibration"] == ["calibration.json"]
    # named: RECIPE=SOURCE, and a JSON source
    source = json.dumps({"from": "calibrate", "path": str(tmp_path / "calibration.json")})
    argv2 = [str(model), "--prompts", str(prompts), "--out", str(tmp_path / "p")]
    argv2 += ["--recipe", "fp8", "--recipe", "nvfp4", "--calibration", f"fp8={source}"]
    report = run(argv2, launcher=Launcher(), console=_quiet())
    assert list(report["recipes"]) == ["fp8", "fp8-calibrated", "nvfp4"]


def test_calibration_checked_before_any_engine(
    tmp_path: Path, engines: list[dict[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    wrong = _calibration(other, ["language_model.model.layers.0.self_attn.attn"])
    right = _calibration(tmp_path, LAYERS)
    base = [str(model), "--prompts", str(prompts), "--recipe", "nvfp4", "--out", str(tmp_path)]
    cases = {
        r"^--calibration 'missing.json': no such calibration file": "missing.json",
        r"^--calibration 'fp8=.*': no recipe named 'fp8' \(recipes: nvfp4\)": f"fp8={right}",
        r"^--calibration '.*': mla_quant\.calibration: its entry": str(wrong),
        r"^--calibration '\{\"from\"': not valid JSON": '{"from"',
        r"^--calibration '.*': mla_quant\.calibration: unknown key": json.dumps(
            {"from": "calibrate", "path": str(right), "pattern": "*"}
        ),
    }
    launcher = Launcher()
    for message, value in cases.items():
        with pytest.raises(ValueError, match=message):
            run([*base, "--calibration", value], launcher=launcher, console=_quiet())
    only_none = [str(model), "--prompts", str(prompts), "--recipe", "none", "--out", str(tmp_path)]
    with pytest.raises(ValueError, match="no recipe that quantizes and has no calibration"):
        run([*only_none, "--calibration", str(right)], launcher=launcher, console=_quiet())
    assert launcher.ran == [] and engines == []


def test_resume_skips_engines_whose_results_are_saved(
    tmp_path: Path, engines: list[dict[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path)
    out = tmp_path / "o"
    argv = [str(model), "--prompts", str(prompts), "--top-k", str(K), "--out", str(out)]
    argv += ["--recipe", "none", "--recipe", "fp8", "--recipe", "nvfp4", "--generate", "10"]
    argv += ["--bootstrap", "50"]
    # an interrupted run: nvfp4's engine failed, the others finished
    first = Launcher(fail=("nvfp4",))
    report = run(argv, launcher=first, console=_quiet())
    assert "error" in report["recipes"]["nvfp4"] and report["resumed"] == []
    assert sorted(first.ran) == ["fp8", "native", "none", "nvfp4"]
    assert sorted(p.name for p in (out / "engines").glob("*.result.json")) == [
        "fp8.result.json",
        "native.result.json",
        "none.result.json",
    ]
    # resumed: none and fp8 come from --out; native scores nvfp4's generations too: rerun
    again = Launcher()
    console = _quiet()
    report = run(argv, launcher=again, console=console)
    assert again.ran == ["nvfp4", "native"]
    assert report["resumed"] == ["fp8", "none"]
    assert "error" not in report["recipes"]["nvfp4"]
    assert "done earlier" in console.file.getvalue()  # type: ignore[attr-defined]
    # everything saved: nothing runs, the report is the same
    third = Launcher()
    resumed = run(argv, launcher=third, console=_quiet())
    assert third.ran == [] and resumed["resumed"] == ["fp8", "native", "none", "nvfp4"]
    assert resumed["recipes"] == report["recipes"]
    # other sampling settings are another key: the recipes and native run again
    other = Launcher()
    run([*argv, "--temperature", "0.7"], launcher=other, console=_quiet())
    assert sorted(other.ran) == ["fp8", "native", "none", "nvfp4"]
    # --no-resume runs every engine; a damaged results file is run again
    forced = Launcher()
    run([*argv, "--no-resume"], launcher=forced, console=_quiet())
    assert sorted(forced.ran) == ["fp8", "native", "none", "nvfp4"]
    (out / "engines" / "fp8.result.json").write_text('{"key": "')
    damaged = Launcher()
    run(argv, launcher=damaged, console=_quiet())
    assert damaged.ran == ["fp8"]


def test_result_key_covers_the_spec() -> None:
    spec = {"name": "fp8", "model": "m", "prompts": [[1, 2]], "mla_quant": {"recipe": "fp8"}}
    assert result_key(spec) == result_key(json.loads(json.dumps(spec)))
    assert result_key(spec) != result_key({**spec, "prompts": [[1, 3]]})
    assert result_key(spec) != result_key({**spec, "mla_quant": {"recipe": "nvfp4"}})
    assert result_key(spec) != result_key({**spec, "enable_prefix_caching": True})


def test_follow_up_ids(tmp_path: Path) -> None:
    from test_compare_inputs import _tokenizer_dir
    from transformers import AutoTokenizer

    from mla_vllm.compare.inputs import follow_up_ids

    model = _tokenizer_dir(tmp_path / "model")
    want = AutoTokenizer.from_pretrained(str(model))("the cat", add_special_tokens=False)
    assert follow_up_ids("the cat", str(model)) == want["input_ids"]
    assert follow_up_ids(" [3, 4]", str(model)) == [3, 4]
    with pytest.raises(ValueError, match=r"^--follow-up: not a valid JSON list"):
        follow_up_ids("[3,", str(model))
    with pytest.raises(ValueError, match=r"^--follow-up: empty"):
        follow_up_ids("", str(model))
