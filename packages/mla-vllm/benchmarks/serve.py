"""Serving benchmark: MLA_QUANT against vLLM's FLASHMLA and TRITON_MLA in a real engine (issue 15).

A model with DeepSeek-V3's attention (hidden 7168, 128 heads, q_lora 1536,
kv_lora 512, rope 64, nope 128, v 128) and ``--layers`` dense layers with an
18432-wide MLP (the active width of V3's 8 + 1 experts), dummy weights, token-id
prompts (no tokenizer); the config is tests-vllm-e2e's model (``mla_e2e.configs``)
at V3's attention and MLP sizes. One engine per configuration, each in its own
process (its log, JSON and timeout), CUDA graphs on, prefix caching off. Per
configuration:

- ``engine_start_s``: ``vllm.LLM(...)`` (weights, torch.compile, warm-ups, graphs);
- ``cold_s``: the first batch, ``--batch`` prompts of ``--prompt`` random tokens,
  ``--gen`` generated tokens each (greedy, EOS ignored); ``warm_s``: the same batch
  again; ``first_batch_s`` = engine start + cold batch;
- ``prefill_only_s``: the batch with 1 generated token: ``prefill_tok_s`` = batch x
  prompt / that, ``decode_tok_s`` = batch x (gen - 1) / (warm - prefill only);
- ``jit_warnings``: vLLM's JIT-monitor lines ("... during inference: <kernel>")
  of the engine's log; ``mla_variants``: compiled ``mla_triton`` kernel variants
  after start, the cold and the warm batch (the engine runs in this child process:
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``); ``mla_warmup``: MLA_QUANT's warmup line.

Configurations: ``FLASHMLA``, ``TRITON_MLA`` and ``quant-<recipe>[-shadow]`` for
the recipes ``none``, ``fp8``, ``nvfp4`` and ``nvfp4kv`` (nvfp4 K and V only), on
read or through the shadow (``kv_path: shadow``). Suffixes: ``:nowarm`` runs it
with ``MLA_QUANT_WARMUP=0`` (MLA_QUANT's warmup off: the cold batch compiles),
``:noearly`` with ``MLA_QUANT_WARMUP_EARLY=0`` (the warm-up only from the first metadata
build on, not in the background during vLLM's start);
``:fresh`` gives the engine an empty ``TRITON_CACHE_DIR`` (a new machine), as
``--triton-cache fresh`` does for all; ``keep`` (default) uses the environment's;
``:restart`` reuses the Triton cache that the same configuration's ``:fresh`` engine
of this run filled (a restart on that machine; skipped if that one did not run).
The summary gives first batch and decode relative to the FLASHMLA row of the same
cache state (``:fresh``, ``:restart``, or neither), and the engine's own log lines:
``init engine ... took`` (and its torch.compile part) and each CUDA-graph capture.
``--capture-sizes 1,2,4`` sets vLLM's CUDA-graph capture sizes (default: vLLM's).

Writes ``<out>/serve-<tag>.json`` (rewritten after every configuration, so a run
cut short keeps what finished), ``serve-<tag>.png`` and per configuration
``<name>.log`` / ``<name>.json``. Exit code 2 without a CUDA GPU or vLLM.

Usage, from the repository root (vLLM 0.33, the packages on PYTHONPATH)::

    python packages/mla-vllm/benchmarks/serve.py --out OUT --layers 4 --batch 64 \\
        --prompt 4096 --gen 256 --configs FLASHMLA,TRITON_MLA,quant-none,quant-nvfp4 \\
        --deadline 540
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
E2E = ROOT / "tests-vllm-e2e"
if str(E2E) not in sys.path:
    sys.path.insert(0, str(E2E))

from mla_e2e.configs import CONFIG as E2E_MODEL  # noqa: E402
from mla_e2e.schedule import _child_env, log_tail  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
V3_ATTENTION = {
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "intermediate_size": 18432,
}
RECIPES: dict[str, dict[str, Any]] = {
    "none": {},
    "fp8": {"recipe": "fp8"},
    "nvfp4": {"recipe": "nvfp4"},
    "nvfp4kv": {"k": "nvfp4", "v": "nvfp4"},
}
MODIFIERS = ("nowarm", "noearly", "fresh", "restart")
CACHE_STATES = ("fresh", "restart")  # a row's Triton-cache state, from its modifiers
JIT_LINE = re.compile(r"during inference: ([\w<>]+(?:\.[\w<>]+)*)")  # vllm.utils.jit_monitor
WARMUP_LINE = re.compile(r"MLA_QUANT (?:early )?warmup[: ].*")  # its lines and failures
INIT_LINE = re.compile(r"init engine \(.*?\) took ([\d.]+) s(?: \(compilation: ([\d.]+) s\))?")
CAPTURE_LINE = re.compile(r"Graph capturing finished in ([\d.]+) secs")
KV_TOKENS_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# vLLM's log time stamps ("INFO 12-02 01:32:44 [startup.py:96] non-default args ...")
STAMP = r"(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[[^\]]*\] "
ARGS_LINE = re.compile(STAMP + "non-default args")
ARCH_LINE = re.compile(STAMP + "Resolved architecture")


@dataclass(frozen=True)
class Config:
    """One engine: its backend, ``mla_quant`` (None: none given), warmup on, Triton cache
    (empty: ``fresh_cache``; the one its ``:fresh`` run filled: ``restart``)."""

    name: str
    backend: str
    mla_quant: dict[str, Any] | None
    warmup: bool = True
    fresh_cache: bool = False
    restart: bool = False
    early: bool = True
    """MLA_QUANT's early warm-up on (``MLA_QUANT_WARMUP_EARLY=1``, the library's default;
    ``:noearly``: ``0``)."""

    @property
    def cache_key(self) -> str:
        """The name without ``:fresh``/``:restart``: a restart reuses that key's cache."""
        return ":".join(p for p in self.name.split(":") if p not in CACHE_STATES)


