"""Serving: a real vLLM engine's decode tokens/s with MLA_QUANT against FLASHMLA's engine.

A model with DeepSeek-V3's attention (hidden 7168, 128 heads, q_lora 1536, kv_lora 512,
rope 64, nope 128, v 128) and ``--layers`` dense layers with an 18432-wide MLP (the
active width of V3's 8 + 1 experts), dummy weights, token-id prompts (no tokenizer):
tests-vllm-e2e's model at V3's sizes. One engine per configuration, each in its own
process (its own timeout), prefix caching off, CUDA graphs on (mode ``graph``) or off
(``eager``). Per engine: the batch (``b<requests>-L<prompt tokens>``, ``--gen`` generated
each, greedy, EOS ignored) once cold, once warm, then with one generated token (the
prefill alone); decode tokens/s = requests x (gen - 1) / (warm - prefill only).

Configurations: ``--impl`` ``flashmla`` and ``triton_mla`` (vLLM's backends, recipe none)
and ``mla_quant`` (this project's backend) for each ``--recipes`` entry: ``none``, ``fp8``,
``nvfp4`` (``AttentionQuant.uniform``, read from the raw cache) or ``<fmt>-fp16`` /
``<fmt>-packed`` (through the shadow of that storage). Rows (op ``serve``) go to
``results/serve.csv`` in the columns of mla-triton's ``benchmarks/harness.py``:
``time_us`` one decode step of the whole batch, ``tok_s`` decode tokens/s, ``ratio`` this
engine's tokens/s over FLASHMLA's of the same run, shape and mode; notes: prefill
tokens/s, engine start, JIT warnings during inference, or why the engine failed.

From the repository root (vLLM 0.33 and the packages importable)::

    python packages/mla-vllm/benchmarks/serve.py --shapes b64-L4096 \\
        --recipes none,fp8,nvfp4,fp8-fp16,nvfp4-fp16 --impl flashmla,mla_quant --deadline 540
    python packages/mla-vllm/benchmarks/serve.py --smoke   # CPU: no engine, the rows' shape

Exit code 2 without a CUDA GPU or vLLM (unless ``--smoke``).
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
BENCH = ROOT / "packages" / "mla-triton" / "benchmarks"
for _p in (E2E, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from harness import COLUMNS, environment, fmt, write_rows  # noqa: E402
from mla_e2e.configs import CONFIG as E2E_MODEL  # noqa: E402
from mla_e2e.schedule import _child_env, log_tail  # noqa: E402

OP = "serve"
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
BACKENDS = {"flashmla": "FLASHMLA", "triton_mla": "TRITON_MLA", "mla_quant": "MLA_QUANT"}
ANCHOR = "flashmla"
RECIPE_RE = re.compile(r"(none|fp8|nvfp4)(?:-(fp16|packed))?")
SHAPE_RE = re.compile(r"b(\d+)-L(\d+)")
JIT_LINE = re.compile(r"during inference: ([\w<>]+(?:\.[\w<>]+)*)")  # vllm.utils.jit_monitor


@dataclass(frozen=True)
class Config:
    """One engine: ``impl`` (a ``BACKENDS`` key), its recipe name, CUDA graphs or eager."""

    impl: str
    recipe: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.impl}-{self.recipe}-{self.mode}"

    @property
    def mla_quant(self) -> dict[str, Any] | None:
        """``additional_config["mla_quant"]`` (None: vLLM's own backend)."""
        if self.impl != "mla_quant":
            return None
        m = RECIPE_RE.fullmatch(self.recipe)
        assert m is not None
        fmt_, storage = m.groups()
        quant: dict[str, Any] = {} if fmt_ == "none" else {"recipe": fmt_}
        if storage is not None:
            quant |= {"kv_path": "shadow", "shadow_storage": storage}
        return quant


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", default="b64-L4096,b16-L32768",
                        help="b<requests>-L<prompt tokens>, comma-separated")  # fmt: skip
    parser.add_argument("--recipes", default="none,fp8,nvfp4,fp8-fp16,nvfp4-fp16",
                        help="MLA_QUANT recipes: none|fp8|nvfp4[-fp16|-packed]")  # fmt: skip
    parser.add_argument("--impl", default="flashmla,mla_quant",
                        help=f"comma-separated of {', '.join(BACKENDS)}")  # fmt: skip
    parser.add_argument("--modes", default="graph", help="graph and/or eager")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gen", type=int, default=256, help="generated tokens per request")
    parser.add_argument("--max-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-mem", type=float, default=0.85, help="gpu_memory_utilization")
    parser.add_argument("--capture-sizes", default=None,
                        help="CUDA-graph batch sizes, e.g. 1,2,4,8,16,32,64")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per engine")
    parser.add_argument("--deadline", type=float, default=None, help="end all within seconds")
    parser.add_argument("--min-left", type=float, default=60.0, help="do not start with less")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="model config, engine logs (default: a temporary folder)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="the CSV (default results/)")
    parser.add_argument("--dry-run", action="store_true", help="print the rows, write nothing")
    parser.add_argument("--smoke", action="store_true",
                        help="no engine: parse, build the model, print sample rows")  # fmt: skip
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--prompt", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gen < 2:
        parser.error("--gen: expected at least 2 (decode is timed from the second token)")
    args.shape_list = []
    for item in filter(None, (s.strip() for s in args.shapes.split(","))):
        m = SHAPE_RE.fullmatch(item)
        if m is None:
            parser.error(f"--shapes: expected b<requests>-L<prompt tokens>, got {item!r}")
        args.shape_list.append((int(m.group(1)), int(m.group(2))))
    impls = [i.strip() for i in args.impl.split(",") if i.strip()]
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [i for i in impls if i not in BACKENDS] + [
        r for r in recipes if not RECIPE_RE.fullmatch(r)
    ]
    bad += [m for m in modes if m not in ("graph", "eager")]
    if bad or not impls or not modes:
        parser.error(f"unknown {bad}: --impl {list(BACKENDS)}, --recipes none|fp8|nvfp4[-fp16|"
                     "-packed], --modes graph|eager")  # fmt: skip
    if "none-fp16" in recipes or "none-packed" in recipes:
        parser.error("--recipes: recipe none stores no shadow")
    args.configs = [
        Config(impl, recipe, mode)
        for mode in modes
        for impl in impls
        for recipe in (recipes if impl == "mla_quant" else ["none"])
    ]
    args.configs.sort(key=lambda c: (c.mode, c.impl != ANCHOR))  # the anchor first
    return args


