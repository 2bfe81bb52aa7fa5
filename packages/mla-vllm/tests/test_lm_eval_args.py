"""lm-eval 0.4.13's ``--model vllm``: ``attention_backend`` and ``additional_config`` reach ``LLM``.

The path runs through lm-eval's own command-line parser, its ``EvaluatorConfig``,
its model registry and ``VLLM.__init__`` up to the ``vllm.LLM(...)`` call, which is
replaced by a recorder (no engine starts on CPU). The recorded arguments are then
validated by ``config_from_vllm`` as the backend would.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from mla_vllm.config import MLAQuantConfigError, config_from_vllm

QUANT = {"mla_quant": {"recipe": "nvfp4", "kv_path": "shadow", "observe": {"enabled": True}}}


class _StopError(Exception):
    """Raised by the stand-in LLM once it has the arguments."""


def _llm_kwargs(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, Any]:
    import lm_eval.api.registry as registry
    import lm_eval.models.vllm_causallms as vllm_lm
    from lm_eval._cli.harness import HarnessCLI
    from lm_eval.config.evaluate_config import EvaluatorConfig

    seen: dict[str, Any] = {}

    def record(**kwargs: Any) -> None:
        seen.update(kwargs)
        raise _StopError

    monkeypatch.setattr(vllm_lm, "LLM", record)
    args = HarnessCLI()._parser.parse_args(["run", "--model", "vllm", *argv, "--tasks", "t"])
    cfg = EvaluatorConfig.from_cli(args)
    extra = {"batch_size": cfg.batch_size, "max_batch_size": cfg.max_batch_size, "device": None}
    with pytest.raises(_StopError):  # lm_eval.evaluator.simple_evaluate's call for dict model_args
        registry.get_model(cfg.model).create_from_arg_obj(cfg.model_args, extra)
    return seen


def test_json_model_args_reach_llm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model_args = {
        "pretrained": str(tmp_path),
        "attention_backend": "MLA_QUANT",
        "additional_config": QUANT,
        "enforce_eager": True,
        "max_model_len": 512,
    }
    seen = _llm_kwargs(monkeypatch, ["--model_args", json.dumps(model_args)])
    assert seen["model"] == str(tmp_path)
    assert seen["attention_backend"] == "MLA_QUANT"
    assert seen["additional_config"] == QUANT
    assert seen["enforce_eager"] is True and seen["max_model_len"] == 512
    config = config_from_vllm(SimpleNamespace(additional_config=seen["additional_config"]))
    assert config.kv_path == "shadow" and config.observe.enabled
    assert config.recipe_for("model.layers.0.self_attn.attn").decode.v.format.name == "nvfp4"


def test_key_value_model_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``key=value`` words: a value is read with ``ast.literal_eval``, so JSON's ``true``
    leaves it a string, which ``config_from_vllm`` refuses instead of running unquantized.
    """
    literal = {"mla_quant": {"recipe": "nvfp4", "kv_path": "shadow"}}
    for value, works in ((literal, True), (QUANT, False)):
        argv = [
            "--model_args",
            f"pretrained={tmp_path},attention_backend=MLA_QUANT",
            "additional_config=" + json.dumps(value),
        ]
        seen = _llm_kwargs(monkeypatch, argv)
        assert seen["attention_backend"] == "MLA_QUANT"
        vllm_config = SimpleNamespace(additional_config=seen["additional_config"])
        if works:
            assert seen["additional_config"] == literal
            assert config_from_vllm(vllm_config).kv_path == "shadow"
        else:
            assert seen["additional_config"] == json.dumps(QUANT)
            with pytest.raises(MLAQuantConfigError, match="additional_config: expected a JSON"):
                config_from_vllm(vllm_config)


def test_braces_in_the_first_word_are_refused_by_lm_eval() -> None:
    """lm-eval 0.4.13 reads a first word with ``{`` as JSON: the one-word form fails there."""
    from lm_eval._cli.harness import HarnessCLI

    words = f"pretrained=/m,attention_backend=MLA_QUANT,additional_config={json.dumps(QUANT)}"
    with pytest.raises(ValueError, match="Invalid JSON"):
        HarnessCLI()._parser.parse_args(["run", "--model", "vllm", "--model_args", words])
