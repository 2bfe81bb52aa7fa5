"""One configuration in one ``vllm.LLM``: the engine process's side (imports vLLM).

``mla_vllm.compare.launch`` runs ``python -m mla_vllm.compare.engine SPEC OUT``;
``run_spec`` builds the engine, teacher-forces the prompts (prompt logprobs,
top-k), optionally generates greedily, generates freely with top-k logprobs
(``generate``: a recipe's engine) or scores other engines' generations (``score``:
the native engine), reads the ``observe`` statistics and the static amax each layer
resolved, and writes the results as JSON. ``generated_topk`` and ``scored_topk`` turn
vLLM's ``RequestOutput`` objects into those results; they run without a GPU. One process per
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

__all__ = [
    "engine_settings",
    "follow_up_contexts",
    "generated_topk",
    "layer_amax",
    "prompt_topk",
    "run_spec",
    "scored_topk",
]


def _ranked(entry: Mapping[int, Any], k: int, where: str) -> tuple[list[int], list[float]]:
    """The ids and logprobs of ranks 1..k of one position's ``{token: Logprob}``."""
    ranked = sorted(
        (
            (int(getattr(lp, "rank", 0) or 0), int(tok), float(lp.logprob))
            for tok, lp in entry.items()
        ),
        key=lambda r: (r[0], -r[2]),
    )
    best = [r for r in ranked if 1 <= r[0] <= k][:k]
    if len(best) < k:
        raise ValueError(f"{where}: {len(best)} ranked entries, expected {k}")
    return [r[1] for r in best], [r[2] for r in best]


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
        best_ids, best_lp = _ranked(entry, k, f"prompt_logprobs[{i}]")
        top_ids.append(best_ids)
        top_lp.append(best_lp)
        target.append(float(entry[ids[i]].logprob))
    return {"ids": top_ids, "logprobs": top_lp, "target": target}


def generated_topk(outputs: Sequence[Any], prompts: Sequence[Sequence[int]], k: int) -> list[Any]:
    """Each ``RequestOutput`` of a generation with ``logprobs=k``: the generated
    ``tokens``, the top-k at each generated position and the generated token's logprob
    (``target``), and ``prompt_len``.

    ``outputs[i].outputs[0].logprobs[j]`` is ``{token: Logprob}`` of generated position
    ``j``: the top-k and the token sampled there.
    """
    if len(outputs) != len(prompts):
        raise ValueError(f"outputs: {len(outputs)} requests for {len(prompts)} prompts")
    records: list[Any] = []
    for n, (out, prompt) in enumerate(zip(outputs, prompts, strict=True)):
        completion = out.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        logprobs = completion.logprobs
        if logprobs is None or len(logprobs) != len(tokens):
            got = "no" if logprobs is None else len(logprobs)
            raise ValueError(
                f"outputs[{n}]: {got} logprob positions for {len(tokens)} generated tokens "
                "(sampling without logprobs=k?)"
            )
        top_ids: list[list[int]] = []
        top_lp: list[list[float]] = []
        target: list[float] = []
        for j, token in enumerate(tokens):
            entry = logprobs[j]
            where = f"outputs[{n}].logprobs[{j}]"
            if token not in entry:
                raise ValueError(f"{where}: no logprob of the generated token {token}")
            best_ids, best_lp = _ranked(entry, k, where)
            top_ids.append(best_ids)
            top_lp.append(best_lp)
            target.append(float(entry[token].logprob))
        records.append(
            {
                "prompt_len": len(prompt),
                "tokens": tokens,
                "ids": top_ids,
                "logprobs": top_lp,
                "target": target,
            }
        )
    return records


def scored_topk(
    outputs: Sequence[Any], sequences: Sequence[Sequence[int]], generated: Sequence[int], k: int
) -> list[dict[str, list[Any]]]:
    """The native engine's top-k at the generated positions of ``sequences`` (prompt
    followed by ``generated[i]`` generated tokens), from its prompt logprobs over them."""
    records: list[dict[str, list[Any]]] = []
    for out, seq, n in zip(outputs, sequences, generated, strict=True):
        forced = prompt_topk(out.prompt_logprobs or [], seq, k)
        start = len(seq) - 1 - n  # forced position i predicts token i + 1
        records.append({key: value[start:] for key, value in forced.items()})
    return records


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
        "enable_prefix_caching": bool(spec.get("enable_prefix_caching", False)),
        "seed": int(spec.get("seed", 0)),
        "gpu_memory_utilization": float(spec.get("gpu_memory_utilization", 0.85)),
    }
    if spec.get("enable_chunked_prefill") is not None:  # None: vLLM's default
        engine_args["enable_chunked_prefill"] = bool(spec["enable_chunked_prefill"])
    for key in ("max_model_len", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
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
    generated = _generate(llm, prompts, spec, k)
    scored = _score(llm, spec, k)
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
        "generated": generated,
        "scored": scored,
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
            **engine_settings(llm, engine_args),
        },
    }