def parse_config(name: str) -> Config:
    """``FLASHMLA``, ``TRITON_MLA`` or ``quant-<recipe>[-shadow]``, then ``:nowarm``/``:fresh``."""
    base, *mods = name.split(":")
    unknown = sorted(set(mods) - set(MODIFIERS))
    if unknown:
        raise ValueError(
            f"--configs: {name!r}: unknown modifier(s) {unknown}; expected {MODIFIERS}"
        )
    warm, fresh, restart = "nowarm" not in mods, "fresh" in mods, "restart" in mods
    early = "noearly" not in mods
    if fresh and restart:
        raise ValueError(f"--configs: {name!r}: :fresh and :restart exclude each other")
    if base in ("FLASHMLA", "TRITON_MLA"):
        if not warm or not early:
            raise ValueError(
                f"--configs: {name!r}: :nowarm and :noearly only apply to quant-* configurations"
            )
        return Config(name, base, None, True, fresh, restart)
    match = re.fullmatch(r"quant-([a-z0-9]+)(-shadow)?", base)
    if match is None or match.group(1) not in RECIPES:
        raise ValueError(
            f"--configs: unknown configuration {name!r}; expected FLASHMLA, TRITON_MLA or "
            f"quant-<{'|'.join(RECIPES)}>[-shadow], then :nowarm or :fresh"
        )
    recipe, shadow = match.group(1), match.group(2) is not None
    if shadow and recipe == "none":
        raise ValueError(f"--configs: {name!r}: recipe none stores no shadow (use quant-none)")
    quant = dict(RECIPES[recipe])
    if shadow:
        quant["kv_path"] = "shadow"
    return Config(name, "MLA_QUANT", quant, warm, fresh, restart, early)


