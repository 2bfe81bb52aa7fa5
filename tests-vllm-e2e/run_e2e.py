"""End-to-end check of MLA_QUANT in a real vLLM 0.33 engine on CUDA GPUs.

Builds a tiny DeepSeek-V2-style model locally: a config and a real safetensors
checkpoint of seeded weights at a realistic scale (every full tensor drawn from a
generator seeded by its name, so the weights do not depend on the tensor-parallel
size: vLLM's own weight loaders shard them), token ids instead of a tokenizer.
Then it runs ``vllm.LLM`` in one subprocess per configuration (its own log,
result JSON and timeout; a failure does not stop the others):

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

``--tp N`` runs the engines at ``tensor_parallel_size=N`` (vLLM's multiprocess
executor: one worker process per GPU, started with ``spawn``, so MLA_QUANT must
be registered there through its ``vllm.general_plugins`` entry point: install the
packages' wheels, see docs/tensor-parallel.md). With N > 1 the default set is the
six TRITON_MLA / none / nvfp4 runs (eager and graphs) plus three configurations
that must fail in the workers with an error that reaches this process naming the
layer or the field. Each result records what every worker process saw (its pid,
rank, local heads, registration, the ``mla_quant`` config and each layer's
resolved recipe). ``--compare-tp A,B`` compares two result folders (say TP=1 and
TP=2): logprobs, per-layer statistics and recipes, within stated bounds; it needs
no GPU and writes ``tp_compare.txt`` / ``tp_compare.json`` into ``--out``.

``--out DIR`` receives ``<config>.log`` and ``<config>.json`` for every
configuration, ``calibration.json``, ``results.json`` (every run and check) and
``summary.txt`` (the table printed at the end). ``--jobs N`` runs N lanes of
configurations at once (each engine takes a fixed 1 GiB KV cache, so their memory
profiling cannot disturb each other; at TP=1 with several GPUs visible, lane i
runs on GPU i mod count); ``--deadline S`` stops starting configurations (and
cuts timeouts) so that everything ends within S seconds. Exit code 0 when every
check holds; 1 when a run or check fails; 2 when no CUDA GPU (or fewer than
``--tp``), no vLLM 0.33.0, or (TP > 1) no installed entry point is there.

Usage: ``python tests-vllm-e2e/run_e2e.py [--out DIR] [--tol 0.05] [--jobs 3]
[--deadline 400] [--tp 1] [--only NAME ...]``, or ``--compare-tp A,B``. Engines
run in this script's child process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's
in-process engine core, whose executor starts the TP workers), which also
registers ``MLA_QUANT`` itself; at TP=1 that is enough (no worker processes).
"""

from __future__ import annotations

import argparse
import hashlib
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
import zlib
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
    action: str  # generate | calibrate | install | expect_error
    timeout: float


