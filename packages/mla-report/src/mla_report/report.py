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
    "BUILTIN_NAMES",
    "RECIPES",
    "Case",
    "Recipe",
    "build_parser",
    "check_recipe",
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
    # N:M applies to prefill only (docs/numerics.md "N:M sparsity"): its decode row
    # repeats plain nvfp4.
    Recipe("nvfp4+2:4", AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4, 4, 16)),
)


BUILTIN_NAMES: tuple[str, ...] = tuple(r.name for r in RECIPES)
_ROLES = ("q", "k", "p", "v")


def _reason(err: ValueError, *arguments: str) -> str:
    """``err``'s message without a leading ``"<argument>: "`` of one of ``arguments``."""
    message = str(err)
    for argument in arguments:
        if message.startswith(f"{argument}: "):
            return message[len(argument) + 2 :]
    return message


def parse_recipe(text: str) -> Recipe:
    """Parse ``name=q:fmt,k:fmt,p:fmt,v:fmt[,nm:N:M]`` (omitted operands are not quantized).

    A format may carry a static amax after ``@``, e.g. ``k:nvfp4@12.5``. The recipe's
    ``mla_formats`` objects are built here, so anything they refuse raises now, as a
    ``ValueError`` naming the recipe and the role (``recipe 'x', role k: ...``). A name
    may not shadow a built-in recipe and a role may be given once.
    """
    name, sep, body = text.partition("=")
    if not sep or not name or not body:
        raise ValueError(f"--recipe: expected name=q:fmt,k:fmt,..., got {text!r}")
    where = f"recipe {name!r}"
    if name in BUILTIN_NAMES:
        raise ValueError(
            f"{where}: the name of a built-in recipe ({', '.join(BUILTIN_NAMES)}); "
            "choose another name"
        )
    operands: dict[str, OperandQuant] = {}
    sparsity = None
    seen: set[str] = set()
    for item in body.split(","):
        role, _, spec = item.partition(":")
        if role not in (*_ROLES, "nm") or not spec:
            raise ValueError(f"{where}: bad operand {item!r} (roles q, k, p, v, nm)")
        here = f"{where}, role {role}"
        if role in seen:
            raise ValueError(f"{here}: given twice")
        seen.add(role)
        if role == "nm":
            n, _, m = spec.partition(":")
            if not (n.isdigit() and m.isdigit()):
                raise ValueError(f"{here}: N:M needs two integers, got {item!r}")
            try:
                sparsity = NMSparsity(int(n), int(m))
            except ValueError as err:
                raise ValueError(f"{here}: {err}") from None
            continue
        fmt, _, amax = spec.partition("@")
        value: float | str | None = None
        if amax == "dynamic":
            value = amax
        elif amax:
            try:
                value = float(amax)
            except ValueError:
                raise ValueError(
                    f"{here}: amax must be a number or 'dynamic', got {amax!r}"
                ) from None
        try:
            operand = OperandQuant(fmt, value)  # type: ignore[arg-type]
            AttentionQuant(**{role: operand})  # the checks of the role alone
        except ValueError as err:
            raise ValueError(f"{here}: {_reason(err, 'fmt', 'amax', role)}") from None
        operands[role] = operand
    try:
        quant = AttentionQuant(**operands)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return Recipe(name, quant, sparsity)


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


