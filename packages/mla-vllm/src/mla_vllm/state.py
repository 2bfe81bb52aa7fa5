"""Per-layer runtime state: the layer's recipe, accuracy statistics and calibration.

Statistics and amaxes accumulate in small device tensors (no host sync on the
hot path); ``snapshot`` and ``amax_snapshot`` read them back. Nothing is recorded
while a CUDA graph is being captured.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from mla_vllm.config import LayerRecipe, ObserveConfig

__all__ = ["LayerState", "capturing", "error_stats", "layer_errors"]


@contextmanager
def layer_errors(name: str) -> Iterator[None]:
    """Prefix a ``ValueError`` raised inside with ``layer '<name>': ``, keeping its type.

    vLLM reports an error raised in a tensor-parallel worker by its message alone,
    so the message itself must say which layer failed.
    """
    try:
        yield
    except ValueError as exc:
        prefix = f"layer {name!r}: "
        if name and exc.args and not str(exc.args[0]).startswith(prefix):
            exc.args = (prefix + str(exc.args[0]), *exc.args[1:])
        raise


def capturing() -> bool:
    """True while the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def error_stats(quantized: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[rel_l2, cosine, max_abs, filled]`` (float32, on device) of two same-shape
    outputs; ``filled`` is 1 unless the reference is all zeros (an engine's dummy or
    warm-up batch: no keys behind it), whose figures mean nothing."""
    a = quantized.float().flatten()
    b = reference.float().flatten()
    diff = a - b
    ref_norm = b.norm()
    rel = diff.norm() / ref_norm.clamp_min(1e-30)
    cos = (a @ b) / (a.norm() * ref_norm).clamp_min(1e-30)
    max_abs = diff.abs().max() if diff.numel() else diff.new_zeros(())
    return torch.stack([rel, cos, max_abs, (ref_norm > 0).float()])


@dataclass
class _Running:
    """Sums and extremes of the observed statistics of one path, over the calls whose
    reference is not all zeros (``filled``); the others are only counted."""

    calls: int = 0
    total: torch.Tensor | None = None  # [4]: sum of rel_l2, cosine, max_abs; filled calls
    worst: torch.Tensor | None = None  # [3]: max rel_l2, min cosine, max max_abs

    def add(self, stats: torch.Tensor) -> None:
        self.calls += 1
        filled = stats[3]
        kept = torch.where(filled > 0, stats[:3], 0.0)  # an empty call's rel_l2 may be inf
        weighted = torch.cat([kept, filled.reshape(1)])
        # an empty call leaves the extremes alone: rel_l2 and max_abs count as 0 (they are
        # never negative) and its cosine as 2 (above any cosine)
        current = torch.stack([kept[0], torch.where(filled > 0, stats[1], 2.0), kept[2]])
        if self.total is None or self.worst is None:
            self.total = weighted
            self.worst = current
            return
        self.total += weighted
        self.worst = torch.stack(
            [
                torch.maximum(self.worst[0], current[0]),
                torch.minimum(self.worst[1], current[1]),
                torch.maximum(self.worst[2], current[2]),
            ]
        )


@dataclass
class LayerState:
    """What a quantized layer carries: its name, recipe and observers."""

    name: str
    recipe: LayerRecipe
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    calls: dict[str, int] = field(default_factory=dict)
    stats: dict[str, _Running] = field(default_factory=dict)
    calibrating: bool = False
    amax: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def should_observe(self, path: str) -> bool:
        """Count a call of ``path``; True when this call is sampled for statistics."""
        if not self.observe.enabled or capturing():
            return False
        n = self.calls.get(path, 0)
        self.calls[path] = n + 1
        return n % self.observe.interval == 0

    def record_stats(self, path: str, quantized: torch.Tensor, reference: torch.Tensor) -> None:
        """Accumulate the error statistics of one observed call."""
        self.stats.setdefault(path, _Running()).add(error_stats(quantized, reference))

    def record_amax(self, path: str, role: str, *parts: torch.Tensor) -> None:
        """Running max |x| of operand ``role`` on ``path`` while calibrating.

        The operand is given whole or in ``parts`` (e.g. ``q_nope`` and ``q_pe``,
        or the latent and rope features of K): the max is over all of them.
        """
        parts = tuple(x for x in parts if x.numel())
        if not self.calibrating or not parts or capturing():
            return
        maxima = [x.detach().abs().amax().float() for x in parts]
        value = maxima[0] if len(maxima) == 1 else torch.stack(maxima).amax()
        key = (path, role)
        old = self.amax.get(key)
        self.amax[key] = value if old is None else torch.maximum(old, value)

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per path: calls observed (``calls``: with a non-zero reference;
        ``empty_calls``: dummy or warm-up batches, left out of the figures) and the
        mean and worst rel_l2 / cosine / max_abs. A path with no filled call is left
        out."""
        out: dict[str, dict[str, float]] = {}
        for path, run in self.stats.items():
            if run.total is None or run.worst is None:
                continue
            total = run.total.tolist()
            filled = total[3]
            if filled == 0:
                continue
            worst = run.worst.tolist()
            out[path] = {
                "calls": filled,
                "empty_calls": float(run.calls) - filled,
                "rel_l2_mean": total[0] / filled,
                "rel_l2_max": worst[0],
                "cosine_mean": total[1] / filled,
                "cosine_min": worst[1],
                "max_abs_mean": total[2] / filled,
                "max_abs_max": worst[2],
            }
        return out

    def amax_snapshot(self) -> dict[str, dict[str, float]]:
        """``{"prefill"|"decode": {"q"|"k"|"v": amax}}`` of what was recorded (> 0)."""
        out: dict[str, dict[str, float]] = {}
        for (path, role), value in sorted(self.amax.items()):
            v = float(value)
            if v > 0.0 and v == v and v != float("inf"):
                out.setdefault(path, {})[role] = v
        return out

    def reset(self) -> None:
        """Forget statistics and recorded amaxes."""
        self.calls.clear()
        self.stats.clear()
        self.amax.clear()
