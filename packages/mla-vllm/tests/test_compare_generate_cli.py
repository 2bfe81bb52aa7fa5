"""``mla-compare --generate`` on CPU: the engine process's real code (``engine.run_spec``)
with ``vllm.LLM`` replaced by a stand-in that answers with vLLM 0.33's own
``RequestOutput``, ``CompletionOutput`` and ``Logprob`` objects.

The stand-in's next-token distribution is a seeded function of the prefix (the native
one exact, a recipe's perturbed by a recipe-sized amount), so the report's generation
figures can be checked against a direct computation on full distributions.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

from mla_vllm.compare.cli import run
from mla_vllm.compare.generation import Generated, summarize_generation
from mla_vllm.compare.metrics import TopK

VOCAB = 40
K = 5
NOISE = {None: 0.0, "none": 0.0, "fp8": 0.05, "nvfp4": 0.5}
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10]]
GENERATE = 300  # crosses the 256-token bucket edge


def _logprobs(prefix: Sequence[int], recipe: str | None) -> torch.Tensor:
    """The next-token log-distribution after ``prefix`` ``[VOCAB]``."""
    h = len(prefix)
    for t in prefix[-4:]:
        h = (h * 1000003 + int(t)) % (1 << 31)
    base = 3.0 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(h), dtype=torch.float64)
    noise = torch.randn(VOCAB, generator=torch.Generator().manual_seed(h + 7), dtype=torch.float64)
    return torch.log_softmax(base + NOISE[recipe] * noise, dim=-1)


def _entry(lp: torch.Tensor, token: int, k: int) -> dict[int, Any]:
    """vLLM's ``{token: Logprob}`` of one position: the top-k and ``token``, ranked."""
    from vllm.logprobs import Logprob

    top = lp.topk(k).indices.tolist()
    return {
        int(t): Logprob(float(lp[t]), int((lp > lp[t]).sum()) + 1)
        for t in dict.fromkeys([*top, token])
    }


class FakeLLM:
    """Stands in for ``vllm.LLM``: teacher forcing, greedy and sampled generation."""

    def __init__(self, **kwargs: Any) -> None:
        quant = kwargs["additional_config"].get("mla_quant")
        self.recipe = None if quant is None else quant["recipe"]
        self.calls: list[Any] = []

    def apply_model(self, func: Any) -> list[Any]:
        return []  # no MLA layer here: no statistics, no amax

    def generate(self, inputs: Sequence[Any], params: Any, use_tqdm: bool = True) -> list[Any]:
        from vllm.outputs import CompletionOutput, RequestOutput

        outs = []
        for i, item in enumerate(inputs):
            p = params[i] if isinstance(params, list) else params
            ids = list(item["prompt_token_ids"])
            prompt_lp: list[dict[int, Any] | None] | None = None
            sample_lp: list[dict[int, Any]] | None = None
            if p.prompt_logprobs:
                prompt_lp = [None] + [
                    _entry(_logprobs(ids[:j], self.recipe), ids[j], p.prompt_logprobs)
                    for j in range(1, len(ids))
                ]
            tokens: list[int] = []
            if p.logprobs:
                sample_lp = []
            gen = torch.Generator().manual_seed(p.seed or 0)
            for _ in range(p.max_tokens):
                lp = _logprobs(ids + tokens, self.recipe)
                if p.temperature > 0.0:
                    token = int(
                        torch.multinomial((lp / p.temperature).softmax(-1), 1, generator=gen)
                    )
                else:
                    token = int(lp.argmax())
                if sample_lp is not None:
                    sample_lp.append(_entry(lp, token, p.logprobs))
                tokens.append(token)
            completion = CompletionOutput(0, "", tokens, None, sample_lp)
            outs.append(RequestOutput(str(i), None, ids, prompt_lp, [completion], True))
        return outs


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> list[Mapping[str, Any]]:
    """``vllm.LLM`` replaced; the specs the engine process was given, in order."""
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    return []


