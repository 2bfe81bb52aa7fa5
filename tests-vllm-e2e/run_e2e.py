"""End-to-end check of MLA_QUANT in a real vLLM 0.33 engine on one CUDA GPU.

Builds a tiny DeepSeek-V2-style model locally (config only; weights initialised
from a seeded generator at a realistic scale, token ids instead of a tokenizer),
then runs ``vllm.LLM`` in one subprocess per configuration (its own log, result
JSON and timeout; a failure does not stop the others):

- TRITON_MLA and MLA_QUANT with no quantization, eager and with CUDA graphs:
  prompt logprobs (prefill, including a chunked-context prefill) and greedy
  generation logprobs (decode) must agree within ``--tol`` (default 0.05 nats).
  Greedy tokens must be identical, except that a divergence at a near tie (the
  native top-2 margin within ``2 * tol``) is reported, not failed; generated
  logprobs are compared up to the first divergence;
- MLA_QUANT with nvfp4 and fp8 recipes (eager and CUDA graphs): they run, and the
  eager runs report per-layer error statistics;
- calibration (``mla_vllm.calibrate``) and an nvfp4 run with the calibration file;
- in-place ``install``/``uninstall`` on a TRITON_MLA engine: uninstall restores
  the native logprobs exactly.

``--out DIR`` receives ``<config>.log`` and ``<config>.json`` for every
configuration, ``calibration.json``, ``results.json`` (every run and check) and
``summary.txt`` (the table printed at the end). ``--jobs N`` runs N lanes of
configurations at once on the one GPU (each engine takes a fixed 1 GiB KV cache,
so their memory profiling cannot disturb each other); ``--deadline S`` stops
starting configurations (and cuts timeouts) so that everything ends within S
seconds. Exit code 0 when every check holds; 1 when a run or check fails; 2 when
no CUDA GPU or no vLLM 0.33.0 is there.

Usage: ``python tests-vllm-e2e/run_e2e.py [--out DIR] [--tol 0.05] [--jobs 3]
[--deadline 400] [--only NAME ...]``. On the lent H200 (packages on PYTHONPATH, no
entry point installed) the script registers ``MLA_QUANT`` itself in each engine
process; engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VLLM_VERSION = "0.33.0"
SEED = 1234
LAYERS = 2
PROMPT_LENGTHS = (7, 33, 120, 300)  # 300 > max_num_batched_tokens: chunked context
MAX_TOKENS = 16
MAX_BATCHED_TOKENS = 128
KV_CACHE_BYTES = 1 << 30  # fixed: no memory profiling between concurrent engines
VOCAB = 4096
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
    "vocab_size": VOCAB,
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
OBSERVE = {"enabled": True, "interval": 1}


@dataclass(frozen=True)
class Run:
    backend: str
    eager: bool
    quant: Any  # mla_quant object, None (no additional_config) or "CALIBRATED"
    action: str  # generate | calibrate | install
    timeout: float


RUNS: dict[str, Run] = {
    "triton_eager": Run("TRITON_MLA", True, None, "generate", 180),
    "quant_none_eager": Run("MLA_QUANT", True, {}, "generate", 180),
    "nvfp4_eager": Run("MLA_QUANT", True, {"recipe": "nvfp4", "observe": OBSERVE}, "generate", 180),
    "fp8_eager": Run("MLA_QUANT", True, {"recipe": "fp8", "observe": OBSERVE}, "generate", 180),
    "triton_graphs": Run("TRITON_MLA", False, None, "generate", 300),
    "quant_none_graphs": Run("MLA_QUANT", False, {}, "generate", 300),
    "nvfp4_graphs": Run("MLA_QUANT", False, {"recipe": "nvfp4"}, "generate", 300),
    "calibrate": Run("MLA_QUANT", True, {}, "calibrate", 180),
    "nvfp4_calibrated": Run("MLA_QUANT", True, "CALIBRATED", "generate", 180),
    "install_in_place": Run("TRITON_MLA", True, None, "install", 180),
}
# Configurations in one lane run one after another (a comparison's pair, a
# dependency); lanes run concurrently with --jobs > 1, in this order of priority.
LANES: tuple[tuple[str, ...], ...] = (
    ("triton_graphs", "quant_none_graphs", "nvfp4_graphs"),
    ("triton_eager", "quant_none_eager", "nvfp4_eager", "fp8_eager"),
    ("calibrate", "nvfp4_calibrated", "install_in_place"),
)
DEPENDS = {"nvfp4_calibrated": "calibrate"}
MIN_USEFUL_SECONDS = 40.0  # do not start a configuration with less time left


def fail(message: str, code: int = 1) -> None:
    print(f"vllm_e2e: FAIL: {message}", flush=True)
    sys.exit(code)


def preflight() -> dict[str, str]:
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
    return {"torch": torch.__version__, "vllm": vllm.__version__}


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(SEED)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def init_weights(model: Any) -> None:
    """Seeded weights at a realistic scale: norms 1, matrices N(0, 1/fan_in).

    Every parameter is written in place, and vLLM 0.33's ``replace_parameter``
    copies the recomputed W_UK_T / W_UV into the existing tensors, so CUDA graphs
    captured before this call replay with the new weights.
    """
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


def describe_layers(model: Any) -> dict[str, list[str]]:
    """Per MLA layer: its impl and prefill backend classes (which code really ran)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {
        m.layer_name: [type(m.impl).__name__, type(m.prefill_backend).__name__]
        for m in model.modules()
        if isinstance(m, MLAAttention)
    }