def _inputs(
    case: Case, device: torch.device, seed: int, *, empty: bool = False
) -> dict[str, torch.Tensor]:
    """The report's seeded inputs; ``empty``: the same tensors with no request or token."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dtype = getattr(torch, case.dtype)

    def normal(*shape: int, outliers: int = 4) -> torch.Tensor:
        x = torch.randn(*shape, generator=g)
        cols = torch.randperm(shape[-1], generator=g)[:outliers]
        x[..., cols] *= 8.0  # a few outlier channels, as real activations have
        return x.to(device=device, dtype=dtype)

    b, length, page = case.decode_batch, case.decode_len, case.page_size
    prefill_len = case.prefill_len
    if empty:  # no decode request; one prefill request of no token
        b = length = prefill_len = 0
    pages_per_seq = max(1, math.ceil(length / page))
    num_pages = max(1, b * pages_per_seq)
    block_table = torch.randperm(num_pages, generator=g)[: b * pages_per_seq]
    t = case.prefill_batch * prefill_len
    cu = torch.arange(case.prefill_batch + 1) * prefill_len
    return {
        "q_decode": normal(b, case.heads, 576),
        "kv_cache": normal(num_pages, page, 576),
        "block_table": block_table.reshape(b, pages_per_seq).to(device=device, dtype=torch.int32),
        "seq_lens": torch.full((b,), length, dtype=torch.int32, device=device),
        "q": normal(t, case.heads, 192),
        "k": normal(t, case.heads, 192),
        "v": normal(t, case.heads, 128),
        "cu": cu.to(device=device, dtype=torch.int32),
    }


SCALE = 1.0 / math.sqrt(192.0)  # DeepSeek-V3 scales by the unabsorbed head dim


def _decode(
    data: dict[str, torch.Tensor], recipe: Recipe, *, oracle: torch.dtype | None = None
) -> torch.Tensor:
    """The decode kernel's output; with ``oracle`` (its compute dtype) the oracle's."""
    import mla_reference
    import mla_triton

    args = (data["q_decode"], data["kv_cache"], data["block_table"], data["seq_lens"])
    if oracle is None:
        out, _ = mla_triton.decode(*args, softmax_scale=SCALE, quant=recipe.quant)
    else:
        out, _ = mla_reference.decode(
            *args, softmax_scale=SCALE, quant=recipe.quant, compute_dtype=oracle
        )
    return out


def _prefill(
    data: dict[str, torch.Tensor], recipe: Recipe, case: Case, *, oracle: torch.dtype | None = None
) -> torch.Tensor:
    """The prefill kernel's output; with ``oracle`` (its compute dtype) the oracle's."""
    import mla_reference
    import mla_triton

    args = (data["q"], data["k"], data["v"], data["cu"], data["cu"])
    if oracle is None:
        return mla_triton.prefill(
            *args,
            softmax_scale=SCALE,
            causal=True,
            quant=recipe.quant,
            sparsity=recipe.sparsity,
            max_seqlen_q=case.prefill_len,
            max_seqlen_k=case.prefill_len,
        )
    return mla_reference.prefill(
        *args,
        softmax_scale=SCALE,
        causal=True,
        quant=recipe.quant,
        sparsity=recipe.sparsity,
        compute_dtype=oracle,
    )


def check_recipe(recipe: Recipe, device: torch.device, case: Case | None = None) -> None:
    """Run the argument checks of the report's kernels and oracles on ``recipe``.

    Each call gets the report's tensors with no request and no token, so nothing is
    launched: only the kernels' own validation runs (for example prefill's N:M group
    against its key tile on ``device``). Each quantized role and the sparsity are
    checked alone first, so that a ``ValueError`` names the role
    (``recipe 'x', role nm: ...``); then the whole recipe.
    """
    case = case or Case.for_device(device)
    data = _inputs(case, device, 0, empty=True)
    parts: list[tuple[str, Recipe]] = []
    if recipe.quant is not None:
        for role in _ROLES:
            operand = getattr(recipe.quant, role)
            if not operand.is_identity:
                alone = Recipe(recipe.name, AttentionQuant(**{role: operand}))
                parts.append((f", role {role}", alone))
    if recipe.sparsity is not None:
        parts.append((", role nm", Recipe(recipe.name, None, recipe.sparsity)))
    parts.append(("", recipe))
    for where, part in parts:
        try:
            for oracle in (None, torch.float64):
                _decode(data, part, oracle=oracle)
                _prefill(data, part, case, oracle=oracle)
        except ValueError as err:
            reason = _reason(err, "quant", "sparsity")
            raise ValueError(
                f"recipe {recipe.name!r}{where}: {reason} (the kernels on {device.type})"
            ) from None


def _errors(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    x64, r64 = x.double().flatten(), ref.double().flatten()
    return {
        "rel_l2": float((x64 - r64).norm() / r64.norm().clamp_min(1e-30)),
        # clamped: float64 rounding can put equal vectors a ulp above 1 (the reduction's
        # order depends on the CPU's vector width)
        "cosine": min(
            1.0, max(-1.0, float(torch.nn.functional.cosine_similarity(x64, r64, dim=0)))
        ),
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

    case = case or Case.for_device(device)
    data = _inputs(case, device, seed)
    timing = device.type == "cuda"
    oracle_dtype = torch.float32 if timing else torch.float64

    def run_decode(recipe: Recipe, oracle: torch.dtype | None = None) -> torch.Tensor:
        return _decode(data, recipe, oracle=oracle)

    def run_prefill(recipe: Recipe, oracle: torch.dtype | None = None) -> torch.Tensor:
        return _prefill(data, recipe, case, oracle=oracle)

    rows: list[dict[str, Any]] = []
    baseline: dict[str, torch.Tensor] = {}
    base_ms: dict[str, float] = {}
    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("recipes", total=len(recipes) * 2)
        for recipe in recipes:
            for kind, kernel in (("decode", run_decode), ("prefill", run_prefill)):
                bar.update(task, description=f"{recipe.name} {kind}")
                out = kernel(recipe)
                oracle = kernel(recipe, oracle_dtype)
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


def _device(text: str) -> torch.device:
    """``--device``: ``cpu``, ``cuda``, ``cuda:N`` or ``gpu`` (``cuda``); CUDA must exist."""
    name = "cuda" + text[3:] if text.startswith("gpu") else text
    expected = f"expected cpu, cuda, cuda:N or gpu, got {text!r}"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise argparse.ArgumentTypeError(expected) from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(expected)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(
                f"{text!r}: no CUDA device here (torch.cuda.is_available() is False); "
                "use --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: only {torch.cuda.device_count()} CUDA devices here"
            )
    return device


def _recipe(text: str) -> Recipe:
    try:
        return parse_recipe(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _use_interpreter(argv: list[str]) -> None:
    """Switch Triton's CPU interpreter on before the kernels are defined."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when a kernel is defined
    if "mla_triton" in sys.modules:  # its kernels exist already: start again
        os.execv(sys.executable, [sys.executable, "-m", "mla_report", *argv])


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``(default: X)`` after each option's help, but where the help says the default
    itself (a default of None or an empty list) or the option is a flag."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        unset = action.default is None or action.default is False or action.default == []
        if unset or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