def follow_up_contexts(
    contexts: Sequence[Sequence[int]],
    records: Sequence[Mapping[str, Any]],
    follow_up: Sequence[int],
) -> list[list[int]]:
    """The next turn's contexts: each context, then what was generated in it, then the
    follow-up tokens."""
    return [
        [*map(int, c), *map(int, r["tokens"]), *map(int, follow_up)]
        for c, r in zip(contexts, records, strict=True)
    ]


def _generate(llm: Any, prompts: list[list[int]], spec: Mapping[str, Any], k: int) -> Any:
    """``spec["generate"]``: free generation with top-k logprobs (None without).

    With ``turns`` > 1, turn t + 1 feeds each prompt's turn-t context and answer back
    with the ``follow_up`` tokens (``follow_up_contexts``), in the same engine, so its
    prefill reads the earlier turns from the prefix cache (when on) and as chunked
    context. The records are turn-major (turn 1's prompts in order, then turn 2's);
    each holds its ``turn`` (from 1) and ``context`` (the token ids it continued).
    """
    from vllm import SamplingParams

    gen = spec.get("generate")
    if not gen:
        return None
    n = int(gen["max_tokens"])
    turns = int(gen.get("turns", 1))
    follow_up = [int(t) for t in gen.get("follow_up") or ()]
    seed = int(gen.get("seed", 0))
    contexts = prompts
    records: list[Any] = []
    for turn in range(1, turns + 1):
        of = f" (turn {turn} of {turns})" if turns > 1 else ""
        _phase(f"generating {n} tokens per prompt with top-{k} logprobs{of}")
        params = [
            SamplingParams(
                max_tokens=n,
                temperature=float(gen.get("temperature", 0.0)),
                seed=seed + (turn - 1) * len(prompts) + i,
                ignore_eos=bool(gen.get("ignore_eos", False)),
                logprobs=k,
                detokenize=False,
            )
            for i in range(len(prompts))
        ]
        inputs: list[Any] = [{"prompt_token_ids": c} for c in contexts]
        done = generated_topk(llm.generate(inputs, params, use_tqdm=False), contexts, k)
        for record, context in zip(done, contexts, strict=True):
            record["turn"] = turn
            record["context"] = list(context)
        records += done
        contexts = follow_up_contexts(contexts, done, follow_up)
    return records


def _score(llm: Any, spec: Mapping[str, Any], k: int) -> Any:
    """``spec["score"]`` (``{recipe: [[prompt, generated], ...]}``): the native top-k at
    each generated position of each recipe's sequences (None without)."""
    from vllm import SamplingParams

    score = spec.get("score")
    if not score:
        return None
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    out: dict[str, Any] = {}
    for name, pairs in score.items():
        _phase(f"scoring {name}'s generations")
        sequences = [[*map(int, p), *map(int, g)] for p, g in pairs]
        inputs: list[Any] = [{"prompt_token_ids": s} for s in sequences]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        out[name] = scored_topk(outputs, sequences, [len(g) for _, g in pairs], k)
    return out


def engine_settings(llm: Any, engine_args: Mapping[str, Any]) -> dict[str, Any]:
    """Prefix caching, chunked prefill and the token budget per step as the engine
    resolved them (vLLM's configuration where it exposes one, else what was asked;
    None: vLLM's default, not known)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    scheduler = getattr(config, "scheduler_config", None)
    cache = getattr(config, "cache_config", None)

    def read(obj: Any, attr: str, key: str) -> Any:
        value = getattr(obj, attr, None)
        return value if isinstance(value, (bool, int)) else engine_args.get(key)

    return {
        "enable_prefix_caching": read(cache, "enable_prefix_caching", "enable_prefix_caching"),
        "enable_chunked_prefill": read(
            scheduler, "enable_chunked_prefill", "enable_chunked_prefill"
        ),
        "max_num_batched_tokens": read(
            scheduler, "max_num_batched_tokens", "max_num_batched_tokens"
        ),
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