RUNS: dict[str, Run] = {
    "triton_eager": Run("TRITON_MLA", True, None, "generate", 180),
    "quant_none_eager": Run("MLA_QUANT", True, {}, "generate", 180),
    "nvfp4_eager": Run("MLA_QUANT", True, {"recipe": "nvfp4", "observe": OBSERVE}, "generate", 180),
    "fp8_eager": Run("MLA_QUANT", True, {"recipe": "fp8", "observe": OBSERVE}, "generate", 180),
    "triton_graphs": Run("TRITON_MLA", False, None, "generate", 300),
    "quant_none_graphs": Run("MLA_QUANT", False, {}, "generate", 300),
    "nvfp4_graphs": Run("MLA_QUANT", False, {"recipe": "nvfp4"}, "generate", 300),
    # The write-once shadow KV path (issue 8): the same function as on-read decode.
    "nvfp4_shadow_eager": Run(
        "MLA_QUANT",
        True,
        {"recipe": "nvfp4", "kv_path": "shadow", "observe": OBSERVE},
        "generate",
        180,
    ),
    "nvfp4_shadow_graphs": Run(
        "MLA_QUANT", False, {"recipe": "nvfp4", "kv_path": "shadow"}, "generate", 300
    ),
    "calibrate": Run("MLA_QUANT", True, {}, "calibrate", 180),
    "nvfp4_calibrated": Run("MLA_QUANT", True, "CALIBRATED", "generate", 180),
    "install_in_place": Run("TRITON_MLA", True, None, "install", 180),
    # Must fail inside the TP workers; the error must reach this process (see EXPECT).
    # A layer override whose pattern matches no layer: known only once the workers
    # have built the model, raised when the metadata builder binds the layers.
    "tp_error_bind": Run(
        "MLA_QUANT",
        True,
        {"recipe": "nvfp4", "layers": [{"pattern": "model.layers.9.*", "v": "fp8"}]},
        "expect_error",
        200,
    ),
    # Valid schema, but layer 1 alone gets a static P amax below 1, which the
    # prefill kernel refuses (SPEC 4) at that layer's first prefill.
    "tp_error_layer": Run(
        "MLA_QUANT",
        True,
        {
            "recipe": "nvfp4",
            "layers": [{"pattern": "model.layers.1.*", "p": {"format": "nvfp4", "amax": 0.5}}],
        },
        "expect_error",
        200,
    ),
    # A schema error: raised while each worker builds the model (before it reports
    # ready), so vLLM's parent only says that a worker failed to start.
    "tp_error_schema": Run("MLA_QUANT", True, {"recipe": "nvfp5"}, "expect_error", 200),
}
# What an expected failure must show: substrings of the exception raised in this
# process by LLM()/generate ("message", its causes included) and of the child's log
# ("log": the workers inherit its stdout/stderr, as they share a user's console).
EXPECT: dict[str, dict[str, tuple[str, ...]]] = {
    "tp_error_bind": {
        "message": ("mla_quant.layers[0].pattern", "model.layers.0.self_attn.attn"),
        "log": ("mla_quant.layers[0].pattern",),
    },
    "tp_error_layer": {
        "message": ("model.layers.1.self_attn.attn", "P's static amax"),
        "log": ("model.layers.1.self_attn.attn",),
    },
    "tp_error_schema": {"message": (), "log": ("additional_config.mla_quant.recipe",)},
}
# The default set at TP > 1, and the set a TP=1 reference run for --compare-tp takes.
TP_RUNS = (
    "triton_eager",
    "quant_none_eager",
    "nvfp4_eager",
    "triton_graphs",
    "quant_none_graphs",
    "nvfp4_graphs",
)
TP_DEFAULT = (*TP_RUNS, "tp_error_bind", "tp_error_layer", "tp_error_schema")
# Configurations in one lane run one after another (a comparison's pair, a
# dependency); lanes run concurrently with --jobs > 1, in this order of priority.
LANES: tuple[tuple[str, ...], ...] = (
    ("triton_graphs", "quant_none_graphs", "nvfp4_graphs", "nvfp4_shadow_graphs"),
    ("triton_eager", "quant_none_eager", "nvfp4_eager", "fp8_eager"),
    ("calibrate", "nvfp4_calibrated", "install_in_place", "nvfp4_shadow_eager"),
)
LANES_TP: tuple[tuple[str, ...], ...] = (
    ("triton_graphs", "quant_none_graphs"),
    ("triton_eager", "quant_none_eager", "nvfp4_eager"),
    ("nvfp4_graphs", "tp_error_schema"),
    ("tp_error_bind", "tp_error_layer"),
    ("fp8_eager", "calibrate", "nvfp4_calibrated", "install_in_place"),
)
DEPENDS = {"nvfp4_calibrated": "calibrate"}
MIN_USEFUL_SECONDS = 40.0  # do not start a configuration with less time left


def fail(message: str, code: int = 1) -> None:
    print(f"vllm_e2e: FAIL: {message}", flush=True)
    sys.exit(code)


