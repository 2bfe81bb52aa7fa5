"""End-to-end check of MLA_QUANT in a real vLLM 0.33 engine on one CUDA GPU.

Builds a tiny DeepSeek-V2-style model locally (config only; weights initialised
from a seeded generator at a realistic scale, token ids instead of a tokenizer),
then runs ``vllm.LLM`` in one subprocess per configuration:

- TRITON_MLA and MLA_QUANT with no quantization, eager and with CUDA graphs:
  prompt logprobs (prefill, including a chunked-context prefill) and greedy
  generation logprobs (decode) must agree within ``--tol`` (default 0.05 nats),
  with identical generated tokens;
- MLA_QUANT with nvfp4 and fp8 recipes (eager and CUDA graphs): they run, and the
  eager runs report per-layer error statistics;
- calibration (``mla_vllm.calibrate``) and an nvfp4 run with the calibration file;
- in-place ``install``/``uninstall`` on a TRITON_MLA engine: uninstall restores
  the native logprobs exactly.

Exit code 0 when every check holds; 2 when no CUDA GPU or no vLLM 0.33.0 is there.
Usage: ``python tests-vllm-e2e/run_e2e.py [--out DIR] [--tol 0.05]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
SEED = 1234
LAYERS = 2
PROMPT_LENGTHS = (7, 33, 120, 300)  # 300 > max_num_batched_tokens: chunked context
MAX_TOKENS = 16
MAX_BATCHED_TOKENS = 128
CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "moe_intermediate_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 4096,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "first_k_dense_replace": LAYERS,  # dense MLPs only: no MoE kernels needed
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}

# name -> (attention backend, enforce_eager, mla_quant or None, action)
RUNS: dict[str, tuple[str, bool, Any, str]] = {
    "triton_eager": ("TRITON_MLA", True, None, "generate"),
    "quant_none_eager": ("MLA_QUANT", True, {}, "generate"),
    "triton_graphs": ("TRITON_MLA", False, None, "generate"),
    "quant_none_graphs": ("MLA_QUANT", False, {}, "generate"),
    "nvfp4_eager": (
        "MLA_QUANT",
        True,
        {"recipe": "nvfp4", "observe": {"enabled": True, "interval": 1}},
        "generate",
    ),
    "fp8_eager": (
        "MLA_QUANT",
        True,
        {"recipe": "fp8", "observe": {"enabled": True, "interval": 1}},
        "generate",
    ),
    "nvfp4_graphs": ("MLA_QUANT", False, {"recipe": "nvfp4"}, "generate"),
    "calibrate": ("MLA_QUANT", True, {}, "calibrate"),
    "nvfp4_calibrated": ("MLA_QUANT", True, "CALIBRATED", "generate"),
    "install_in_place": ("TRITON_MLA", True, None, "install"),
}


def fail(message: str, code: int = 1) -> None:
    print(f"vllm_e2e: FAIL: {message}", flush=True)
    sys.exit(code)


def preflight() -> None:
    """Exit 2 with a clear message unless a CUDA GPU and vLLM 0.33.0 are there."""
    try:
        import torch
    except ImportError:
        fail("torch is not installed", 2)
    if not torch.cuda.is_available():
        fail(
            "needs a CUDA GPU (torch.cuda.is_available() is False); this check does not run on CPU",
            2,
        )
    try:
        import vllm
    except ImportError as exc:
        fail(f"needs vLLM {VLLM_VERSION} ({exc})", 2)
    if vllm.__version__ != VLLM_VERSION:
        fail(f"needs vLLM {VLLM_VERSION}, found {vllm.__version__}", 2)
    try:
        import mla_triton.decode  # noqa: F401
        import mla_vllm.backend  # noqa: F401
    except ImportError as exc:
        fail(f"needs mla_vllm and mla_triton importable ({exc})", 2)


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(SEED)
    return [[rng.randrange(2, CONFIG["vocab_size"]) for _ in range(n)] for n in PROMPT_LENGTHS]


def init_weights(model: Any) -> None:
    """Seeded weights at a realistic scale: norms 1, matrices N(0, 1/fan_in)."""
    import torch
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    gen = torch.Generator(device="cpu").manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(1.0)
                continue
            fan_in = param.shape[-1] if param.dim() > 1 else 1
            scale = 1.0 if "embed" in name else fan_in**-0.5
            value = torch.randn(param.shape, generator=gen) * scale
            param.copy_(value.to(param.dtype))
        for module in model.modules():
            if isinstance(module, MLAAttention):  # W_UK_T / W_UV from the new kv_b_proj
                module.process_weights_after_loading(torch.bfloat16)


def ensure_registered() -> str:
    """Register MLA_QUANT: by vLLM's plugin loader when the package is installed (its
    entry point exists), else directly (packages on PYTHONPATH only, as on the lent GPU)."""
    from importlib.metadata import entry_points

    if any(
        e.value == "mla_vllm.plugin:register" for e in entry_points(group="vllm.general_plugins")
    ):
        return "entry point"
    from mla_vllm.plugin import register

    register()
    return "direct (no entry point installed)"


def run_one(name: str, out_dir: Path, model_dir: Path) -> dict[str, Any]:
    """One engine, one configuration; results as JSON-able data."""
    from vllm import LLM, SamplingParams

    import mla_vllm

    backend, eager, quant, action = RUNS[name]
    registered = ensure_registered()
    extra: dict[str, Any] = {}
    if quant == "CALIBRATED":
        quant = {
            "recipe": "nvfp4",
            "calibration": str(out_dir / "calibration.json"),
            "observe": {"enabled": True, "interval": 1},
        }
    if quant is not None:
        extra["mla_quant"] = quant
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        attention_backend=backend,
        enforce_eager=eager,
        additional_config=extra,
        max_model_len=1024,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        max_num_seqs=8,
        enable_chunked_prefill=True,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.25,
        seed=SEED,
    )
    llm.apply_model(init_weights)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, prompt_logprobs=0, ignore_eos=True
    )
    inputs = [{"prompt_token_ids": p} for p in prompts()]

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
            gen_lp = [
                lp[tok].logprob
                for tok, lp in zip(completion.token_ids, completion.logprobs or [], strict=True)
            ]
            results.append(
                {
                    "prompt_logprobs": prompt_lp,
                    "tokens": list(completion.token_ids),
                    "logprobs": gen_lp,
                }
            )
        return results

    result: dict[str, Any] = {
        "name": name,
        "backend": backend,
        "eager": eager,
        "quant": quant,
        "registered": registered,
    }
    start = time.time()
    if action == "calibrate":
        doc = mla_vllm.calibrate(llm, prompts(), output=out_dir / "calibration.json")
        result["calibration"] = doc
    elif action == "install":
        result["native"] = generate()
        mla_vllm.install(llm, {"recipe": "nvfp4"})
        result["installed"] = generate()
        mla_vllm.uninstall(llm)
        result["restored"] = generate()
    else:
        result["outputs"] = generate()
        if isinstance(quant, dict) and quant.get("observe", {}).get("enabled"):
            result["stats"] = mla_vllm.get_stats(llm)
    result["seconds"] = round(time.time() - start, 1)
    return result


def max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[float, float, bool]:
    """(max |Δ prompt logprob|, max |Δ generated logprob|, same generated tokens)."""
    prompt = gen = 0.0
    same = True
    for x, y in zip(a, b, strict=True):
        for p, q in zip(x["prompt_logprobs"], y["prompt_logprobs"], strict=True):
            if p is not None and q is not None:
                prompt = max(prompt, abs(p - q))
        same = same and x["tokens"] == y["tokens"]
        for p, q in zip(x["logprobs"], y["logprobs"], strict=False):
            gen = max(gen, abs(p - q))
    return prompt, gen, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("vllm-e2e-out"))
    parser.add_argument("--tol", type=float, default=0.05, help="max |Δ logprob| in nats")
    parser.add_argument("--only", nargs="*", default=None, help="run these configurations")
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_model", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    preflight()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args._child:
        result = run_one(args._child, out, args._model)
        (out / f"{args._child}.json").write_text(json.dumps(result, indent=1))
        return
    model_dir = Path(tempfile.mkdtemp(prefix="mla-e2e-model-"))
    (model_dir / "config.json").write_text(json.dumps(CONFIG, indent=1))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")  # in-process: apply_model works
    names = args.only or list(RUNS)
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        print(f"vllm_e2e: running {name} ...", flush=True)
        t0 = time.time()
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--out",
                str(out),
                "--_child",
                name,
                "--_model",
                str(model_dir),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(proc.stdout[-4000:] + proc.stderr[-8000:])
            fail(f"{name} exited {proc.returncode} (log: {out / (name + '.log')})")
        results[name] = json.loads((out / f"{name}.json").read_text())
        print(f"vllm_e2e: {name} done in {time.time() - t0:.0f} s", flush=True)

    failures: list[str] = []
    for native, quant in (
        ("triton_eager", "quant_none_eager"),
        ("triton_graphs", "quant_none_graphs"),
    ):
        if native in results and quant in results:
            p, g, same = max_diff(results[native]["outputs"], results[quant]["outputs"])
            ok = p <= args.tol and g <= args.tol and same
            print(
                f"vllm_e2e: {quant} vs {native}: max |Δ prompt logprob| {p:.4f}, "
                f"max |Δ generated logprob| {g:.4f}, same tokens {same} "
                f"(tol {args.tol}): {'ok' if ok else 'FAIL'}"
            )
            if not ok:
                failures.append(f"{quant} vs {native}")
    for name, result in results.items():
        for layer, paths in sorted(result.get("stats", {}).items()):
            for path, s in sorted(paths.items()):
                print(
                    f"vllm_e2e: {name} {layer} {path}: calls {s['calls']:.0f} rel_l2 mean "
                    f"{s['rel_l2_mean']:.4f} max {s['rel_l2_max']:.4f} cosine min "
                    f"{s['cosine_min']:.5f} max_abs {s['max_abs_max']:.4f}"
                )
        if name.startswith(("nvfp4", "fp8")) and not result.get("stats") and result["eager"]:
            failures.append(f"{name}: no per-layer statistics")
        for output in result.get("outputs", []):
            if any(not math.isfinite(x) for x in output["logprobs"]):
                failures.append(f"{name}: non-finite logprobs")
    if "install_in_place" in results:
        r = results["install_in_place"]
        p, g, same = max_diff(r["native"], r["restored"])
        changed = max_diff(r["native"], r["installed"])
        ok = p == 0.0 and g == 0.0 and same and (changed[0] > 0.0 or changed[1] > 0.0)
        print(
            f"vllm_e2e: install_in_place: nvfp4 changed logprobs by up to "
            f"{max(changed[0], changed[1]):.4f}; uninstall restored exactly: {p == g == 0.0}"
        )
        if not ok:
            failures.append("install_in_place")
    if "calibrate" in results:
        layers = results["calibrate"]["calibration"]["layers"]
        print(
            f"vllm_e2e: calibrate: {len(layers)} layers, "
            + "; ".join(f"{k}: {v}" for k, v in sorted(layers.items()))
        )
        if len(layers) != LAYERS:
            failures.append("calibrate: not every layer recorded")
    if failures:
        fail("; ".join(failures))
    print(f"vllm_e2e: {len(results)} configurations passed")


if __name__ == "__main__":
    main()