def _launcher(seen: list[Mapping[str, Any]]) -> Any:
    from mla_vllm.compare import engine

    def launch(spec: Mapping[str, Any], workdir: Path) -> dict[str, Any]:
        spec = json.loads(json.dumps(spec))  # what the engine process reads
        seen.append(spec)
        result: dict[str, Any] = json.loads(json.dumps(engine.run_spec(spec)))
        return result

    return launch


def _inputs(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return model, prompts


def _flat(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts and lists by path (``pytest.approx`` takes flat mappings)."""
    if isinstance(obj, Mapping):
        return {
            k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}.{key}").items()
        }
    if isinstance(obj, list):
        return {
            k: v for i, value in enumerate(obj) for k, v in _flat(value, f"{prefix}[{i}]").items()
        }
    return {prefix: obj}


def _direct(recipe: str) -> list[Generated]:
    """The recipe's greedy generations and both engines' top-k over them, computed here."""
    out = []
    for prompt in PROMPTS:
        seq = list(prompt)
        native_rows, recipe_rows = [], []
        for _ in range(GENERATE):
            q = _logprobs(seq, recipe)
            token = int(q.argmax())
            native_rows.append((_logprobs(seq, None), token))
            recipe_rows.append((q, token))
            seq.append(token)

        def topk(rows: list[tuple[torch.Tensor, int]]) -> TopK:
            values, ids = torch.stack([lp for lp, _ in rows]).topk(K, dim=-1)
            target = torch.stack([lp[t] for lp, t in rows])
            return TopK(ids, values, target)

        out.append(Generated(len(prompt), topk(native_rows), topk(recipe_rows)))
    return out


def test_generation_report_against_a_direct_computation(
    tmp_path: Path, fake_vllm: list[Mapping[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path)
    out = tmp_path / "out"
    console = Console(file=io.StringIO(), width=200)
    argv = [str(model), "--prompts", str(prompts), "--top-k", str(K), "--out", str(out)]
    for recipe in ("none", "fp8", "nvfp4"):
        argv += ["--recipe", recipe]
    report = run(
        [*argv, "--generate", str(GENERATE), "--bootstrap", "200", "--jobs", "2"],
        launcher=_launcher(fake_vllm),
        console=console,
    )
    # the recipes generate first, the native engine last scores their tokens
    assert [s["name"] for s in fake_vllm][-1] == "native"
    native_spec = fake_vllm[-1]
    assert set(native_spec["score"]) == {"none", "fp8", "nvfp4"}
    assert all(s["generate"]["max_tokens"] == GENERATE for s in fake_vllm[:-1])
    assert fake_vllm[0]["generate"]["temperature"] == 0.0
    for name in ("none", "fp8", "nvfp4"):
        want = json.loads(json.dumps(summarize_generation(_direct(name), resamples=200)))
        got = _flat(report["recipes"][name]["generation"])
        assert got == pytest.approx(_flat(want), nan_ok=True), name
    gen = {n: report["recipes"][n]["generation"] for n in ("none", "fp8", "nvfp4")}
    assert gen["none"]["overall"]["kl_max"] == 0.0
    assert gen["none"]["overall"]["top1"]["mean"] == 1.0
    assert gen["none"]["overall"]["dnll"]["mean"] == 0.0
    assert gen["fp8"]["overall"]["kl"]["mean"] < gen["nvfp4"]["overall"]["kl"]["mean"]
    assert set(gen["nvfp4"]["by_position"]) == {"0-256", "256-1k"}
    assert gen["nvfp4"]["by_position"]["256-1k"]["positions"] == 2 * (GENERATE - 256)
    assert [p["generated"] for p in gen["nvfp4"]["per_prompt"]] == [GENERATE, GENERATE]
    # the prompt-scoring (prefill) figures stay beside them
    assert report["recipes"]["none"]["kl_max"] == 0.0
    saved = json.loads((out / "report.json").read_text())
    assert saved["recipes"]["fp8"]["generation"] == json.loads(json.dumps(gen["fp8"]))
    assert saved["generate"] == GENERATE
    assert (out / "generation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "generation fidelity" in text and "generated 256-1k" in text
    assert "generation.png" in text


def test_sampled_generation_is_seeded(tmp_path: Path, fake_vllm: list[Mapping[str, Any]]) -> None:
    model, prompts = _inputs(tmp_path)
    argv = [str(model), "--prompts", str(prompts), "--recipe", "fp8", "--generate", "12"]
    argv += ["--temperature", "1.5", "--bootstrap", "50"]
    quiet = Console(file=io.StringIO())
    one = run([*argv, "--out", str(tmp_path / "a")], launcher=_launcher(fake_vllm), console=quiet)
    two = run([*argv, "--out", str(tmp_path / "b")], launcher=_launcher(fake_vllm), console=quiet)
    assert one["recipes"]["fp8"]["generation"] == two["recipes"]["fp8"]["generation"]
    tokens = [s["score"]["fp8"] for s in fake_vllm if s["name"] == "native"]
    assert tokens[0] == tokens[1]
    greedy = [int(_logprobs(p, "fp8").argmax()) for p in PROMPTS]
    assert [pair[1][0] for pair in tokens[0]] != greedy  # sampled (seeded), not greedy
    assert fake_vllm[0]["generate"]["temperature"] == 1.5


def test_generate_inputs_checked_before_any_engine(
    tmp_path: Path, fake_vllm: list[Mapping[str, Any]]
) -> None:
    model, prompts = _inputs(tmp_path)
    base = [str(model), "--prompts", str(prompts), "--recipe", "fp8", "--out", str(tmp_path)]
    cases = {
        r"--generate: the longest prompt \(6 tokens\) plus 507": ["--generate", "507"],
        "--generate: expected >= 0": ["--generate", "-1"],
        "--temperature: expected a finite number >= 0": ["--temperature", "-0.5"],
    }
    for message, extra in cases.items():
        with pytest.raises(ValueError, match=message):
            run([*base, *extra], launcher=_launcher(fake_vllm), console=Console(file=io.StringIO()))
    assert fake_vllm == []


def test_generated_topk_from_vllm_outputs() -> None:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from mla_vllm.compare.engine import generated_topk, scored_topk

    lps = [
        {3: Logprob(-0.2, 1), 4: Logprob(-1.9, 2)},
        {4: Logprob(-0.7, 1), 3: Logprob(-0.9, 2), 8: Logprob(-3.0, 6)},  # sampled rank 6
    ]
    out = RequestOutput("0", None, [1, 2], None, [CompletionOutput(0, "", [3, 8], None, lps)], True)
    assert generated_topk([out], [[1, 2]], 2) == [
        {
            "prompt_len": 2,
            "tokens": [3, 8],
            "ids": [[3, 4], [4, 3]],
            "logprobs": [[-0.2, -1.9], [-0.7, -0.9]],
            "target": [-0.2, -3.0],
        }
    ]
    bare = RequestOutput("0", None, [1, 2], None, [CompletionOutput(0, "", [3], None, None)], True)
    with pytest.raises(ValueError, match=r"outputs\[0\]: no logprob positions for 1 generated"):
        generated_topk([bare], [[1, 2]], 2)
    # native scoring of [1, 2] + [3, 8]: prompt logprobs at 0..3, the last two are generated
    plp: list[dict[int, Logprob] | None] = [
        None,
        {2: Logprob(-0.1, 1), 5: Logprob(-2.5, 2)},
        {3: Logprob(-0.3, 1), 5: Logprob(-1.5, 2)},
        {4: Logprob(-0.4, 1), 3: Logprob(-1.2, 2), 8: Logprob(-2.2, 3)},
    ]
    scored = RequestOutput("0", None, [1, 2, 3, 8], plp, [], True)
    assert scored_topk([scored], [[1, 2, 3, 8]], [2], 2) == [
        {"ids": [[3, 5], [4, 3]], "logprobs": [[-0.3, -1.5], [-0.4, -1.2]], "target": [-0.3, -2.2]}
    ]
