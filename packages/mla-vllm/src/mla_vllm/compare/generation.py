"""Generation fidelity: what a recipe costs at the tokens it generates (decode), not only
at the prompt's tokens (prefill).

The recipe's engine generates freely and returns its top-k logprobs at every generated
position; the native engine then scores the same token sequences (prompt logprobs over
the generated continuation). Pure torch (float64), no vLLM. Per generated position:

- ``kl``: KL(native || recipe) from the two top-k lists (``metrics.kl_topk``: the
  coarse-grained lower bound that prompt scoring uses);
- ``top1``: 1 where both engines' most likely token is the same;
- ``dnll``: NLL under native minus NLL under the recipe of the token the recipe
  generated: how much less likely the native model finds the recipe's text (0 for
  identical engines; its mean over sampled text estimates KL(recipe || native));
- ``acceptance``: ``Σ min(P, Q)`` over the shared top-k (``metrics.expected_acceptance``),
  the chance that speculative sampling accepts one engine's token under the other.

``summarize_generation`` aggregates them by generated position (``POSITION_EDGES``),
by context length (prompt plus generated tokens, ``CONTEXT_EDGES``) and per prompt, with
a seeded percentile bootstrap confidence interval for every mean. The bootstrap draws
whole prompts (``bootstrap_mean``'s ``groups``): the positions of one generation are
not independent, so drawing positions would make the intervals too narrow.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mla_vllm.compare.metrics import TopK, expected_acceptance, kl_topk

__all__ = [
    "CONTEXT_EDGES",
    "METRICS",
    "POSITION_EDGES",
    "Generated",
    "bootstrap_mean",
    "bucket_label",
    "curve",
    "position_metrics",
    "summarize_generation",
]

POSITION_EDGES = (0, 256, 1024, 4096, 16384)
"""Lower edges of the generated-position buckets: 0-256, 256-1k, 1k-4k, 4k-16k, 16k+."""
CONTEXT_EDGES = (0, 1024, 4096, 16384, 65536)
"""Lower edges of the context-length buckets: 0-1k, 1k-4k, 4k-16k, 16k-64k, 64k+."""
METRICS = ("kl", "top1", "dnll", "acceptance")
QUANTILES = (0.5, 0.9, 0.99)
_BLOCK = 1 << 22  # bootstrap draws held at once (resamples x groups)


@dataclass(frozen=True)
class Generated:
    """One prompt's generated continuation, as both engines saw it.

    Attributes:
        prompt_len: tokens of the prompt (the context before the first generated token).
        native: the native engine's top-k at each generated position (scoring the
            recipe's tokens); ``target`` is its logprob of the generated token.
        recipe: the recipe engine's top-k at the same positions (from its sampling);
            ``target`` is its logprob of the token it generated.
    """

    prompt_len: int
    native: TopK
    recipe: TopK

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len: expected >= 1, got {self.prompt_len}")
        if self.native.ids.shape[0] != self.recipe.ids.shape[0]:
            raise ValueError(
                f"native: {self.native.ids.shape[0]} generated positions, the recipe has "
                f"{self.recipe.ids.shape[0]}"
            )


def position_metrics(native: TopK, recipe: TopK) -> dict[str, torch.Tensor]:
    """Per position ``[N]`` float64: ``kl``, ``rest`` (native mass outside the shared
    top-k), ``top1``, ``dnll`` and ``acceptance`` (module docstring)."""
    kl, rest = kl_topk(native, recipe)
    return {
        "kl": kl,
        "rest": rest,
        "top1": (native.ids[:, 0] == recipe.ids[:, 0]).double(),
        "dnll": recipe.target.double() - native.target.double(),
        "acceptance": expected_acceptance(native, recipe),
    }


def bootstrap_mean(
    values: torch.Tensor,
    groups: torch.Tensor | None = None,
    *,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """The mean of ``values`` and its percentile bootstrap interval at ``level``.

    With ``groups`` (one id per value), whole groups are drawn with replacement and each
    resample's mean is token-weighted (sum of the drawn groups' values over their
    count); without, each value is its own group. Seeded: the same input gives the same
    interval. Returns ``mean``, ``low``, ``high`` and ``n`` (values); NaN without values.
    """
    if resamples < 1:
        raise ValueError(f"resamples: expected >= 1, got {resamples}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: expected in (0, 1), got {level}")
    v = values.double().reshape(-1)
    n = v.numel()
    if n == 0:
        return {"mean": math.nan, "low": math.nan, "high": math.nan, "n": 0}
    if groups is None:
        inverse = torch.arange(n)
    else:
        if groups.reshape(-1).shape != v.shape:
            raise ValueError(f"groups: expected {n} group ids, got {groups.numel()}")
        inverse = torch.unique(groups.reshape(-1), return_inverse=True)[1]
    count = int(inverse.max()) + 1
    sums = torch.zeros(count, dtype=torch.float64).index_add_(0, inverse, v)
    sizes = torch.zeros(count, dtype=torch.float64).index_add_(0, inverse, torch.ones_like(v))
    gen = torch.Generator().manual_seed(seed)
    step = max(1, _BLOCK // count)
    means = []
    for start in range(0, resamples, step):
        draws = torch.randint(count, (min(step, resamples - start), count), generator=gen)
        means.append(sums[draws].sum(dim=1) / sizes[draws].sum(dim=1))
    q = torch.tensor([(1.0 - level) / 2.0, (1.0 + level) / 2.0], dtype=torch.float64)
    low, high = torch.quantile(torch.cat(means), q).tolist()
    return {"mean": float(v.mean()), "low": low, "high": high, "n": n}


def bucket_label(edges: Sequence[int], i: int) -> str:
    """``"256-1k"`` for bucket ``i`` of ``edges``; the last is open (``"16k+"``)."""

    def short(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)

    if i == len(edges) - 1:
        return f"{short(edges[i])}+"
    return f"{short(edges[i])}-{short(edges[i + 1])}"


def _figures(
    m: Mapping[str, torch.Tensor], groups: torch.Tensor, resamples: int, level: float, seed: int
) -> dict[str, object]:
    """Means with intervals, KL quantiles and max, over the positions of ``m``."""
    out: dict[str, object] = {
        "positions": int(m["kl"].numel()),
        "prompts": int(torch.unique(groups).numel()),
    }
    for name in METRICS:
        out[name] = bootstrap_mean(m[name], groups, resamples=resamples, level=level, seed=seed)
    kl = m["kl"]
    if kl.numel():
        values = torch.quantile(kl, torch.tensor(QUANTILES, dtype=kl.dtype)).tolist()
        for q, v in zip(QUANTILES, values, strict=True):
            out[f"kl_p{round(q * 100)}"] = float(v)
        out["kl_max"] = float(kl.max())
        out["rest_mass_mean"] = float(m["rest"].mean())
    return out


def _bucketed(
    m: Mapping[str, torch.Tensor],
    key: torch.Tensor,
    groups: torch.Tensor,
    edges: Sequence[int],
    resamples: int,
    level: float,
    seed: int,
) -> dict[str, dict[str, object]]:
    """``_figures`` per bucket of ``key`` (only buckets that hold positions)."""
    bounds = torch.tensor(list(edges[1:]), dtype=key.dtype)
    index = torch.bucketize(key, bounds, right=True)
    out: dict[str, dict[str, object]] = {}
    for i in range(len(edges)):
        mask = index == i
        if bool(mask.any()):
            part = {name: t[mask] for name, t in m.items()}
            out[bucket_label(edges, i)] = _figures(part, groups[mask], resamples, level, seed)
    return out


def curve(
    position: torch.Tensor, values: Mapping[str, torch.Tensor], points: int = 64
) -> dict[str, list[float]]:
    """Means of ``values`` over equal windows of generated position, for a plot: the
    window start (``position``) and, per metric, the mean of its positions."""
    if points < 1:
        raise ValueError(f"points: expected >= 1, got {points}")
    if position.numel() == 0:
        return {"position": [], **{name: [] for name in values}}
    width = max(1, math.ceil((int(position.max()) + 1) / points))
    window = torch.div(position, width, rounding_mode="floor")
    present = torch.unique(window)
    out: dict[str, list[float]] = {"position": (present * width).double().tolist()}
    for name, v in values.items():
        out[name] = [float(v[window == w].double().mean()) for w in present]
    return out


def summarize_generation(
    prompts: Sequence[Generated],
    *,
    position_edges: Sequence[int] = POSITION_EDGES,
    context_edges: Sequence[int] = CONTEXT_EDGES,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, object]:
    """Every figure of one recipe's generations: ``overall``, ``by_position``,
    ``by_context``, ``per_prompt`` and ``curve`` (JSON-able).

    Each mean is ``{"mean", "low", "high", "n"}`` (bootstrap over prompts, ``level``
    interval, ``seed``); KL also has p50/p90/p99/max. ``per_prompt[i]`` holds prompt
    ``i``'s generated length and means, and ``first_top1_miss`` (the first generated
    position whose top-1 differs from native's; None when none does).
    """
    if not prompts:
        raise ValueError("prompts: expected at least one generation")
    for name, edges in (("position_edges", position_edges), ("context_edges", context_edges)):
        if not edges or edges[0] != 0 or any(b <= a for a, b in itertools.pairwise(edges)):
            raise ValueError(f"{name}: expected increasing edges from 0, got {list(edges)}")
    parts = [position_metrics(p.native, p.recipe) for p in prompts]
    m = {name: torch.cat([part[name] for part in parts]) for name in parts[0]}
    lengths = [int(part["kl"].numel()) for part in parts]
    groups = torch.repeat_interleave(torch.arange(len(prompts)), torch.tensor(lengths))
    position = torch.cat([torch.arange(n) for n in lengths]).to(torch.int64)
    context = position + torch.repeat_interleave(
        torch.tensor([p.prompt_len for p in prompts], dtype=torch.int64), torch.tensor(lengths)
    )
    per_prompt: list[dict[str, object]] = []
    for p, part in zip(prompts, parts, strict=True):
        misses = (part["top1"] == 0).nonzero()
        entry: dict[str, object] = {"prompt_len": p.prompt_len, "generated": part["kl"].numel()}
        for name in METRICS:
            entry[f"{name}_mean"] = float(part[name].mean()) if part[name].numel() else math.nan
        entry["kl_max"] = float(part["kl"].max()) if part["kl"].numel() else math.nan
        entry["first_top1_miss"] = int(misses[0, 0]) if misses.numel() else None
        per_prompt.append(entry)
    args = (resamples, level, seed)
    return {
        "level": level,
        "resamples": resamples,
        "overall": _figures(m, groups, *args),
        "by_position": _bucketed(m, position, groups, position_edges, *args),
        "by_context": _bucketed(m, context, groups, context_edges, *args),
        "per_prompt": per_prompt,
        "curve": curve(position, {"kl": m["kl"], "top1": m["top1"]}),
    }