def model_config(layers: int, max_len: int) -> dict[str, Any]:
    """The e2e model at DeepSeek-V3's attention and dense-MLP sizes, ``layers`` dense layers."""
    return E2E_MODEL | V3_ATTENTION | {
        "num_hidden_layers": layers,
        "first_k_dense_replace": layers,  # every MLP dense
        "max_position_embeddings": max(max_len, 4096),
    }  # fmt: skip


# ---------------------------------------------------------------------------- child


def run_child(args: argparse.Namespace) -> int:
    """One engine in this process: start it, time the batches, write its JSON."""
    import torch
    from mla_e2e.probes import ensure_registered
    from vllm import LLM, SamplingParams

    impl, recipe, mode = args.child.split(",")
    config = Config(impl, recipe, mode)
    path = args.workdir / f"{config.name}.json"
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name()}
    ensure_registered(1)
    extra = {} if config.mla_quant is None else {"mla_quant": config.mla_quant}
    options: dict[str, Any] = {}
    if args.capture_sizes and mode == "graph":
        sizes = [int(x) for x in args.capture_sizes.split(",") if x]
        options["compilation_config"] = {"cudagraph_capture_sizes": sizes}
    start = time.perf_counter()
    llm = LLM(
        model=str(args.workdir / "model"), load_format="dummy", skip_tokenizer_init=True,
        dtype="bfloat16", attention_backend=BACKENDS[impl], additional_config=extra,
        max_model_len=args.prompt + args.gen, max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens, enable_prefix_caching=False,
        gpu_memory_utilization=args.gpu_mem, seed=0, enforce_eager=mode == "eager",
        **options,
    )  # fmt: skip
    result["engine_start_s"] = time.perf_counter() - start
    rng = random.Random(1234)
    vocab = int(E2E_MODEL["vocab_size"])
    prompts = [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(args.prompt)]}
               for _ in range(args.batch)]  # fmt: skip

    def timed(tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outputs]
        if got != [tokens] * len(prompts):
            raise RuntimeError(f"expected {tokens} tokens per request, got {got}")
        return seconds

    result["cold_s"] = timed(args.gen)
    result["warm_s"] = timed(args.gen)
    result["prefill_s"] = timed(1)
    path.write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------- parent


