"""Calibration: the static amax of q, k and v per layer and path, as a JSON document.

``calibrate(llm, prompts)`` installs quantized impls that record ``max |x|``
(``start_calibration``, in each worker), generates, collects and removes them
(``finish_calibration``), and merges the workers' maxima
(``calibration_document``). Load the document with ``"calibration": path``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from vllm.sampling_params import SamplingParams

from mla_vllm.config import CALIBRATION_FORMAT
from mla_vllm.installer import install_model, uninstall_model
from mla_vllm.targets import is_llm, layer_states

__all__ = ["calibrate", "calibration_document", "finish_calibration", "start_calibration"]

_CALIB_ATTR = "_mla_quant_calibration_installed"


def start_calibration(model: torch.nn.Module) -> list[str]:
    """Record amax of q, k, v on every MLA layer from now on (installs if needed)."""
    states = layer_states(model)
    if not states:
        install_model(model, {})
        setattr(model, _CALIB_ATTR, True)
        states = layer_states(model)
    for state in states.values():
        state.amax.clear()
        state.calibrating = True
    return sorted(states)


def finish_calibration(model: torch.nn.Module) -> dict[str, dict[str, dict[str, float]]]:
    """Stop recording; ``{layer: {"prefill"|"decode": {"q"|"k"|"v": amax}}}``."""
    states = layer_states(model)
    result = {name: state.amax_snapshot() for name, state in states.items()}
    for state in states.values():
        state.calibrating = False
        state.amax.clear()
    if getattr(model, _CALIB_ATTR, False):
        uninstall_model(model)
        delattr(model, _CALIB_ATTR)
    return result


def calibration_document(
    per_worker: Sequence[dict[str, dict[str, dict[str, float]]]],
) -> dict[str, Any]:
    """Merge workers' amaxes (max over ranks) into a calibration JSON document."""
    layers: dict[str, dict[str, dict[str, float]]] = {}
    for amaxes in per_worker:
        for name, paths in amaxes.items():
            for path, roles in paths.items():
                slot = layers.setdefault(name, {}).setdefault(path, {})
                for role, value in roles.items():
                    slot[role] = max(value, slot.get(role, 0.0))
    return {"format": CALIBRATION_FORMAT, "version": 1, "layers": layers}


def _check_output(output: str | Path) -> Path:
    """``output`` can be written: its folder exists and it is not a folder itself."""
    path = Path(output).expanduser()
    if path.is_dir():
        raise ValueError(f"output: {str(output)!r} is a directory; expected a file path")
    folder = path.parent
    if not folder.is_dir():
        what = "is not a directory" if folder.exists() else "does not exist"
        raise ValueError(
            f"output: the directory {str(folder)!r} {what} (make it first: the calibration "
            "would be lost after the run)"
        )
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"output: cannot write {str(output)!r} (permission denied)")
    return path


def calibrate(
    llm: Any,
    prompts: Sequence[Sequence[int]] | Sequence[Any],
    *,
    output: str | Path | None = None,
    max_tokens: int = 8,
    progress: bool = True,
) -> dict[str, Any]:
    """Static amax per layer for q, k and v over ``prompts`` (token-id lists or prompts).

    Runs ``llm.generate`` with greedy sampling and ``max_tokens`` new tokens, so both
    prefill and decode operands are seen; records ``max |x|`` over every token. Run
    the engine with ``enforce_eager=True`` (decode replayed from a captured CUDA
    graph is not observed). Writes the JSON to ``output`` when given and returns it;
    ``output``'s folder must exist (checked before anything runs).

    ``progress``: print each step to stderr (recorders installed, generation under
    vLLM's progress bar, amaxes collected, file written) with the time taken.
    """
    if not is_llm(llm):
        raise ValueError(f"llm: expected a vllm.LLM, got {type(llm).__name__}")
    if not prompts:
        raise ValueError("prompts: expected at least one prompt")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens: expected an integer >= 1, got {max_tokens!r}")
    path = None if output is None else _check_output(output)
    say = _Progress(progress)
    inputs = [{"prompt_token_ids": list(p)} if isinstance(p, (list, tuple)) else p for p in prompts]
    layers = llm.apply_model(start_calibration)
    say(f"recording amax on {len(layers[0]) if layers else 0} MLA layers")
    say(f"generating {len(inputs)} prompts, {max_tokens} new tokens each")
    try:
        llm.generate(
            inputs, SamplingParams(max_tokens=max_tokens, temperature=0.0), use_tqdm=progress
        )
    finally:
        amaxes = llm.apply_model(finish_calibration)
    document = calibration_document(amaxes)
    say(f"collected the amax of {len(document['layers'])} layers from {len(amaxes)} worker(s)")
    if path is not None:
        path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
        say(f"wrote {path}")
    return document


class _Progress:
    """``calibrate``'s step lines on stderr, each with the seconds since the start."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.start = time.perf_counter()

    def __call__(self, text: str) -> None:
        if self.enabled:
            seconds = time.perf_counter() - self.start
            print(f"mla_vllm.calibrate [{seconds:6.1f} s] {text}", file=sys.stderr, flush=True)