DESCRIPTION = """\
What each quantization recipe does to DeepSeek-V3-shaped MLA attention: for every recipe
the decode and prefill kernels run on the same seeded inputs; the report gives their
error against the unquantized kernel (relative L2, cosine, max abs), their disagreement
with the eager oracle of mla-reference for the same recipe, and on a GPU the kernel time.
Results go to report.json and report.png in --out. On a CPU the kernels run in Triton's
interpreter at small sizes (about a minute)."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mla-report``."""
    from mla_report import __version__

    parser = argparse.ArgumentParser(
        prog="mla-report",
        description=DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--recipe",
        action="append",
        default=[],
        type=_recipe,
        metavar="NAME=q:fmt,...",
        help="an extra recipe, e.g. 'kfp8=k:fp8,v:fp8' or 'x=k:nvfp4@12,nm:2:4' (formats "
        "fp8, nvfp4; '@' a static amax; nm:N:M prefill sparsity); repeat for more",
    )
    parser.add_argument(
        "--only",
        nargs="*",
        metavar="NAME",
        help=f"run only these recipes, and none (default: all; built in: "
        f"{', '.join(BUILTIN_NAMES)})",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("report"), help="output folder, made if missing"
    )
    parser.add_argument(
        "--device",
        type=_device,
        default=None,
        help="cpu, cuda, cuda:N or gpu (= cuda) (default: cuda if present, else cpu)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the random inputs (the same for every recipe)"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (default: a progress bar on the terminal)",
    )
    return parser


def _check_out(out: Path) -> None:
    """``--out`` is a folder, or can be made: checked before any kernel runs."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {str(out)!r} is a file; expected a folder")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--out: cannot make {str(out)!r}: {str(existing)!r} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--out: cannot write into {str(existing)!r} (permission denied)")


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``mla-report``.

    Bad options are usage errors (exit code 2, one line, before any work): each
    ``--recipe`` is built into its ``mla_formats`` objects and checked against the
    kernels' own validation on the chosen device before the first kernel runs.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_out(args.out)
    except ValueError as err:
        parser.error(str(err))
    extra: list[Recipe] = args.recipe
    names = [r.name for r in extra]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        parser.error(f"--recipe: names given twice: {', '.join(twice)}")
    recipes = RECIPES + tuple(extra)
    if args.only:
        unknown = set(args.only) - {r.name for r in recipes}
        if unknown:
            parser.error(f"--only: unknown recipes {sorted(unknown)}")
        recipes = tuple(r for r in recipes if r.name in args.only or r.name == "none")
    device: torch.device = args.device or torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"
    )
    if device.type == "cpu":
        _use_interpreter(sys.argv[1:] if argv is None else argv)
    for recipe in extra:
        try:
            check_recipe(recipe, device)
        except ValueError as err:
            parser.error(f"--recipe: {err}")
    start = time.perf_counter()
    result = run_report(recipes, device, seed=args.seed, progress=not args.no_progress)
    result["seconds"] = round(time.perf_counter() - start, 1)
    write_outputs(result, args.out)
    print(
        f"wrote {args.out / 'report.json'} and {args.out / 'report.png'} in {result['seconds']} s"
    )
    return 0
