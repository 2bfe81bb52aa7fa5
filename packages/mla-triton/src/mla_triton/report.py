"""``mla-report``: what each quantization recipe does to DeepSeek-V3-shaped MLA attention.

For every recipe the report runs the decode and prefill kernels on the same
synthetic inputs and prints, against the unquantized kernel result: relative L2
error, cosine similarity and max abs error; against the eager oracle of
``mla-reference`` with the same recipe: the relative L2 disagreement (how exactly
the kernel implements the recipe); and on a GPU the kernel time and its ratio to
quant none. Results go to ``report.json`` and ``report.png`` in ``--out``.

Shapes: on a GPU DeepSeek-V3's attention (128 heads, latent 512 + rope 64, prefill
head dims 192/128) at serving sizes; on a CPU a smaller default (16 heads, short
sequences) that the Triton interpreter runs in about a minute. Inputs are random
normal with a few outlier channels, seeded: a stress test of the formats, not a
model's activations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from mla_formats import AttentionQuant, NMSparsity, OperandQuant

__all__ = [
    "RECIPES",
    "Case",
    "Recipe",
    "main",
    "parse_recipe",
    "run_report",
    "write_outputs",
]


@dataclass(frozen=True)
class Recipe:
    """A named quantization recipe: the operand formats and optional prefill N:M sparsity."""

    name: str
    quant: AttentionQuant | None
    sparsity: NMSparsity | None = None


RECIPES: tuple[Recipe, ...] = (
    Recipe("none", None),
    Recipe("fp8", AttentionQuant.uniform("fp8")),
    Recipe("nvfp4", AttentionQuant.uniform("nvfp4")),
    Recipe("nvfp4-kv", AttentionQuant(k="nvfp4", v="nvfp4")),
    # N:M applies to prefill only (SPEC 5): its decode row repeats plain nvfp4.
    Recipe("nvfp4+2:4", AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4, 4, 16)),
)


def parse_recipe(text: str) -> Recipe:
    """Parse ``name=q:fmt,k:fmt,p:fmt,v:fmt[,nm:N:M]`` (omitted operands are not quantized).

    A format may carry a static amax after ``@``, e.g. ``k:nvfp4@12.5``.
    """
    name, sep, body = text.partition("=")
    if not sep or not name or not body:
        raise ValueError(f"--recipe: expected name=q:fmt,k:fmt,..., got {text!r}")
    operands: dict[str, OperandQuant] = {}
    sparsity = None
    for item in body.split(","):
        role, _, spec = item.partition(":")
        if role == "nm":
            n, _, m = spec.partition(":")
            if not (n.isdigit() and m.isdigit()):
                raise ValueError(f"--recipe: N:M needs two integers, got {item!r}")
            sparsity = NMSparsity(int(n), int(m))
            continue
        if role not in ("q", "k", "p", "v") or not spec:
            raise ValueError(f"--recipe: bad operand {item!r} (roles q, k, p, v, nm)")
        fmt, _, amax = spec.partition("@")
        value: float | str | None = None
        if amax == "dynamic":
            value = amax
        elif amax:
            try:
                value = float(amax)
            except ValueError:
                raise ValueError(
                    f"--recipe: amax of {role} must be a number or 'dynamic', got {amax!r}"
                ) from None
        operands[role] = OperandQuant(fmt, value)  # type: ignore[arg-type]
    return Recipe(name, AttentionQuant(**operands), sparsity)


@dataclass(frozen=True)
class Case:
    """Problem sizes of one report run."""

    heads: int
    decode_batch: int
    decode_len: int
    page_size: int
    prefill_batch: int
    prefill_len: int
    dtype: str

    @staticmethod
    def for_device(device: torch.device) -> Case:
        if device.type == "cuda":
            return Case(128, 32, 4096, 64, 2, 2048, "bfloat16")
        return Case(16, 2, 80, 16, 1, 48, "float16")


def _inputs(case: Case, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def normal(*shape: int, outliers: int = 4) -> torch.Tensor:
        x = torch.randn(*shape, generator=g)
        cols = torch.randperm(shape[-1], generator=g)[:outliers]
        x[..., cols] *= 8.0  # a few outlier channels, as real activations have
        return x.to(device=device, dtype=dtype)

    b, length, page = case.decode_batch, case.decode_len, case.page_size
    pages_per_seq = math.ceil(length / page)
    num_pages = b * pages_per_seq
    block_table = torch.randperm(num_pages, generator=g).reshape(b, pages_per_seq)
    t = case.prefill_batch * case.prefill_len
    cu = torch.arange(case.prefill_batch + 1) * case.prefill_len
    return {
        "q_decode": normal(b, case.heads, 576),
        "kv_cache": normal(num_pages, page, 576),
        "block_table": block_table.to(device=device, dtype=torch.int32),
        "seq_lens": torch.full((b,), length, dtype=torch.int32, device=device),
        "q": normal(t, case.heads, 192),
        "k": normal(t, case.heads, 192),
        "v": normal(t, case.heads, 128),
        "cu": cu.to(device=device, dtype=torch.int32),
    }


def _errors(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    x64, r64 = x.double().flatten(), ref.double().flatten()
    return {
        "rel_l2": float((x64 - r64).norm() / r64.norm().clamp_min(1e-30)),
        "cosine": float(torch.nn.functional.cosine_similarity(x64, r64, dim=0)),
        "max_abs": float((x64 - r64).abs().max()),
    }


def _time_ms(fn: Any) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def run_report(
    recipes: tuple[Recipe, ...],
    device: torch.device,
    *,
    case: Case | None = None,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every recipe through decode and prefill; returns the JSON-ready results.

    ``case`` defaults to :meth:`Case.for_device`. The first recipe should be ``none``:
    error columns are measured against it.
    """
    from rich.progress import Progress

    import mla_reference
    import mla_triton

    case = case or Case.for_device(device)
    data = _inputs(case, device, seed)
    decode_scale = 1.0 / math.sqrt(192.0)  # DeepSeek-V3 scales by the unabsorbed head dim
    prefill_scale = 1.0 / math.sqrt(192.0)
    timing = device.type == "cuda"

    def run_decode(recipe: Recipe) -> torch.Tensor:
        out, _ = mla_triton.decode(
            data["q_decode"],
            data["kv_cache"],
            data["block_table"],
            data["seq_lens"],
            softmax_scale=decode_scale,
            quant=recipe.quant,
        )
        return out

    def run_prefill(recipe: Recipe) -> torch.Tensor:
        return mla_triton.prefill(
            data["q"],
            data["k"],
            data["v"],
            data["cu"],
            data["cu"],
            softmax_scale=prefill_scale,
            causal=True,
            quant=recipe.quant,
            sparsity=recipe.sparsity,
            max_seqlen_q=case.prefill_len,
            max_seqlen_k=case.prefill_len,
        )

    rows: list[dict[str, Any]] = []
    baseline: dict[str, torch.Tensor] = {}
    base_ms: dict[str, float] = {}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("recipes", total=len(recipes) * 2)
        for recipe in recipes:
            for kind, kernel in (("decode", run_decode), ("prefill", run_prefill)):
                bar.update(task, description=f"{recipe.name} {kind}")
                out = kernel(recipe)
                if kind == "decode":
                    oracle, _ = mla_reference.decode(
                        data["q_decode"],
                        data["kv_cache"],
                        data["block_table"],
                        data["seq_lens"],
                        softmax_scale=decode_scale,
                        quant=recipe.quant,
                        compute_dtype=torch.float32 if timing else torch.float64,
                    )
                else:
                    oracle = mla_reference.prefill(
                        data["q"],
                        data["k"],
                        data["v"],
                        data["cu"],
                        data["cu"],
                        softmax_scale=prefill_scale,
                        causal=True,
                        quant=recipe.quant,
                        sparsity=recipe.sparsity,
                        compute_dtype=torch.float32 if timing else torch.float64,
                    )
                if recipe.quant is None and recipe.sparsity is None:
                    baseline[kind] = out
                row: dict[str, Any] = {"recipe": recipe.name, "kind": kind}
                if kind in baseline:
                    row.update(_errors(out, baseline[kind]))
                row["oracle_rel_l2"] = _errors(out, oracle)["rel_l2"]
                if timing:
                    ms = _time_ms(lambda r=recipe, k=kernel: k(r))
                    base_ms.setdefault(kind, ms)
                    row["ms"] = ms
                    row["speed_vs_none"] = base_ms[kind] / ms
                rows.append(row)
                bar.advance(task)
    return {
        "device": torch.cuda.get_device_name(device) if timing else "cpu (Triton interpreter)",
        "case": asdict(case),
        "seed": seed,
        "rows": rows,
    }


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mla-report on {result['device']}: {result['case']}")
    columns = ["recipe", "kind", "rel_l2", "cosine", "max_abs", "oracle_rel_l2"]
    if any("ms" in r for r in result["rows"]):
        columns += ["ms", "speed_vs_none"]
    for column in columns:
        table.add_column(column, justify="left" if column in ("recipe", "kind") else "right")
    for row in result["rows"]:
        cells = []
        for column in columns:
            value = row.get(column, "")
            cells.append(f"{value:.4g}" if isinstance(value, float) else str(value))
        table.add_row(*cells)
    Console(width=140).print(table)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    timed = any("ms" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(11 if timed else 6, 4), squeeze=False)
    recipes = list(dict.fromkeys(r["recipe"] for r in rows))
    for offset, kind in enumerate(("decode", "prefill")):
        values = [
            next(r.get("rel_l2", 0.0) for r in rows if r["recipe"] == name and r["kind"] == kind)
            for name in recipes
        ]
        xs = [i + 0.4 * offset for i in range(len(recipes))]
        axes[0][0].bar(xs, values, width=0.4, label=kind)
        if timed:
            speed = [
                next(r["speed_vs_none"] for r in rows if r["recipe"] == name and r["kind"] == kind)
                for name in recipes
            ]
            axes[0][1].bar(xs, speed, width=0.4, label=kind)
    for ax, title in zip(
        axes[0], ("relative L2 error vs quant none", "speed vs quant none"), strict=False
    ):
        ax.set_xticks([i + 0.2 for i in range(len(recipes))], recipes, rotation=20)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"mla-report: {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(result: dict[str, Any], out: Path) -> None:
    """Write ``report.json`` and ``report.png`` into ``out`` and print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(result, out / "report.png")
    _print_table(result)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``mla-report``."""
    parser = argparse.ArgumentParser(prog="mla-report", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="NAME=q:fmt,...",
        help="extra recipe, e.g. 'kfp8=k:fp8,v:fp8' or 'x=k:nvfp4@12,nm:2:4'",
    )
    parser.add_argument("--only", nargs="*", metavar="NAME", help="run only these recipes")
    parser.add_argument("--out", type=Path, default=Path("report"), help="output folder")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        recipes = RECIPES + tuple(parse_recipe(text) for text in args.recipe)
    except ValueError as err:
        parser.error(str(err))
    if args.only:
        unknown = set(args.only) - {r.name for r in recipes}
        if unknown:
            parser.error(f"--only: unknown recipes {sorted(unknown)}")
        recipes = tuple(r for r in recipes if r.name in args.only or r.name == "none")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads TRITON_INTERPRET when the kernels are defined (at import), so
        # start again with the interpreter switched on.
        os.environ["TRITON_INTERPRET"] = "1"
        command = [
            sys.executable,
            "-m",
            "mla_triton.report",
            *(sys.argv[1:] if argv is None else argv),
        ]
        os.execv(sys.executable, command)
    start = time.perf_counter()
    result = run_report(recipes, device, seed=args.seed, progress=not args.no_progress)
    result["seconds"] = round(time.perf_counter() - start, 1)
    write_outputs(result, args.out)
    print(
        f"wrote {args.out / 'report.json'} and {args.out / 'report.png'} in {result['seconds']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