def model_config(layers: int, max_len: int) -> dict[str, Any]:
    """The e2e model at DeepSeek-V3's attention and dense-MLP sizes, ``layers`` dense layers."""
    return (
        E2E_MODEL
        | V3_ATTENTION
        | {
            "num_hidden_layers": layers,
            "first_k_dense_replace": layers,  # every MLP dense
            "max_position_embeddings": max(max_len, 4096),
        }
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tag", default=None, help="results name (default: from the shape)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="requests in the batch")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens per request")
    parser.add_argument("--gen", type=int, default=256, help="generated tokens per request")
    parser.add_argument(
        "--configs",
        default="FLASHMLA,TRITON_MLA,quant-none,quant-nvfp4,quant-nvfp4-shadow",
        help="comma-separated configurations (see the module docstring)",
    )
    parser.add_argument("--max-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization")
    parser.add_argument(
        "--block-size", type=int, default=None, help="KV-cache block size (default: vLLM's)"
    )
    parser.add_argument("--triton-cache", choices=("keep", "fresh"), default="keep")
    parser.add_argument("--capture-sizes", default=None, help="e.g. 1,2,4,8,16,32,64")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per configuration")
    parser.add_argument("--deadline", type=float, default=None, help="end all within seconds")
    parser.add_argument("--min-left", type=float, default=60.0, help="do not start with less")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("layers", "batch", "prompt", "gen", "max_batched_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive int")
    if args.block_size is not None and args.block_size < 1:
        parser.error("--block-size: expected a positive int")
    if args.gen < 2:
        parser.error("--gen: expected at least 2 (decode is timed from the second token)")
    try:
        args.config_list = [parse_config(c.strip()) for c in args.configs.split(",") if c.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    if not args.config_list:
        parser.error("--configs: no configuration given")
    for i, config in enumerate(args.config_list):
        earlier = {c.cache_key for c in args.config_list[:i] if c.fresh_cache}
        if config.restart and config.cache_key not in earlier:
            parser.error(
                f"--configs: {config.name!r}: :restart needs {config.cache_key}:fresh before it"
            )
    args.cache_dirs = {}  # cache_key -> the Triton cache its :fresh engine filled
    sizes = args.capture_sizes
    try:
        args.capture_list = None if sizes is None else [int(x) for x in sizes.split(",") if x]
    except ValueError:
        parser.error(f"--capture-sizes: expected comma-separated ints, got {sizes!r}")
    if args.capture_list is not None and (not args.capture_list or min(args.capture_list) < 1):
        parser.error(f"--capture-sizes: expected positive ints, got {sizes!r}")
    if args.tag is None:
        args.tag = f"L{args.layers}-b{args.batch}-p{args.prompt}-g{args.gen}"
    return args


# ---------------------------------------------------------------------------- child


def _prompts(batch: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    rng = random.Random(1234)
    return [
        {"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(length)]} for _ in range(batch)
    ]


def _write(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def _variants() -> int | None:
    try:
        from mla_triton.warmup import compiled_variants
    except ImportError:
        return None
    return sum(compiled_variants().values())


def run_child(args: argparse.Namespace) -> int:
    """One configuration in this process: start the engine, time the batches."""
    import torch
    import vllm
    from mla_e2e.probes import ensure_registered
    from vllm import LLM, SamplingParams

    config = parse_config(args.child)
    path = args.out / f"{config.name.replace(':', '_')}.json"
    result: dict[str, Any] = {
        "name": config.name,
        "backend": config.backend,
        "mla_quant": config.mla_quant,
        "warmup": config.warmup,
        "gpu": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "triton_cache": os.environ.get("TRITON_CACHE_DIR"),
    }
    model_dir = args.out / "model"
    ensure_registered(1)
    extra = {} if config.mla_quant is None else {"mla_quant": config.mla_quant}
    options: dict[str, Any] = {}
    if args.capture_list is not None:
        options["compilation_config"] = {"cudagraph_capture_sizes": args.capture_list}
    if args.block_size is not None:
        options["block_size"] = args.block_size
    start = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        attention_backend=config.backend,
        additional_config=extra,
        max_model_len=args.prompt + args.gen,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens,
        enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_mem,
        seed=0,
        **options,
    )
    result["engine_start_s"] = round(time.perf_counter() - start, 2)
    result["mla_variants"] = {"after_start": _variants()}
    _write(path, result)
    prompts = _prompts(args.batch, args.prompt, int(E2E_MODEL["vocab_size"]))
    full = SamplingParams(max_tokens=args.gen, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def timed(params: Any, key: str) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != [params.max_tokens] * len(prompts):
            raise RuntimeError(f"{key}: expected {params.max_tokens} tokens per request, got {got}")
        result[key] = round(seconds, 3)
        return seconds

    cold = timed(full, "cold_s")
    result["mla_variants"]["after_cold"] = _variants()
    result["first_batch_s"] = round(result["engine_start_s"] + cold, 2)
    _write(path, result)
    warm = timed(full, "warm_s")
    result["mla_variants"]["after_warm"] = _variants()
    result["cold_over_warm"] = round(cold / warm, 3)
    _write(path, result)
    prefill = timed(one, "prefill_only_s")
    result["prefill_tok_s"] = round(args.batch * args.prompt / prefill, 1)
    decode_s = warm - prefill
    if decode_s > 0:
        result["decode_tok_s"] = round(args.batch * (args.gen - 1) / decode_s, 1)
    result["status"] = "ok"
    _write(path, result)
    return 0


# ---------------------------------------------------------------------------- parent


def scan_log(text: str) -> dict[str, Any]:
    """vLLM's JIT-monitor warnings (kernel names, in order), MLA_QUANT's warmup lines, and
    the engine's init time (``init_engine_s``, its torch.compile part ``compile_s``),
    CUDA-graph capture passes (``capture_s``, seconds each), KV-cache size
    (``kv_cache_tokens``) and the seconds from "non-default args" to "Resolved
    architecture" (``inspect_s``: vLLM's model inspection, paid by the first engine of a
    machine only) as vLLM logs them."""
    # only the per-kernel warnings: the monitor's own start line also says "during inference"
    kernels = [m.group(1) for line in text.splitlines() if (m := JIT_LINE.search(line))]
    warmups = [m.group(0).strip() for m in WARMUP_LINE.finditer(text)]
    found: dict[str, Any] = {"jit_warnings": len(kernels), "jit_kernels": kernels,
                             "mla_warmup": warmups}  # fmt: skip
    init = INIT_LINE.search(text)
    if init is not None:
        found["init_engine_s"] = float(init.group(1))
        if init.group(2) is not None:
            found["compile_s"] = float(init.group(2))
    found["capture_s"] = [float(m.group(1)) for m in CAPTURE_LINE.finditer(text)]
    tokens = KV_TOKENS_LINE.search(text)
    if tokens is not None:
        found["kv_cache_tokens"] = int(tokens.group(1).replace(",", ""))
    args, arch = ARGS_LINE.search(text), ARCH_LINE.search(text)
    if args is not None and arch is not None:
        found["inspect_s"] = _stamp(arch) - _stamp(args)
    return found


def _stamp(match: re.Match[str]) -> int:
    """Seconds since the month's start of a vLLM log time stamp (1 s resolution)."""
    day, hour, minute, second = (int(match.group(i)) for i in range(2, 6))
    return ((day * 24 + hour) * 60 + minute) * 60 + second


def _env(config: Config, args: argparse.Namespace) -> dict[str, str]:
    env = _child_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(E2E), *(str(p) for p in sorted((ROOT / "packages").glob("*/src")))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    if not config.warmup:
        env["MLA_QUANT_WARMUP"] = "0"
    env["MLA_QUANT_WARMUP_EARLY"] = "1" if config.early else "0"  # explicit either way
    if args.triton_cache == "fresh" or config.fresh_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="serve-triton-")  # not in --out
        args.cache_dirs[config.cache_key] = env["TRITON_CACHE_DIR"]
    elif config.restart:
        env["TRITON_CACHE_DIR"] = args.cache_dirs[config.cache_key]
    return env


def run_config(config: Config, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """Start the child for ``config``; its JSON (what it finished) plus the log's findings."""
    stem = config.name.replace(":", "_")
    log_path, json_path = args.out / f"{stem}.log", args.out / f"{stem}.json"
    json_path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", config.name]
    for name in ("out", "layers", "batch", "prompt", "gen", "max_batched_tokens", "gpu_mem"):
        command += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.capture_sizes is not None:
        command += ["--capture-sizes", args.capture_sizes]
    if args.block_size is not None:
        command += ["--block-size", str(args.block_size)]
    start = time.time()
    status = "ok"
    with open(log_path, "w") as log:
        child = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=_env(config, args),
            start_new_session=True,
        )  # fmt: skip
        try:
            code = child.wait(timeout=timeout)
            if code != 0:
                status = f"error (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = f"timeout after {timeout:.0f} s"
        with contextlib.suppress(ProcessLookupError):  # what the engine left behind (its
            os.killpg(child.pid, signal.SIGKILL)  # child skips vLLM's teardown: os._exit)
    result: dict[str, Any] = {"name": config.name}
    if json_path.exists():
        result |= json.loads(json_path.read_text())
    text = log_path.read_text(errors="replace")
    result |= scan_log(text)
    result["status"] = status if status != "ok" else result.get("status", "incomplete")
    result["seconds"] = round(time.time() - start, 1)
    if result["status"] != "ok":
        result["log_tail"] = log_tail(log_path, 15)
    return result


def cache_state(name: str) -> str:
    """A row's Triton-cache state: ``fresh``, ``restart`` or ``keep`` (its modifiers)."""
    mods = set(name.split(":")[1:])
    return next((state for state in CACHE_STATES if state in mods), "keep")


def _flashmla(results: Sequence[dict[str, Any]], state: str) -> dict[str, Any] | None:
    """The FLASHMLA row of cache ``state`` (None: not measured)."""
    for r in results:
        if r["name"].split(":")[0] == "FLASHMLA" and cache_state(r["name"]) == state:
            return r
    return None


def summary(results: Sequence[dict[str, Any]]) -> str:
    """A text table of the results: first batch (engine start + cold) and warm decode
    relative to the FLASHMLA row of the same cache state ("first/FM", "dec/FM"), and the
    engine's init, torch.compile and CUDA-graph capture seconds from its log."""
    cols = ("start", "cold", "warm", "first", "first/FM", "cold/warm", "prefill/s",
            "decode/s", "dec/FM", "JIT", "init", "compile", "capture")  # fmt: skip
    rows = [f"{'configuration':28s}" + "".join(f"{c:>10s}" for c in cols)]
    for r in results:
        base = _flashmla(results, cache_state(r["name"])) or {}

        def num(key: str, fmt: str = "{:.1f}", r: dict[str, Any] = r) -> str:
            value = r.get(key)
            return fmt.format(value) if isinstance(value, (int, float)) else "-"

        def ratio(key: str, r: dict[str, Any] = r, base: dict[str, Any] = base) -> str:
            value, ref = r.get(key), base.get(key)
            ok = isinstance(value, (int, float)) and isinstance(ref, (int, float)) and ref > 0
            return f"{value / ref:.2f}x" if ok else "-"

        captures = r.get("capture_s") or []
        cells = (
            num("engine_start_s"), num("cold_s"), num("warm_s"), num("first_batch_s"),
            ratio("first_batch_s"), num("cold_over_warm", "{:.2f}"), num("prefill_tok_s", "{:.0f}"),
            num("decode_tok_s", "{:.0f}"), ratio("decode_tok_s"), str(r.get("jit_warnings", "-")),
            num("init_engine_s"), num("compile_s"), "+".join(f"{c:g}" for c in captures) or "-",
        )  # fmt: skip
        line = f"{r['name']:28s}" + "".join(f"{c:>10s}" for c in cells)
        if r.get("status") != "ok":
            line += f"  [{r.get('status')}]"
        rows.append(line)
    return "\n".join(rows)


def plot(results: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Bars: seconds (engine start, cold, warm batch) and tokens/s (prefill, decode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in results]
    x = list(range(len(names)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 1.6 * len(names) + 4), 4.5))
    width = 0.27
    for i, (key, label) in enumerate(
        (
            ("engine_start_s", "engine start"),
            ("cold_s", "first batch (cold)"),
            ("warm_s", "same batch (warm)"),
        )
    ):
        values = [float(r.get(key) or 0.0) for r in results]
        left.bar([v + (i - 1) * width for v in x], values, width, label=label)
    left.set_ylabel("seconds")
    left.set_xticks(x, names, rotation=30, ha="right")
    left.legend()
    for i, (key, label) in enumerate((("prefill_tok_s", "prefill"), ("decode_tok_s", "decode"))):
        values = [float(r.get(key) or 0.0) for r in results]
        right.bar([v + (i - 0.5) * width for v in x], values, width, label=label)
    right.set_ylabel("tokens / s")
    right.set_yscale("log")
    right.set_xticks(x, names, rotation=30, ha="right")
    right.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(
    results: Sequence[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any]
) -> Path:
    """``serve-<tag>.json`` (meta and every result) and ``serve-<tag>.png``."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve-{args.tag}.json"
    _write(path, {"meta": meta, "results": list(results), "summary": summary(results)})
    title = f"{args.layers} layers, batch {args.batch}, {args.prompt} prompt + {args.gen} generated"
    plot(results, path.with_suffix(".png"), title)
    return path


def preflight() -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False); it does not run on CPU"
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"needs vLLM 0.33.0 ({exc})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.out = args.out.resolve()
    if args.child is not None:
        code = 1
        try:
            code = run_child(args)
        except BaseException:  # printed to the engine's log; the parent records the status
            import traceback

            traceback.print_exc()
        finally:
            # the results are written: skip vLLM's teardown at exit (seconds of wall
            # per engine, and the exit hang of docs/vllm.md)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    problem = preflight()
    if problem is not None:
        print(f"serve_bench: FAIL: {problem}", flush=True)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    model_dir.mkdir(exist_ok=True)
    config = model_config(args.layers, args.prompt + args.gen)
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    began = time.time()
    deadline = began + args.deadline if args.deadline else None
    meta = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "gen": args.gen,
        "max_batched_tokens": args.max_batched_tokens, "triton_cache": args.triton_cache,
        "capture_sizes": args.capture_list, "block_size": args.block_size,
        "model": config, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(began)),
    }  # fmt: skip
    results: list[dict[str, Any]] = []
    for item in args.config_list:
        if item.restart and item.cache_key not in args.cache_dirs:
            results.append(
                {"name": item.name, "status": f"skipped ({item.cache_key}:fresh did not run)"}
            )
            continue
        timeout = args.timeout
        if deadline is not None:
            left = deadline - time.time()
            if left < args.min_left:
                results.append({"name": item.name, "status": f"skipped ({left:.0f} s left)"})
                continue
            timeout = min(timeout, left)
        print(f"serve_bench: {item.name} (timeout {timeout:.0f} s)", flush=True)
        results.append(run_config(item, args, timeout))
        write_results(results, args, meta)  # after every configuration: partial results
    path = write_results(results, args, meta)
    print(summary(results), flush=True)
    print(f"serve_bench: wrote {path} and {path.with_suffix('.png')}", flush=True)
    return 0 if all(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
