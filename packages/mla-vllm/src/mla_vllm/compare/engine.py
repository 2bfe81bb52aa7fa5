"""One configuration in one ``vllm.LLM``: the engine process's side (imports vLLM).

``mla_vllm.compare.launch`` runs ``python -m mla_vllm.compare.engine SPEC OUT``;
``run_spec`` builds the engine, teacher-forces the prompts (prompt logprobs,
top-k), optionally generates greedily, reads the ``observe`` statistics and the
static amax each layer resolved, and writes the results as JSON. One process per
engine: GPU memory and vLLM's global state are released between configurations,
and tensor parallelism (``tensor_parallel_size``) takes the same path as one GPU.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mla_vllm.compare.launch import PHASE
from mla_vllm.plugin import register
from mla_vllm.stats import get_stats
from mla_vllm.targets import layer_states, model_layers, on_models

__all__ = ["layer_amax", "prompt_topk", "run_spec"]


def prompt_topk(
    prompt_logprobs: Sequence[Mapping[int, Any] | None], ids: Sequence[int], k: int
) -> dict[str, list[Any]]:
    """Top-k ids/logprobs and the next token's logprob at positions 1..L-1 of one prompt.

    ``prompt_logprobs[i]`` is vLLM's ``{token: Logprob(logprob, rank, ...)}`` for
    position i (None at 0); it holds the top-k and the actual token.
    """
    if len(prompt_logprobs) != len(ids):
        raise ValueError(
            f"prompt_logprobs: {len(prompt_logprobs)} positions for a {len(ids)}-token prompt"
        )
    top_ids: list[list[int]] = []
    top_lp: list[list[float]] = []
    target: list[float] = []
    for i in range(1, len(ids)):
        entry = prompt_logprobs[i]
        if entry is None or ids[i] not in entry:
            raise ValueError(f"prompt_logprobs[{i}]: no logprob of the prompt's token {ids[i]}")
        ranked = sorted(
            (
                (int(getattr(lp, "rank", 0) or 0), int(tok), float(lp.logprob))
                for tok, lp in entry.items()
            ),
            key=lambda r: (r[0], -r[2]),
        )
        best = [r for r in ranked if 1 <= r[0] <= k][:k]
        if len(best) < k:
            raise ValueError(f"prompt_logprobs[{i}]: {len(best)} ranked entries, expected {k}")
        top_ids.append([r[1] for r in best])
        top_lp.append([r[2] for r in best])
        target.append(float(entry[ids[i]].logprob))
    return {"ids": top_ids, "logprobs": top_lp, "target": target}


def layer_amax(model: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """Per quantized layer and path: each operand's format and resolved amax."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, state in layer_states(model).items():
        for path in ("prefill", "decode"):
            quant = getattr(state.recipe, path)
            out.setdefault(name, {})[path] = {
                role: [getattr(op.format, "name", str(op.format)), op.amax]
                for role, op in (("q", quant.q), ("k", quant.k), ("p", quant.p), ("v", quant.v))
            }
    return out


def _phase(text: str) -> None:
    """Tell the parent (``launch``: it reads this process's output) what runs now."""
    print(f"{PHASE}{text}", flush=True)


def run_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Build the engine of ``spec``, run it, return JSON-able results (child side)."""
    tp = int(spec.get("tensor_parallel_size", 1))
    _phase(f"starting vLLM ({spec['backend']}, TP={tp})")
    register()  # re-entrant; reaches an in-process engine without the entry point
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    k = int(spec["top_k"])
    quant = spec.get("mla_quant")
    engine_args: dict[str, Any] = {
        "model": spec["model"],
        "attention_backend": spec["backend"],
        "additional_config": {} if quant is None else {"mla_quant": quant},
        "tensor_parallel_size": tp,
        "skip_tokenizer_init": True,
        "dtype": spec.get("dtype", "auto"),
        "enforce_eager": bool(spec.get("enforce_eager", True)),
        "max_logprobs": max(k, 20),
        "enable_prefix_caching": False,
        "seed": int(spec.get("seed", 0)),
        "gpu_memory_utilization": float(spec.get("gpu_memory_utilization", 0.85)),
    }
    for key in ("max_model_len", "kv_cache_memory_bytes", "max_num_seqs"):
        if spec.get(key) is not None:
            engine_args[key] = int(spec[key])
    engine_args.update(spec.get("engine_args") or {})
    t0 = time.time()
    _phase(f"starting the engine: loading {spec['model']}")
    llm = LLM(**engine_args)
    started = time.time() - t0
    _phase(f"engine ready in {started:.0f} s; teacher-forcing {len(spec['prompts'])} prompts")
    prompts = [list(map(int, p)) for p in spec["prompts"]]
    inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    outs = llm.generate(inputs, params, use_tqdm=False)
    forced = [
        prompt_topk(o.prompt_logprobs or [], p, k) for o, p in zip(outs, prompts, strict=True)
    ]
    greedy: list[list[int]] | None = None
    n_greedy = int(spec.get("greedy_tokens", 0))
    if n_greedy > 0:
        _phase(f"greedy decoding, {n_greedy} tokens per prompt")
        gen = SamplingParams(
            max_tokens=n_greedy, temperature=0.0, ignore_eos=True, detokenize=False
        )
        greedy = [list(o.outputs[0].token_ids) for o in llm.generate(inputs, gen, use_tqdm=False)]
    quantized = quant is not None
    _phase("collecting statistics")
    stats = get_stats(llm) if quantized else {}
    amax: dict[str, Any] = {}
    if quantized:
        for rank, layers in enumerate(on_models(llm, layer_amax)):
            amax |= {name if rank == 0 else f"{name}@{rank}": v for name, v in layers.items()}
    impl = on_models(llm, _impl_names)
    return {
        "name": spec["name"],
        "forced": forced,
        "greedy": greedy,
        "stats": stats,
        "amax": amax,
        "engine": {
            "backend": spec["backend"],
            "impl": sorted({n for names in impl for n in names}),
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "start_s": round(started, 2),
            "run_s": round(time.time() - t0 - started, 2),
            "tensor_parallel_size": engine_args["tensor_parallel_size"],
        },
    }


def _impl_names(model: Any) -> list[str]:
    return sorted({type(layer.impl).__name__ for layer in model_layers(model).values()})


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mla_vllm.compare.engine SPEC OUT``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m mla_vllm.compare.engine SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    result = run_spec(spec)
    Path(args[1]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