def ensure_registered() -> str:
    """Register MLA_QUANT in this (engine) process.

    Installed packages have the ``vllm.general_plugins`` entry point, which vLLM
    runs itself; with the packages only on PYTHONPATH (the lent GPU) there is no
    dist-info and so no entry point. The engine runs in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one GPU: in-process executor), so
    registering here reaches it either way; ``register`` is re-entrant.
    """
    from importlib.metadata import entry_points

    from mla_vllm.plugin import register

    found = any(
        e.value == "mla_vllm.plugin:register" for e in entry_points(group="vllm.general_plugins")
    )
    register()
    return "entry point installed; registered directly too" if found else "registered directly"


def run_one(name: str, out_dir: Path, model_dir: Path) -> dict[str, Any]:
    """One engine, one configuration; results as JSON-able data."""
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    import mla_vllm

    run = RUNS[name]
    registered = ensure_registered()
    quant = run.quant
    if quant == "CALIBRATED":
        quant = {
            "recipe": "nvfp4",
            "calibration": str(out_dir / "calibration.json"),
            "observe": OBSERVE,
        }
    extra: dict[str, Any] = {} if quant is None else {"mla_quant": quant}
    t0 = time.time()
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
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
    )
    engine_seconds = time.time() - t0
    llm.apply_model(init_weights)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2, prompt_logprobs=0, ignore_eos=True
    )
    inputs: list[Any] = [{"prompt_token_ids": p} for p in prompts()]

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
    result: dict[str, Any] = {
        "name": name,
        "backend": run.backend,
        "eager": run.eager,
        "quant": quant,
        "registered": registered,
        "cudagraph_mode": str(mode),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "gpu": torch.cuda.get_device_name(),
        "engine_seconds": round(engine_seconds, 1),
        "layers": llm.apply_model(describe_layers)[0],
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
    result["work_seconds"] = round(time.time() - start, 1)
    return result


# ----------------------------------------------------------------------------- parent


@dataclass
class Outcome:
    name: str
    status: str  # ok | error | timeout | skipped
    seconds: float
    detail: str = ""


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: apply_model, registration
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no FlashInfer on the lent GPU
    env.setdefault("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_child(
    name: str, out: Path, model_dir: Path, deadline: float, results: dict[str, Any]
) -> Outcome:
    """Run one configuration in its own process (group), with its own timeout."""
    dep = DEPENDS.get(name)
    if dep is not None and dep not in results:
        return Outcome(name, "skipped", 0.0, f"needs {dep}, which did not succeed")
    left = deadline - time.time()
    if left < MIN_USEFUL_SECONDS:
        return Outcome(name, "skipped", 0.0, f"deadline: {left:.0f} s left")
    timeout = min(RUNS[name].timeout, left)
    log = out / f"{name}.log"
    result_file = out / f"{name}.json"
    result_file.unlink(missing_ok=True)
    t0 = time.time()
    cmd = [
        sys.executable,
        __file__,
        "--out",
        str(out),
        "--_child",
        name,
        "--_model",
        str(model_dir),
    ]
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, env=_child_env(), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return Outcome(name, "timeout", time.time() - t0, f"killed after {timeout:.0f} s")
    seconds = time.time() - t0
    if code != 0 or not result_file.is_file():
        return Outcome(name, "error", seconds, f"exit code {code}")
    results[name] = json.loads(result_file.read_text())
    return Outcome(name, "ok", seconds)


def max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 0.0) -> dict[str, Any]:
    """Prompt and generated logprob differences of two runs on the same prompts.

    Generated logprobs are compared up to each prompt's first token divergence; a
    divergence is a near tie when ``a``'s top-2 margin there is within ``2 * tol``.
    """
    prompt_max = prompt_sum = gen_max = 0.0
    prompt_n = 0
    divergences: list[dict[str, Any]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for p, q in zip(x["prompt_logprobs"], y["prompt_logprobs"], strict=True):
            if p is not None and q is not None:
                prompt_max = max(prompt_max, abs(p - q))
                prompt_sum += abs(p - q)
                prompt_n += 1
        for step, (t, u) in enumerate(zip(x["tokens"], y["tokens"], strict=True)):
            if t != u:
                top = x.get("top2", [])
                margin = (
                    top[step][0][1] - top[step][1][1]
                    if step < len(top) and len(top[step]) > 1
                    else math.inf
                )
                divergences.append({"prompt": i, "step": step, "margin": margin})
                break
            gen_max = max(gen_max, abs(x["logprobs"][step] - y["logprobs"][step]))
    near_ties = all(d["margin"] <= 2 * tol for d in divergences)
    return {
        "prompt_max": prompt_max,
        "prompt_mean": prompt_sum / max(1, prompt_n),
        "gen_max": gen_max,
        "same_tokens": not divergences,
        "divergences": divergences,
        "divergences_near_ties": near_ties,
    }


def _finite(result: dict[str, Any]) -> bool:
    for key in ("outputs", "native", "installed", "restored"):
        for output in result.get(key, []):
            values = output["logprobs"] + [v for v in output["prompt_logprobs"] if v is not None]
            if any(not math.isfinite(v) for v in values):
                return False
    return True


def evaluate(results: dict[str, Any], tol: float) -> tuple[list[dict[str, Any]], list[str]]:
    """Every check as ``{check, ok, value}``, and the report's lines."""
    checks: list[dict[str, Any]] = []
    lines: list[str] = []

    def check(label: str, ok: bool, value: str) -> None:
        checks.append({"check": label, "ok": ok, "value": value})
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {label}: {value}")

    for native, quant in (
        ("triton_eager", "quant_none_eager"),
        ("triton_graphs", "quant_none_graphs"),
    ):
        if native in results and quant in results:
            d = max_diff(results[native]["outputs"], results[quant]["outputs"], tol)
            ok = d["prompt_max"] <= tol and d["gen_max"] <= tol and d["divergences_near_ties"]
            tokens = (
                "identical"
                if d["same_tokens"]
                else "diverge at "
                + ", ".join(
                    f"prompt {v['prompt']} step {v['step']} (native top-2 margin {v['margin']:.4f})"
                    for v in d["divergences"]
                )
            )
            check(
                f"{quant} vs {native} (tol {tol} nats)",
                ok,
                f"max |Δ prompt logprob| {d['prompt_max']:.4f} (mean {d['prompt_mean']:.5f}), "
                f"max |Δ generated logprob| {d['gen_max']:.4f}, greedy tokens {tokens}",
            )
    for name, native in (
        ("nvfp4_eager", "triton_eager"),
        ("fp8_eager", "triton_eager"),
        ("nvfp4_calibrated", "triton_eager"),
        ("nvfp4_graphs", "triton_graphs"),
    ):
        if name in results and native in results:
            d = max_diff(results[native]["outputs"], results[name]["outputs"])
            lines.append(
                f"  [info] {name} vs {native}: max |Δ prompt logprob| {d['prompt_max']:.4f} "
                f"(mean {d['prompt_mean']:.5f}), max |Δ generated logprob| "
                f"{d['gen_max']:.4f} before the first divergence, greedy tokens "
                + ("identical" if d["same_tokens"] else f"{len(d['divergences'])} of 4 diverge")
            )
    for name in [n for n in RUNS if n in results]:
        result = results[name]
        problems = [] if _finite(result) else ["non-finite logprobs"]
        impls = sorted({v[0] for v in result.get("layers", {}).values()})
        if result["backend"] == "MLA_QUANT" and impls != ["MLAQuantImpl"]:
            problems.append(f"impls {impls}, expected MLAQuantImpl")
        stats = result.get("stats")
        what = f"finite logprobs, impl {'/'.join(impls)}"
        if name.startswith(("nvfp4", "fp8")) and result["eager"]:
            paths = [set(v) for v in (stats or {}).values()]
            if len(paths) != LAYERS or not all({"prefill", "decode"} <= p for p in paths):
                problems.append(f"per-layer statistics for {len(paths)} layers")
            what += f", prefill and decode statistics of {LAYERS} layers"
        check(f"{name}: {what}", not problems, "; ".join(problems) or "yes")
        for layer, per_path in sorted((stats or {}).items()):
            for path, s in sorted(per_path.items()):
                lines.append(
                    f"  [stats] {name} {layer} {path}: calls {s['calls']:.0f}, rel_l2 mean "
                    f"{s['rel_l2_mean']:.4f} max {s['rel_l2_max']:.4f}, cosine mean "
                    f"{s['cosine_mean']:.5f} min {s['cosine_min']:.5f}, max_abs mean "
                    f"{s['max_abs_mean']:.4f} max {s['max_abs_max']:.4f}"
                )
    if "install_in_place" in results:
        r = results["install_in_place"]
        back = max_diff(r["native"], r["restored"])
        changed = max_diff(r["native"], r["installed"])
        exact = back["prompt_max"] == 0.0 and back["gen_max"] == 0.0 and back["same_tokens"]
        moved = max(changed["prompt_max"], changed["gen_max"])
        installed = sorted({v[0] for v in r.get("installed_layers", {}).values()})
        restored = sorted({v[0] for v in r.get("restored_layers", {}).values()})
        check(
            "install_in_place: nvfp4 installed, uninstall restores exactly",
            exact and moved > 0.0 and installed == ["MLAQuantImpl"],
            f"installed impls {installed}, nvfp4 moved logprobs by up to {moved:.4f}; "
            f"restored impls {restored}, max |Δ| after uninstall "
            f"{max(back['prompt_max'], back['gen_max']):.1e}, tokens identical "
            f"{back['same_tokens']}",
        )
    if "calibrate" in results:
        layers = results["calibrate"]["calibration"]["layers"]
        ok = len(layers) == LAYERS and all(
            set(p) == {"prefill", "decode"} and all(set(r) == {"q", "k", "v"} for r in p.values())
            for p in layers.values()
        )
        check(f"calibrate: q, k, v amax of both paths for {LAYERS} layers", ok, f"{len(layers)}")
        for layer, per_path in sorted(layers.items()):
            for path, roles in sorted(per_path.items()):
                amax = ", ".join(f"{k} {v:.3f}" for k, v in sorted(roles.items()))
                lines.append(f"  [calibration] {layer} {path}: {amax}")
    return checks, lines


def run_lanes(
    names: list[str], out: Path, model_dir: Path, jobs: int, deadline: float
) -> tuple[dict[str, Any], list[Outcome]]:
    results: dict[str, Any] = {}
    outcomes: list[Outcome] = []
    lanes = [[n for n in lane if n in names] for lane in LANES]
    lanes = [lane for lane in lanes if lane]
    lock = threading.Lock()

    def worker(index: int) -> None:
        time.sleep(3.0 * index)  # stagger the engines' start (ports, compile caches)
        while True:
            with lock:
                if not lanes:
                    return
                lane = lanes.pop(0)
            for name in lane:
                print(f"vllm_e2e: {time.strftime('%H:%M:%S')} start {name}", flush=True)
                outcome = run_child(name, out, model_dir, deadline, results)
                with lock:
                    outcomes.append(outcome)
                extra = f" ({outcome.detail})" if outcome.detail else ""
                print(
                    f"vllm_e2e: {time.strftime('%H:%M:%S')} {name}: {outcome.status} "
                    f"in {outcome.seconds:.0f} s{extra}",
                    flush=True,
                )

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(max(1, jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = {n: i for i, n in enumerate(RUNS)}
    outcomes.sort(key=lambda o: order[o.name])
    return results, outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("vllm-e2e-out"))
    parser.add_argument("--tol", type=float, default=0.05, help="max |Δ logprob| in nats")
    parser.add_argument("--only", nargs="*", default=None, help="run these configurations")
    parser.add_argument("--jobs", type=int, default=1, help="lanes of configurations at once")
    parser.add_argument(
        "--deadline", type=float, default=None, help="end everything within this many seconds"
    )
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_model", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out: Path = args.out
    if args._child:
        out.mkdir(parents=True, exist_ok=True)
        try:
            result = run_one(args._child, out, args._model)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        (out / f"{args._child}.json").write_text(json.dumps(result, indent=1))
        print(f"vllm_e2e child {args._child}: done", flush=True)
        os._exit(0)  # skip the engine's teardown: the process is done
    unknown = sorted(set(args.only or []) - set(RUNS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; expected some of {list(RUNS)}")
    started = time.time()
    versions = preflight()
    deadline = started + (args.deadline if args.deadline is not None else 24 * 3600.0)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="mla-e2e-model-"))
    (model_dir / "config.json").write_text(json.dumps(CONFIG, indent=1))
    names = [n for n in RUNS if args.only is None or n in args.only]
    print(
        f"vllm_e2e: {len(names)} configurations, {args.jobs} at once, tol {args.tol} nats, "
        f"out {out}",
        flush=True,
    )
    results, outcomes = run_lanes(names, out, model_dir, args.jobs, deadline)
    checks, lines = evaluate(results, args.tol)
    runs_ok = all(o.status == "ok" for o in outcomes)
    passed = runs_ok and all(c["ok"] for c in checks)

    report = [
        f"vllm_e2e summary: torch {versions['torch']}, vllm {versions['vllm']}, "
        f"{len(outcomes)} configurations in {time.time() - started:.0f} s (--jobs {args.jobs})",
        "runs:",
    ]
    for o in outcomes:
        r = results.get(o.name, {})
        info = ""
        if r:
            info = (
                f"; engine start {r.get('engine_seconds', 0):.0f} s, cudagraph_mode "
                f"{r.get('cudagraph_mode')}, {r.get('registered')}"
            )
        detail = f" ({o.detail})" if o.detail else ""
        report.append(f"  {o.name:18s} {o.status:8s} {o.seconds:5.0f} s{detail}{info}")
    report.append("checks:")
    report += lines
    report.append(f"vllm_e2e: {'PASS' if passed else 'FAIL'}")
    failures = [o for o in outcomes if o.status in ("error", "timeout")]
    for o in failures:
        tail = _tail(out / f"{o.name}.log")
        print(f"---- last lines of {o.name}.log ({o.status}) ----\n{tail}")
    text = "\n".join(report)
    (out / "summary.txt").write_text(text + "\n")
    (out / "results.json").write_text(
        json.dumps(
            {
                "versions": versions,
                "tol": args.tol,
                "runs": [dict(o.__dict__, seconds=round(o.seconds, 1)) for o in outcomes],
                "checks": checks,
                "passed": passed,
            },
            indent=1,
        )
    )
    print(text, flush=True)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
