"""One configuration in one ``vllm.LLM``: the child process's side."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from .configs import KV_CACHE_BYTES, MAX_BATCHED_TOKENS, MAX_TOKENS, OBSERVE, RUNS, SEED, prompts
from .probes import describe_layers, describe_shadows, ensure_registered, probe_worker


def _messages(exc: BaseException) -> list[str]:
    """``type: message`` of an exception and of its causes and contexts."""
    seen: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 8:
        seen.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return seen


def run_one(name: str, out_dir: Path, model_dir: Path, tp: int = 1) -> dict[str, Any]:
    """One engine, one configuration; results as JSON-able data."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    import mla_vllm

    run = RUNS[name]
    registered = ensure_registered(tp)
    quant = run.quant
    if quant == "CALIBRATED":
        quant = {
            "recipe": "nvfp4",
            "calibration": str(out_dir / "calibration.json"),
            "observe": OBSERVE,
        }
    extra: dict[str, Any] = {} if quant is None else {"mla_quant": quant}
    common: dict[str, Any] = {
        "name": name,
        "tp": tp,
        "backend": run.backend,
        "eager": run.eager,
        "quant": quant,
        "registered": registered,
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "gpu": torch.cuda.get_device_name(),
        "weights": json.loads((model_dir / "weights.json").read_text()),
    }
    parallel: dict[str, Any] = {}
    if tp > 1:  # the two-GPU kind's settings (shared/gpu-vllm/README.md)
        parallel = {"tensor_parallel_size": tp, "disable_custom_all_reduce": True}
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, prompt_logprobs=0, ignore_eos=True
    )
    inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts()]
    t0 = time.time()
    try:
        llm = LLM(
            model=str(model_dir),
            load_format="safetensors",
            skip_tokenizer_init=True,
            dtype="bfloat16",
            attention_backend=run.backend,
            enforce_eager=run.eager,
            additional_config=extra,
            max_model_len=1024,
            max_num_batched_tokens=MAX_BATCHED_TOKENS,
            max_num_seqs=8,
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
            gpu_memory_utilization=0.15,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            seed=SEED,
            **parallel,
        )
        if run.action == "expect_error":
            llm.generate(inputs, params, use_tqdm=False)
    except Exception as exc:
        if run.action != "expect_error":
            raise
        traceback.print_exc()
        chain = _messages(exc)
        return common | {
            "raised": True,
            "error_type": type(exc).__name__,
            "message": "\n".join(chain),
            "seconds": round(time.time() - t0, 1),
        }
    if run.action == "expect_error":
        return common | {"raised": False, "message": "", "seconds": round(time.time() - t0, 1)}
    engine_seconds = time.time() - t0

    def generate() -> list[dict[str, Any]]:
        results = []
        for prompt, output in zip(
            prompts(), llm.generate(inputs, params, use_tqdm=False), strict=True
        ):
            prompt_lp = [
                d[tok].logprob if d else None
                for tok, d in zip(prompt, output.prompt_logprobs or [], strict=False)
            ]
            completion = output.outputs[0]
            gen_lp, top2 = [], []
            for tok, lp in zip(completion.token_ids, completion.logprobs or [], strict=True):
                gen_lp.append(lp[tok].logprob)
                best = sorted(((v.logprob, t) for t, v in lp.items()), reverse=True)[:2]
                top2.append([[t, v] for v, t in best])
            results.append(
                {
                    "prompt_logprobs": prompt_lp,
                    "tokens": list(completion.token_ids),
                    "logprobs": gen_lp,
                    "top2": top2,
                }
            )
        return results

    config = getattr(llm.llm_engine, "vllm_config", None)
    mode = getattr(getattr(config, "compilation_config", None), "cudagraph_mode", None)
    per_rank = llm.apply_model(describe_layers)
    result: dict[str, Any] = common | {
        "cudagraph_mode": str(mode),
        "engine_seconds": round(engine_seconds, 1),
        "engine_pid": os.getpid(),
        "layers": per_rank[0],
        "layers_per_rank": per_rank,
        "shadows": llm.apply_model(describe_shadows)[0],
    }
    start = time.time()
    if run.action == "calibrate":
        doc = mla_vllm.calibrate(llm, prompts(), output=out_dir / "calibration.json")
        result["calibration"] = doc
    elif run.action == "install":
        result["native"] = generate()
        mla_vllm.install(llm, {"recipe": "nvfp4"})
        result["installed_layers"] = llm.apply_model(describe_layers)[0]
        result["installed"] = generate()
        mla_vllm.uninstall(llm)
        result["restored_layers"] = llm.apply_model(describe_layers)[0]
        result["restored"] = generate()
    else:
        result["outputs"] = generate()
        if isinstance(quant, dict) and quant.get("observe", {}).get("enabled"):
            result["stats"] = mla_vllm.get_stats(llm)
    result["workers"] = llm.apply_model(probe_worker)  # after a forward: recipes bound
    result["work_seconds"] = round(time.time() - start, 1)
    return result