def preflight(tp: int = 1) -> dict[str, str]:
    """Exit 2 with a clear message unless ``tp`` CUDA GPUs and vLLM 0.33.0 are there.

    At ``tp > 1`` the workers are separate processes that register ``MLA_QUANT``
    only through the ``vllm.general_plugins`` entry point: it must be installed.
    """
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
    count = torch.cuda.device_count()
    if count < tp:
        fail(f"--tp {tp} needs {tp} CUDA GPUs, found {count}", 2)
    if tp > 1 and entry_point() is None:
        fail(
            f"--tp {tp}: vLLM's worker processes register MLA_QUANT only through the "
            "'vllm.general_plugins' entry point, and none is installed (packages on "
            "PYTHONPATH have no dist-info). Install the wheels, e.g. `python3 -m pip "
            "install --no-deps --no-index --target /tmp/mla-site .e2e-pin/wheels/*.whl` "
            "and put /tmp/mla-site first on PYTHONPATH (docs/tensor-parallel.md)",
            2,
        )
    return {"torch": torch.__version__, "vllm": vllm.__version__, "gpus": str(count)}


def entry_point() -> str | None:
    """Where the ``mla_vllm.plugin:register`` entry point comes from, if installed."""
    from importlib.metadata import entry_points

    for e in entry_points(group="vllm.general_plugins"):
        if e.value == "mla_vllm.plugin:register":
            dist = getattr(e, "dist", None)
            return str(getattr(dist, "_path", None) or getattr(dist, "name", "?"))
    return None


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(SEED)
    return [[rng.randrange(2, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def checkpoint_shapes(config: dict[str, Any] = CONFIG) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's Hugging Face checkpoint (DeepSeek-V2 names), full size.

    ``q_lora_rank`` is None (a plain ``q_proj``) and every MLP is dense. vLLM 0.33's
    ``DeepseekV2ForCausalLM.load_weights`` maps these names onto its parameters and
    each parameter's weight loader takes the rank's shard: ``q_proj`` and
    ``kv_b_proj`` (ColumnParallelLinear) by output rows, i.e. by heads; ``o_proj``
    and ``down_proj`` (RowParallelLinear) by input columns; ``gate_proj`` and
    ``up_proj`` into the merged column-parallel ``gate_up_proj``;
    ``kv_a_proj_with_mqa`` and the norms replicated; ``embed_tokens`` and
    ``lm_head`` by vocabulary rows.
    """
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    nope, rope = int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"])
    rank, v = int(config["kv_lora_rank"]), int(config["v_head_dim"])
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(int(config["num_hidden_layers"])):
        at = f"model.layers.{i}"
        shapes |= {
            f"{at}.input_layernorm.weight": (hidden,),
            f"{at}.self_attn.q_proj.weight": (heads * (nope + rope), hidden),
            f"{at}.self_attn.kv_a_proj_with_mqa.weight": (rank + rope, hidden),
            f"{at}.self_attn.kv_a_layernorm.weight": (rank,),
            f"{at}.self_attn.kv_b_proj.weight": (heads * (nope + v), rank),
            f"{at}.self_attn.o_proj.weight": (hidden, heads * v),
            f"{at}.post_attention_layernorm.weight": (hidden,),
            f"{at}.mlp.gate_proj.weight": (inter, hidden),
            f"{at}.mlp.up_proj.weight": (inter, hidden),
            f"{at}.mlp.down_proj.weight": (hidden, inter),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def seeded_tensor(name: str, shape: tuple[int, ...]) -> Any:
    """The full tensor ``name``: norms 1, embeddings N(0, 1), matrices N(0, 1/fan_in).

    Drawn from a generator seeded by ``SEED`` and the name alone (not by the order
    of the parameters or by a rank's shard), in float32, then rounded to bfloat16.
    """
    import torch

    if "norm" in name:
        return torch.ones(shape, dtype=torch.bfloat16)
    gen = torch.Generator(device="cpu").manual_seed(SEED * 1_000_003 + zlib.crc32(name.encode()))
    scale = 1.0 if "embed" in name else shape[-1] ** -0.5
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


def write_checkpoint(model_dir: Path, config: dict[str, Any] = CONFIG) -> str:
    """``config.json`` and ``model.safetensors`` of the seeded weights; the file's sha256."""
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    tensors = {
        name: seeded_tensor(name, shape) for name, shape in checkpoint_shapes(config).items()
    }
    path = model_dir / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe_layers(model: Any) -> dict[str, list[str]]:
    """Per MLA layer: its impl and prefill backend classes (which code really ran)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {
        m.layer_name: [type(m.impl).__name__, type(m.prefill_backend).__name__]
        for m in model.modules()
        if isinstance(m, MLAAttention)
    }


def describe_shadows(model: Any) -> dict[str, Any]:
    """Per MLA layer: its shadow KV storage and cache row width (None: on-read decode)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return {
        m.layer_name: _shadow_info(m.impl, m)
        for m in model.modules()
        if isinstance(m, MLAAttention)
    }


def probe_worker(model: Any) -> dict[str, Any]:
    """What one worker process sees: pid, TP rank, registration, config, per-layer recipe."""
    import os as _os

    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:
        registered = AttentionBackendEnum["MLA_QUANT"].get_class().__name__
    except Exception as exc:  # not registered in this process
        registered = f"not registered ({type(exc).__name__}: {exc})"
    layers: dict[str, Any] = {}
    for m in model.modules():
        if not isinstance(m, MLAAttention):
            continue
        impl = m.impl
        config = getattr(impl, "_vllm_config", None)
        extra = getattr(config, "additional_config", None) or {}
        state = getattr(impl, "mla_layer", None)
        layers[m.layer_name] = {
            "impl": type(impl).__name__,
            "num_heads": int(getattr(impl, "num_heads", -1)),
            "mla_quant": extra.get("mla_quant") if isinstance(extra, dict) else None,
            "recipe": None if state is None else repr(state.recipe),
            # the shadow KV path: what the layer stores, and the cache row it got
            "shadow": _shadow_info(impl, m),
        }
    from importlib.metadata import entry_points

    found = [
        str(getattr(getattr(e, "dist", None), "_path", "?"))
        for e in entry_points(group="vllm.general_plugins")
        if e.value == "mla_vllm.plugin:register"
    ]
    return {
        "pid": _os.getpid(),
        "tp_rank": get_tensor_model_parallel_rank(),
        "entry_point": found[0] if found else None,
        "registered": registered,
        "layers": layers,
    }


def _shadow_info(impl: Any, layer: Any) -> dict[str, Any] | None:
    """The layer's shadow (storage, bytes per token) and its cache row width; None: on-read."""
    shadow = getattr(impl, "mla_shadow", None)
    if shadow is None:
        return None
    cache = getattr(layer, "kv_cache", None)
    return {
        "storage": shadow.storage,
        "token_bytes": int(shadow.layout.token_bytes),
        "cache_row_bytes": None
        if cache is None or cache.dim() == 0 or cache.numel() == 0
        else int(cache.shape[-1] * cache.element_size()),
    }


def ensure_registered(tp: int = 1) -> str:
    """Register MLA_QUANT in this (engine) process; at ``tp > 1`` require the entry point.

    Installed packages have the ``vllm.general_plugins`` entry point, which vLLM
    runs itself in every process; with the packages only on PYTHONPATH there is no
    dist-info and so no entry point. At TP=1 the engine and its one worker run in
    this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: in-process engine core and
    executor), so registering here reaches it either way; ``register`` is
    re-entrant. At TP > 1 the workers are spawned processes: only the entry point
    reaches them.
    """
    from mla_vllm.plugin import register

    found = entry_point()
    if tp > 1 and found is None:
        raise RuntimeError(
            "no 'vllm.general_plugins' entry point for mla_vllm: TP workers could not "
            "register MLA_QUANT (install the wheels: docs/tensor-parallel.md)"
        )
    register()
    if found is None:
        return "registered directly"
    return f"entry point {found}; registered directly too"


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


# NVLink multicast stays off on the lent multi-GPU machines (device KINDS.md), and
# vLLM's symmetric-memory all-reduce with it; set in every child, whatever the caller.
MULTI_GPU_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}


def _child_env(gpu: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: apply_model
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # apply_model's functions, if pickled
    env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # TP workers: fresh processes, no fork
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # no FlashInfer on the lent GPU
    env.setdefault("PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(MULTI_GPU_ENV)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def run_child(
    name: str,
    out: Path,
    model_dir: Path,
    deadline: float,
    results: dict[str, Any],
    tp: int = 1,
    gpu: str | None = None,
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
        "--tp",
        str(tp),
    ]
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd, env=_child_env(gpu), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
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


def check_workers(result: dict[str, Any], tp: int) -> list[str]:
    """Problems with what the worker processes saw (empty: none).

    ``tp`` distinct worker processes with ranks 0..tp-1, other than the engine's
    process at TP > 1; each layer with ``heads / tp`` local heads; for MLA_QUANT:
    registered in every worker, the ``mla_quant`` config there equal to the one
    given, and every layer's resolved recipe bound and identical on every rank.
    """
    workers = result.get("workers") or []
    problems: list[str] = []
    if len(workers) != tp:
        return [f"{len(workers)} worker replies, expected {tp}"]
    pids = {w["pid"] for w in workers}
    if len(pids) != tp:
        problems.append(f"worker pids {sorted(pids)}: not {tp} distinct processes")
    if tp > 1 and result.get("engine_pid") in pids:
        problems.append("a worker ran in the engine's process")
    if sorted(w["tp_rank"] for w in workers) != list(range(tp)):
        problems.append(f"TP ranks {[w['tp_rank'] for w in workers]}")
    heads = int(CONFIG["num_attention_heads"]) // tp
    recipes: dict[str, set[str | None]] = {}
    for w in workers:
        where = f"rank {w['tp_rank']}"
        if len(w["layers"]) != LAYERS:
            problems.append(f"{where}: {len(w['layers'])} MLA layers")
        for layer, info in w["layers"].items():
            if info["num_heads"] != heads:
                problems.append(f"{where} {layer}: {info['num_heads']} local heads, not {heads}")
            if result["backend"] != "MLA_QUANT":
                continue
            if info["impl"] != "MLAQuantImpl":
                problems.append(f"{where} {layer}: impl {info['impl']}")
            if info["mla_quant"] != result["quant"]:
                problems.append(f"{where} {layer}: mla_quant {info['mla_quant']!r} in the worker")
            recipes.setdefault(layer, set()).add(info["recipe"])
        if result["backend"] == "MLA_QUANT" and w["registered"] != "MLAQuantBackend":
            problems.append(f"{where}: MLA_QUANT {w['registered']}")
    for layer, seen in sorted(recipes.items()):
        if None in seen or len(seen) != 1:
            problems.append(
                f"{layer}: recipes differ between ranks or unbound: {sorted(map(str, seen))}"
            )
    return problems


def check_error(name: str, result: dict[str, Any], log: str) -> list[str]:
    """Problems with an expected failure: it must raise, and say what ``EXPECT`` lists."""
    if not result.get("raised"):
        return ["the engine started and generated: no error raised"]
    expect = EXPECT.get(name, {})
    problems = [
        f"the raised error does not mention {text!r}"
        for text in expect.get("message", ())
        if text not in result.get("message", "")
    ]
    problems += [
        f"the log does not mention {text!r}" for text in expect.get("log", ()) if text not in log
    ]
    return problems


def evaluate(
    results: dict[str, Any], tol: float, out: Path | None = None, tp: int = 1
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every check as ``{check, ok, value}``, and the report's lines."""
    checks: list[dict[str, Any]] = []
    lines: list[str] = []

    def check(label: str, ok: bool, value: str) -> None:
        checks.append({"check": label, "ok": ok, "value": value})
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {label}: {value}")

    for native, quant in (
        ("triton_eager", "quant_none_eager"),
        ("triton_graphs", "quant_none_graphs"),
        # same recipe through the shadow KV path: the same function as on-read
        ("nvfp4_eager", "nvfp4_shadow_eager"),
        ("nvfp4_graphs", "nvfp4_shadow_graphs"),
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
        if RUNS[name].action == "expect_error":
            log = (out / f"{name}.log").read_text(errors="replace") if out is not None else ""
            problems = check_error(name, result, log)
            first = result.get("message", "").splitlines()[:1] or ["(none)"]
            check(
                f"{name}: fails in the workers, naming what is wrong",
                not problems,
                "; ".join(problems) or f"yes: {first[0][:300]}",
            )
            continue
        problems = [] if _finite(result) else ["non-finite logprobs"]
        per_rank = result.get("layers_per_rank") or [result.get("layers", {})]
        impls = sorted({v[0] for rank in per_rank for v in rank.values()})
        if result["backend"] == "MLA_QUANT" and impls != ["MLAQuantImpl"]:
            problems.append(f"impls {impls}, expected MLAQuantImpl")
        stats = result.get("stats")
        what = f"finite logprobs, impl {'/'.join(impls)}"
        if tp > 1:
            problems += check_workers(result, tp)
            what += f", {tp} worker processes with the config and recipes"
        quant = RUNS[name].quant if name in RUNS else None
        if isinstance(quant, dict) and quant.get("kv_path") == "shadow":
            shadows = result.get("shadows") or {}
            raw = 2 * (CONFIG["kv_lora_rank"] + CONFIG["qk_rope_head_dim"])
            rows = sorted({(v or {}).get("cache_row_bytes") or 0 for v in shadows.values()})
            if len(shadows) != LAYERS or not all(
                v and v["cache_row_bytes"] and v["cache_row_bytes"] >= raw + v["token_bytes"]
                for v in shadows.values()
            ):
                problems.append(f"shadow bytes missing from the cache rows: {shadows}")
            what += f", shadow in every layer's cache rows ({rows} bytes per token, raw {raw})"
        if name.startswith(("nvfp4", "fp8")) and result["eager"]:
            paths = [set(v) for v in (stats or {}).values()]
            want = LAYERS * tp  # get_stats keys other ranks' layers as "<layer>@<rank>"
            if len(paths) != want or not all({"prefill", "decode"} <= p for p in paths):
                problems.append(f"per-layer statistics for {len(paths)} layer shards, not {want}")
            what += f", prefill and decode statistics of {LAYERS} layers x {tp} ranks"
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
    names: list[str],
    out: Path,
    model_dir: Path,
    jobs: int,
    deadline: float,
    tp: int = 1,
    gpus: list[str] | None = None,
) -> tuple[dict[str, Any], list[Outcome]]:
    """Run ``names`` in lanes, ``jobs`` lanes at once; at TP=1 lane i on ``gpus[i % n]``."""
    results: dict[str, Any] = {}
    outcomes: list[Outcome] = []
    lanes = [[n for n in lane if n in names] for lane in (LANES if tp == 1 else LANES_TP)]
    lanes = [lane for lane in lanes if lane]
    lock = threading.Lock()

    def worker(index: int) -> None:
        time.sleep(3.0 * index)  # stagger the engines' start (ports, compile caches)
        gpu = gpus[index % len(gpus)] if tp == 1 and gpus and len(gpus) > 1 else None
        while True:
            with lock:
                if not lanes:
                    return
                lane = lanes.pop(0)
            for name in lane:
                print(f"vllm_e2e: {time.strftime('%H:%M:%S')} start {name}", flush=True)
                outcome = run_child(name, out, model_dir, deadline, results, tp, gpu)
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


# ----------------------------------------------------------------------------- TP compare

# Bounds of TP=B against TP=A, in nats, for the same configuration (see
# docs/tensor-parallel.md): unquantized runs differ only by the bf16 rounding of
# the row-parallel all-reduces (o_proj, down_proj) and of shape-dependent GEMM
# kernels; nvfp4 runs see those same input differences, which can move an element
# across a rounding boundary of the 4-bit grid (one quantum), so their bound is
# wider. Quantization scales themselves never depend on the head split (SPEC 2).
TP_TOL = {"none": 0.05, "nvfp4": 0.15}
TP_MEAN_TOL = {"none": 0.01, "nvfp4": 0.03}  # mean |Δ prompt logprob|
STATS_REL_TOL = 0.15  # per layer/path: |rel_l2_mean(B, mean over ranks) / rel_l2_mean(A) - 1|
STATS_COS_TOL = 0.005  # per layer/path: |Δ cosine_mean|


def _load_results(folder: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name in RUNS:
        path = folder / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())
    return found


def _merged_stats(stats: dict[str, Any]) -> dict[str, dict[str, list[dict[str, float]]]]:
    """``{layer: {path: [stats of each rank]}}`` from get_stats' ``layer`` / ``layer@rank`` keys."""
    merged: dict[str, dict[str, list[dict[str, float]]]] = {}
    for key, per_path in stats.items():
        layer = key.split("@", 1)[0]
        for path, values in per_path.items():
            merged.setdefault(layer, {}).setdefault(path, []).append(values)
    return merged


def compare_tp(a_dir: Path, b_dir: Path) -> tuple[bool, list[str], list[dict[str, Any]]]:
    """Compare two result folders configuration by configuration; (passed, table, checks)."""
    a, b = _load_results(a_dir), _load_results(b_dir)
    rows: list[dict[str, Any]] = []
    lines = [f"TP compare: A = {a_dir}, B = {b_dir}"]

    def row(check: str, ok: bool, value: str) -> None:
        rows.append({"check": check, "ok": ok, "value": value})

    common = [n for n in TP_RUNS if n in a and n in b]
    if not common:
        row("configurations in both folders", False, f"none of {list(TP_RUNS)}")
    for name in common:
        ra, rb = a[name], b[name]
        label = f"{name} TP={ra.get('tp', 1)} vs TP={rb.get('tp', 1)}"
        wa, wb = ra.get("weights", {}), rb.get("weights", {})
        if wa.get("sha256") is None or wa.get("sha256") != wb.get("sha256"):
            row(f"{label}: same checkpoint", False, f"{wa.get('sha256')} vs {wb.get('sha256')}")
            continue
        kind = "nvfp4" if name.startswith("nvfp4") else "none"
        tol, mean_tol = TP_TOL[kind], TP_MEAN_TOL[kind]
        d = max_diff(ra["outputs"], rb["outputs"], tol)
        ok = (
            d["prompt_max"] <= tol
            and d["prompt_mean"] <= mean_tol
            and d["gen_max"] <= tol
            and d["divergences_near_ties"]
        )
        tokens = (
            "identical"
            if d["same_tokens"]
            else "diverge at "
            + ", ".join(
                f"prompt {v['prompt']} step {v['step']} (A's top-2 margin {v['margin']:.4f})"
                for v in d["divergences"]
            )
        )
        row(
            f"{label}: logprobs (max {tol}, mean {mean_tol} nats)",
            ok,
            f"max |Δ prompt logprob| {d['prompt_max']:.4f} (mean {d['prompt_mean']:.5f}), "
            f"max |Δ generated logprob| {d['gen_max']:.4f}, greedy tokens {tokens}",
        )
        recipes_a = {
            layer: info["recipe"]
            for w in ra.get("workers", [])
            for layer, info in w["layers"].items()
        }
        recipes_b = {
            layer: info["recipe"]
            for w in rb.get("workers", [])
            for layer, info in w["layers"].items()
        }
        if ra["backend"] == "MLA_QUANT" and (recipes_a or recipes_b):
            row(
                f"{label}: every layer resolves the same recipe",
                recipes_a == recipes_b and None not in recipes_a.values(),
                "yes" if recipes_a == recipes_b else f"{recipes_a} vs {recipes_b}",
            )
        sa, sb = _merged_stats(ra.get("stats") or {}), _merged_stats(rb.get("stats") or {})
        for layer in sorted(set(sa) | set(sb)):
            for path in sorted(set(sa.get(layer, {})) | set(sb.get(layer, {}))):
                xa, xb = sa.get(layer, {}).get(path, []), sb.get(layer, {}).get(path, [])
                if not xa or not xb:
                    row(f"{label}: {layer} {path} statistics", False, "missing on one side")
                    continue
                calls_a = {v["calls"] for v in xa}
                calls_b = {v["calls"] for v in xb}
                rel_a = sum(v["rel_l2_mean"] for v in xa) / len(xa)
                rel_b = sum(v["rel_l2_mean"] for v in xb) / len(xb)
                cos_a = sum(v["cosine_mean"] for v in xa) / len(xa)
                cos_b = sum(v["cosine_mean"] for v in xb) / len(xb)
                rel = abs(rel_b / rel_a - 1.0) if rel_a > 0 else math.inf
                ok = (
                    calls_a == calls_b
                    and len(calls_a) == 1
                    and rel <= STATS_REL_TOL
                    and abs(cos_b - cos_a) <= STATS_COS_TOL
                )
                per_rank = ", ".join(f"{v['rel_l2_mean']:.4f}" for v in xb)
                row(
                    f"{label}: {layer} {path} statistics (rel_l2 within "
                    f"{STATS_REL_TOL:.0%}, cosine within {STATS_COS_TOL})",
                    ok,
                    f"calls {sorted(calls_a)} vs {sorted(calls_b)}, rel_l2_mean {rel_a:.4f} vs "
                    f"{rel_b:.4f} (ranks {per_rank}; {rel:.1%}), cosine_mean {cos_a:.5f} vs "
                    f"{cos_b:.5f}",
                )
    passed = bool(rows) and all(r["ok"] for r in rows)
    lines += [f"  [{'ok' if r['ok'] else 'FAIL'}] {r['check']}: {r['value']}" for r in rows]
    lines.append(f"tp_compare: {'PASS' if passed else 'FAIL'}")
    return passed, lines, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("vllm-e2e-out"))
    parser.add_argument("--tol", type=float, default=0.05, help="max |Δ logprob| in nats")
    parser.add_argument("--only", nargs="*", default=None, help="run these configurations")
    parser.add_argument("--jobs", type=int, default=1, help="lanes of configurations at once")
    parser.add_argument(
        "--deadline", type=float, default=None, help="end everything within this many seconds"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine")
    parser.add_argument(
        "--compare-tp",
        default=None,
        metavar="A,B",
        help="compare two result folders (no GPU needed); the table goes to --out",
    )
    parser.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_model", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    out: Path = args.out
    if args._child:
        out.mkdir(parents=True, exist_ok=True)
        try:
            result = run_one(args._child, out, args._model, args.tp)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        (out / f"{args._child}.json").write_text(json.dumps(result, indent=1))
        print(f"vllm_e2e child {args._child}: done", flush=True)
        os._exit(0)  # skip the engine's teardown: the process is done
    if args.compare_tp is not None:
        folders = [Path(x) for x in args.compare_tp.split(",")]
        if len(folders) != 2:
            parser.error("--compare-tp takes two result folders: A,B")
        ok, table, rows = compare_tp(folders[0], folders[1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "tp_compare.txt").write_text("\n".join(table) + "\n")
        (out / "tp_compare.json").write_text(
            json.dumps({"a": str(folders[0]), "b": str(folders[1]), "passed": ok, "checks": rows})
        )
        print("\n".join(table), flush=True)
        sys.exit(0 if ok else 1)
    unknown = sorted(set(args.only or []) - set(RUNS))
    if unknown:
        parser.error(f"unknown configuration(s) {unknown}; expected some of {list(RUNS)}")
    if args.tp < 1 or int(CONFIG["num_attention_heads"]) % args.tp:
        parser.error(f"--tp {args.tp}: must divide the {CONFIG['num_attention_heads']} heads")
    started = time.time()
    versions = preflight(args.tp)
    deadline = started + (args.deadline if args.deadline is not None else 24 * 3600.0)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(tempfile.mkdtemp(prefix="mla-e2e-model-"))
    sha = write_checkpoint(model_dir)
    weights = {"format": "safetensors", "seed": SEED, "sha256": sha}
    (model_dir / "weights.json").write_text(json.dumps(weights))
    default = [n for n in RUNS if n not in EXPECT] if args.tp == 1 else list(TP_DEFAULT)
    names = [n for n in RUNS if (n in default if args.only is None else n in args.only)]
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpu_list = gpus.split(",") if gpus else [str(i) for i in range(int(versions["gpus"]))]
    print(
        f"vllm_e2e: {len(names)} configurations at TP={args.tp}, {args.jobs} at once, tol "
        f"{args.tol} nats, weights sha256 {sha[:12]}, out {out}",
        flush=True,
    )
    results, outcomes = run_lanes(names, out, model_dir, args.jobs, deadline, args.tp, gpu_list)
    checks, lines = evaluate(results, args.tol, out, args.tp)
    runs_ok = all(o.status == "ok" for o in outcomes)
    passed = runs_ok and all(c["ok"] for c in checks)

    report = [
        f"vllm_e2e summary: torch {versions['torch']}, vllm {versions['vllm']}, "
        f"{len(outcomes)} configurations at TP={args.tp} in {time.time() - started:.0f} s "
        f"(--jobs {args.jobs}), weights sha256 {sha[:12]}",
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
                "tp": args.tp,
                "weights": weights,
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
