"""Bounds of the quantized runs against the unquantized native run of the same mode.

Each quantized configuration (nvfp4 decoding on read and through the write-once
shadow, eager and with CUDA graphs; fp8; nvfp4 with a calibration file) is
compared with ``TRITON_MLA`` in the same mode (``triton_eager`` or
``triton_graphs``) on the same prompts. The bounds come from the run recorded in
``tests-vllm-e2e/results/`` (H200, vLLM 0.33.0, torch 2.14.0+cu130, weights sha256
``cf79adda9a4d``, packages at commit ``925436e``; ``MEASURED`` below holds its
numbers, to four significant digits), by stated margins:

- logprobs, against the native run (``checks.max_diff``): max |Δ prompt logprob|
  and max |Δ generated logprob| (up to each prompt's first greedy divergence)
  at most ``LOGPROB_MARGIN`` (3) times the recorded value; mean |Δ prompt
  logprob| between the recorded value divided and multiplied by 3. A maximum over
  some 460 prompt positions and 64 generated tokens rests on a few outliers, and
  the recorded runs already vary by 1.8x between configurations of one recipe
  (nvfp4 generated max 0.122 eager, 0.152 with graphs, 0.217 calibrated), hence 3.
  The lower bound on the mean says the recipe really moved the logprobs: the
  unquantized ``MLA_QUANT`` runs moved them by a mean of 0.0045 (eager) and 0.0038
  (graphs) nats, below nvfp4's lower bounds (0.0144 to 0.0148), but not below fp8's
  (0.0049): for fp8 the statistics' lower bound does that job.
- per-layer error statistics (eager runs that observe, ``mla_vllm.get_stats``:
  the quantized attention output against the unquantized one of the same call),
  every layer, path and rank: ``rel_l2_max`` at most ``STATS_MARGIN`` (1.5) times
  the recorded largest, ``rel_l2_mean`` at least the recorded smallest divided by
  1.5. These are means over 4 prefill and 18 decode calls of deterministic
  kernels: the recorded default and calibrated nvfp4 runs differ by 6%, and the
  TP=1/TP=2 comparison allows 15% (``tp.STATS_REL_TOL``); 1.5 leaves more than
  three times that. The lower bound catches a recipe that is not applied
  (rel_l2 0) or a weaker one in its place (fp8's 0.041 to 0.055 for nvfp4's 0.096
  lower bound).

The same bounds hold at TP > 1 (measured at TP=1): the TP=2 runs' logprobs stay
within 0.15 nats of TP=1's (``tp.TP_TOL``), well inside the margins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .logprobs import describe_diff

LOGPROB_MARGIN = 3.0
STATS_MARGIN = 1.5


@dataclass(frozen=True)
class Measured:
    """What the recorded run measured for one quantized configuration."""

    native: str  # the unquantized run it is compared with
    prompt_max: float  # max |Δ prompt logprob|, nats
    prompt_mean: float  # mean |Δ prompt logprob|, nats
    gen_max: float  # max |Δ generated logprob| before the first divergence, nats
    rel_l2_max: float | None = None  # largest rel_l2_max over layers and paths
    rel_l2_mean_min: float | None = None  # smallest rel_l2_mean over layers and paths


# tests-vllm-e2e/results/<name>.json against results/<native>.json (summary.txt's lines).
MEASURED: dict[str, Measured] = {
    "nvfp4_eager": Measured("triton_eager", 0.2326, 0.04451, 0.1220, 0.1854, 0.1439),
    "nvfp4_shadow_eager": Measured("triton_eager", 0.2326, 0.04451, 0.1220, 0.1854, 0.1438),
    "fp8_eager": Measured("triton_eager", 0.06978, 0.01469, 0.06166, 0.05520, 0.04077),
    "nvfp4_calibrated": Measured("triton_eager", 0.2333, 0.04328, 0.2175, 0.1961, 0.1435),
    "nvfp4_graphs": Measured("triton_graphs", 0.2142, 0.04426, 0.1524),
    "nvfp4_shadow_graphs": Measured("triton_graphs", 0.2142, 0.04426, 0.1524),
}


@dataclass(frozen=True)
class Bounds:
    """The bounds one quantized configuration must keep (nats; rel_l2 unitless)."""

    prompt_max: float
    prompt_mean_low: float
    prompt_mean_high: float
    gen_max: float
    rel_l2_max: float | None
    rel_l2_mean_low: float | None


def bounds(name: str) -> Bounds:
    """``name``'s bounds: ``MEASURED`` times or divided by the margins."""
    if name not in MEASURED:
        raise ValueError(f"name: {name!r} is not a bounded configuration; {list(MEASURED)}")
    m = MEASURED[name]
    return Bounds(
        prompt_max=LOGPROB_MARGIN * m.prompt_max,
        prompt_mean_low=m.prompt_mean / LOGPROB_MARGIN,
        prompt_mean_high=LOGPROB_MARGIN * m.prompt_mean,
        gen_max=LOGPROB_MARGIN * m.gen_max,
        rel_l2_max=None if m.rel_l2_max is None else STATS_MARGIN * m.rel_l2_max,
        rel_l2_mean_low=None if m.rel_l2_mean_min is None else m.rel_l2_mean_min / STATS_MARGIN,
    )


def logprob_check(name: str, d: dict[str, Any]) -> tuple[str, bool, str]:
    """``(label, ok, value)`` of ``name``'s logprobs; ``d``: ``max_diff(native, name)``."""
    b = bounds(name)
    ok = (
        d["prompt_max"] <= b.prompt_max
        and b.prompt_mean_low <= d["prompt_mean"] <= b.prompt_mean_high
        and d["gen_max"] <= b.gen_max
    )
    label = (
        f"{name} vs {MEASURED[name].native} (prompt max {b.prompt_max:.3f}, mean "
        f"{b.prompt_mean_low:.4f} to {b.prompt_mean_high:.4f}, generated max {b.gen_max:.3f} "
        f"nats: {LOGPROB_MARGIN:g}x the recorded run)"
    )
    value = describe_diff(d)
    return label, ok, value


def stats_check(name: str, stats: dict[str, Any] | None) -> tuple[str, bool, str] | None:
    """``(label, ok, value)`` of ``name``'s per-layer statistics; None: not bounded."""
    b = bounds(name)
    if b.rel_l2_max is None or b.rel_l2_mean_low is None:
        return None
    entries = [
        (f"{layer} {path}", s)
        for layer, per_path in (stats or {}).items()
        for path, s in per_path.items()
    ]
    label = (
        f"{name}: every layer's rel_l2 mean at least {b.rel_l2_mean_low:.4f} and max at most "
        f"{b.rel_l2_max:.4f} ({STATS_MARGIN:g}x the recorded run)"
    )
    if not entries:
        return label, False, "no statistics"
    low = min(entries, key=lambda e: float(e[1]["rel_l2_mean"]))
    high = max(entries, key=lambda e: float(e[1]["rel_l2_max"]))
    ok = all(
        float(s["rel_l2_mean"]) >= b.rel_l2_mean_low and float(s["rel_l2_max"]) <= b.rel_l2_max
        for _, s in entries
    )
    value = (
        f"smallest mean {low[1]['rel_l2_mean']:.4f} ({low[0]}), largest max "
        f"{high[1]['rel_l2_max']:.4f} ({high[0]}) over {len(entries)} layer paths"
    )
    return label, ok, value