def run_engine(config: Config, args: argparse.Namespace, batch: int, prompt: int,
               timeout: float) -> dict[str, Any]:  # fmt: skip
    """The child's JSON for ``config`` (or ``status``: why none), and its JIT warnings."""
    log_path = args.workdir / f"{config.name}.log"
    json_path = args.workdir / f"{config.name}.json"
    json_path.unlink(missing_ok=True)
    command = [
        sys.executable, str(Path(__file__).resolve()), "--child",
        f"{config.impl},{config.recipe},{config.mode}", "--workdir", str(args.workdir),
        "--batch", str(batch), "--prompt", str(prompt), "--gen", str(args.gen),
        "--max-batched-tokens", str(args.max_batched_tokens), "--gpu-mem", str(args.gpu_mem),
    ]  # fmt: skip
    if args.capture_sizes:
        command += ["--capture-sizes", args.capture_sizes]
    env = _child_env()
    env["PYTHONPATH"] = os.pathsep.join(
        [str(E2E), str(BENCH), *(str(p) for p in sorted((ROOT / "packages").glob("*/src")))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    status = "ok"
    with open(log_path, "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                 start_new_session=True)  # fmt: skip
        try:
            code = child.wait(timeout=timeout)
            if code != 0:
                status = f"engine failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = f"timeout after {timeout:.0f} s"
        with contextlib.suppress(ProcessLookupError):  # what the engine left behind
            os.killpg(child.pid, signal.SIGKILL)
    result: dict[str, Any] = json.loads(json_path.read_text()) if json_path.exists() else {}
    if status == "ok" and not result:
        status = "engine wrote no result"
    result["status"] = status
    text = log_path.read_text(errors="replace")
    result["jit"] = sum(1 for line in text.splitlines() if JIT_LINE.search(line))
    if status != "ok":
        print(log_tail(log_path, 15), flush=True)
    return result


def rows_of(env: dict[str, str], shape: str, batch: int, prompt: int, gen: int,
            results: Sequence[tuple[Config, dict[str, Any]]]) -> list[dict[str, str]]:  # fmt: skip
    """CSV rows of one shape: per engine its decode step time, tokens/s and ratio to the
    FLASHMLA engine of the same mode."""

    def decode_s(r: dict[str, Any]) -> float | None:
        if r.get("status") != "ok":
            return None
        d = float(r["warm_s"]) - float(r["prefill_s"])
        return d if d > 0 else None

    anchors = {c.mode: decode_s(r) for c, r in results if c.impl == ANCHOR}
    rows = []
    for config, r in results:
        d = decode_s(r)
        step_us = d / (gen - 1) * 1e6 if d else None
        tok_s = batch * (gen - 1) / d if d else None
        base = anchors.get(config.mode)
        notes = []
        if d is None:
            notes.append(str(r.get("status")))
        else:
            notes += [f"prefill {batch * prompt / float(r['prefill_s']):.0f} tok/s",
                      f"engine start {float(r['engine_start_s']):.0f} s",
                      f"cold batch {float(r['cold_s']):.1f} s, warm {float(r['warm_s']):.1f} s",
                      f"JIT during inference {r.get('jit', 0)}"]  # fmt: skip
        if base is None and config.impl != ANCHOR:
            notes.append(f"no anchor: the {BACKENDS[ANCHOR]} engine did not run")
        rows.append(env | {
            "gpu": str(r.get("gpu", env["gpu"])), "op": OP, "shape": shape,
            "recipe": config.recipe, "impl": config.impl, "mode": config.mode,
            "time_us": fmt(step_us), "tflops": "", "gbps": "", "tok_s": fmt(tok_s, 0),
            "ratio": fmt(base / d, 3) if base and d else "", "notes": "; ".join(notes),
        })  # fmt: skip
    return rows


def preflight() -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (torch.cuda.is_available() is False)"
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return f"needs vLLM 0.33 ({exc})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child is not None:
        code = 1
        try:
            code = run_child(args)
        except BaseException:  # printed to the engine's log; the parent records the status
            import traceback

            traceback.print_exc()
        finally:  # skip vLLM's teardown (seconds per engine, and its exit hang)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    import torch

    path = args.out if args.out is not None else RESULTS / f"{OP}.csv"
    dry = args.dry_run or (args.smoke and args.out is None)
    env = environment(torch.device("cpu"))  # no CUDA context in this process
    if args.smoke:
        fake = {"status": "ok", "gpu": "smoke", "engine_start_s": 60.0, "cold_s": 9.0,
                "warm_s": 8.0, "prefill_s": 2.0, "jit": 0}  # fmt: skip
        for batch, prompt in args.shape_list:
            model_config(args.layers, prompt + args.gen)
            shape = f"b{batch}-L{prompt}-g{args.gen}-l{args.layers}"
            results = [(c, dict(fake, warm_s=8.0 + 0.5 * i)) for i, c in enumerate(args.configs)]
            rows = rows_of(env, shape, batch, prompt, args.gen, results)
            assert all(tuple(r) == COLUMNS for r in rows)
            write_rows(rows, path, dry)
        print(f"serve.py --smoke: {len(args.configs)} engines a shape (none started)")
        return 0
    problem = preflight()
    if problem is not None:
        print(f"serve.py: {problem}", file=sys.stderr)
        return 2
    args.workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="serve-"))).resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.deadline if args.deadline else None
    ok = True
    for batch, prompt in args.shape_list:
        shape = f"b{batch}-L{prompt}-g{args.gen}-l{args.layers}"
        (args.workdir / "model").mkdir(exist_ok=True)
        config = model_config(args.layers, prompt + args.gen)
        (args.workdir / "model" / "config.json").write_text(json.dumps(config, indent=1))
        results: list[tuple[Config, dict[str, Any]]] = []
        for item in args.configs:
            timeout = args.timeout
            if deadline is not None:
                left = deadline - time.time()
                if left < args.min_left:
                    results.append((item, {"status": f"skipped ({left:.0f} s left)"}))
                    continue
                timeout = min(timeout, left)
            print(f"serve.py: {shape} {item.name} (timeout {timeout:.0f} s)", flush=True)
            results.append((item, run_engine(item, args, batch, prompt, timeout)))
        rows = rows_of(env, shape, batch, prompt, args.gen, results)
        ok &= all(r["time_us"] for r in rows)
        write_rows(rows, path, args.dry_run)
    print(f"serve.py: engine logs in {args.workdir}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
