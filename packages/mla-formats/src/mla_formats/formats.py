"""Descriptions of the quantization formats and of an attention layer's recipe.

``Format`` says how one tensor is rounded; ``OperandQuant`` adds where its global
scale comes from (a static amax or ``"dynamic"``); ``AttentionQuant`` names the
recipe of the four attention matmul operands q, k, p and v; ``NMSparsity`` the
N:M score sparsity of prefill. All are frozen dataclasses, so they hash and can
key kernel caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "FORMATS",
    "FP8",
    "NONE",
    "NVFP4",
    "AmaxSpec",
    "AttentionQuant",
    "Format",
    "FormatLike",
    "NMSparsity",
    "OperandLike",
    "OperandQuant",
    "get_format",
]

FormatName = Literal["none", "fp8", "nvfp4"]


@dataclass(frozen=True)
class Format:
    """One quantization format.

    Attributes:
        name: ``"none"``, ``"fp8"`` or ``"nvfp4"``.
        block_size: elements sharing a block scale along the blocked axis
            (16 for nvfp4); ``None`` when the format has no block scales.
        unit_amax: the amax for which the global scale is 1 (448 for fp8,
            6 * 448 = 2688 for nvfp4); it is also ``qdq``'s default amax.
    """

    name: FormatName
    block_size: int | None
    unit_amax: float

    @property
    def is_identity(self) -> bool:
        """True for ``none``."""
        return self.name == "none"

    def global_scale(self, amax: float) -> float:
        """The float32 global scale for a static ``amax`` (``amax / unit_amax``)."""
        return amax / self.unit_amax


NONE = Format("none", None, 1.0)
FP8 = Format("fp8", None, 448.0)
NVFP4 = Format("nvfp4", 16, 6.0 * 448.0)
FORMATS: dict[str, Format] = {f.name: f for f in (NONE, FP8, NVFP4)}

FormatLike = str | Format


def get_format(fmt: FormatLike, *, argument: str = "fmt") -> Format:
    """Resolve a format name or ``Format``; unknown names raise ``ValueError``."""
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"{argument}: unknown format {fmt!r}; expected one of {sorted(FORMATS)}")


AmaxSpec = float | Literal["dynamic"]


FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: a static amax must not exceed it."""
FLOAT32_TINY = 1.1754943508222875e-38
"""The smallest normal float32: a static global scale must not fall below it."""


def check_scale(fmt: Format, amax: float, argument: str) -> None:
    """A ``ValueError`` naming ``argument`` where a static ``amax`` of ``fmt`` has no
    usable float32 global scale: beyond float32's range, or a scale ``amax / unit_amax``
    below the smallest normal float32 (its reciprocal, which the kernels multiply by,
    would overflow and the QDQ would return NaN or inf)."""
    if fmt.is_identity:
        return
    if amax > FLOAT32_MAX:
        raise ValueError(
            f"{argument}: amax {amax!r} is beyond float32's range (at most {FLOAT32_MAX:.4g}); "
            "global scales are float32"
        )
    scale = fmt.global_scale(amax)
    if scale < FLOAT32_TINY:
        raise ValueError(
            f"{argument}: amax {amax!r} gives the global scale {scale:.3g} (amax / "
            f"{fmt.unit_amax:g}), below float32's smallest normal {FLOAT32_TINY:.4g}; use an "
            f"amax of at least {FLOAT32_TINY * fmt.unit_amax:.4g}"
        )


def _check_amax(amax: object, argument: str) -> AmaxSpec:
    if amax == "dynamic":
        return "dynamic"
    if isinstance(amax, bool) or not isinstance(amax, (int, float)):
        raise ValueError(
            f"{argument}: expected a positive finite number or 'dynamic', got {amax!r}"
        )
    value = float(amax)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{argument}: amax must be positive and finite, got {amax!r}")
    return value


@dataclass(frozen=True)
class OperandQuant:
    """A format plus the source of its global scale.

    ``amax`` is a positive float (static: one global scale for the layer's
    operand) or ``"dynamic"`` (computed from each token's vector in each head).
    ``None`` means "the default for the operand's role", resolved by
    ``AttentionQuant``; used alone it means the format's ``unit_amax``.
    """

    format: Format
    amax: AmaxSpec | None = None

    def __init__(self, fmt: FormatLike, amax: AmaxSpec | None = None) -> None:
        fmt_ = get_format(fmt)
        object.__setattr__(self, "format", fmt_)
        if amax is not None:
            amax = _check_amax(amax, "amax")
            if amax != "dynamic":
                check_scale(fmt_, amax, "amax")
        object.__setattr__(self, "amax", amax)

    @property
    def is_identity(self) -> bool:
        """True when the operand is not quantized."""
        return self.format.is_identity

    @property
    def is_dynamic(self) -> bool:
        """True for a per-token, per-head amax."""
        return self.amax == "dynamic"

    def static_amax(self) -> float:
        """The static amax (``unit_amax`` when unset); ``ValueError`` if dynamic."""
        if self.amax == "dynamic":
            raise ValueError("amax: operand uses a dynamic amax, it has no static value")
        return self.format.unit_amax if self.amax is None else self.amax

    def global_scale(self) -> float:
        """The static global scale ``amax / unit_amax`` (1.0 for ``none``)."""
        if self.is_identity:
            return 1.0
        return self.format.global_scale(self.static_amax())


OperandLike = str | Format | OperandQuant | None

# Defaults per role (docs/numerics.md "Scales"): K and V at the unit amax (global
# scale 1); P at 1.0, since the kernels' P never exceeds 1; Q dynamic.
_DEFAULT_AMAX: dict[str, AmaxSpec | None] = {"q": "dynamic", "k": None, "p": 1.0, "v": None}


def _resolve_operand(value: OperandLike, role: str) -> OperandQuant:
    if value is None:
        return OperandQuant("none")
    if isinstance(value, OperandQuant):
        operand = value
        if isinstance(operand.amax, float):
            check_scale(operand.format, operand.amax, role)
    elif isinstance(value, (str, Format)):
        operand = OperandQuant(get_format(value, argument=role))
    else:
        raise ValueError(f"{role}: expected a format name, Format or OperandQuant, got {value!r}")
    if operand.is_identity:
        return OperandQuant("none")
    amax = operand.amax if operand.amax is not None else _DEFAULT_AMAX[role]
    if amax is None:
        amax = operand.format.unit_amax
    if amax == "dynamic" and role in ("p", "v"):
        raise ValueError(
            f"{role}: a dynamic amax is only defined for operands blocked along the feature "
            "axis (q, k); p and v take a static amax"
        )
    if role == "p" and isinstance(amax, float) and amax < 1.0:
        raise ValueError(
            f"p: a static amax below 1 is refused, got {amax!r}: P = 2^(t - m) lies in "
            "(0, 1] only relative to the row's final reference point m; a kernel's online "
            "softmax quantizes P against its running maximum, so with an amax below 1 "
            "whether a P value saturates would depend on the tile and split counts "
            "(use an amax >= 1; the default is 1.0)"
        )
    return OperandQuant(operand.format, amax)


@dataclass(frozen=True)
class AttentionQuant:
    """The quantization recipe of one attention layer (docs/numerics.md "Operands and axes").

    Each of ``q``, ``k``, ``p`` and ``v`` is given as a format name (that format
    with the role's default amax), a ``Format``, an ``OperandQuant`` or ``None``
    (not quantized). After construction every field is an ``OperandQuant`` whose
    amax is resolved: q dynamic, k and v static at the format's unit amax, p
    static 1.0, unless given.

    Refused with a ``ValueError`` naming the role: a dynamic amax for p or v, and
    a static p amax below 1 (whether a P value saturates would then depend on the
    online softmax's running maximum, hence on tile and split counts).
    """

    q: OperandQuant = field(default_factory=lambda: OperandQuant("none"))
    k: OperandQuant = field(default_factory=lambda: OperandQuant("none"))
    p: OperandQuant = field(default_factory=lambda: OperandQuant("none"))
    v: OperandQuant = field(default_factory=lambda: OperandQuant("none"))

    def __init__(
        self,
        q: OperandLike = None,
        k: OperandLike = None,
        p: OperandLike = None,
        v: OperandLike = None,
    ) -> None:
        for role, value in (("q", q), ("k", k), ("p", p), ("v", v)):
            object.__setattr__(self, role, _resolve_operand(value, role))

    @classmethod
    def uniform(cls, fmt: FormatLike) -> AttentionQuant:
        """The same format on all four operands, with the default amaxes."""
        return cls(q=fmt, k=fmt, p=fmt, v=fmt)

    @property
    def is_identity(self) -> bool:
        """True when no operand is quantized."""
        return all(op.is_identity for op in (self.q, self.k, self.p, self.v))


@dataclass(frozen=True)
class NMSparsity:
    """N:M score sparsity: keep the ``n`` largest of every ``m`` keys.

    The rule: docs/numerics.md "N:M sparsity".

    Groups are ``m`` consecutive keys at absolute key positions. The first
    ``dense_sink_tokens`` keys, and keys with ``0 <= q_pos - k_pos <
    dense_recent_tokens``, are never masked.
    """

    n: int
    m: int
    dense_sink_tokens: int = 0
    dense_recent_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("n", "m", "dense_sink_tokens", "dense_recent_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an int, got {value!r}")
        if self.m < 2 or self.m & (self.m - 1):
            raise ValueError(f"m: expected a power of two >= 2, got {self.m}")
        if not 1 <= self.n < self.m:
            raise ValueError(f"n: expected 1 <= n < m = {self.m}, got {self.n}")
        if self.dense_sink_tokens < 0:
            raise ValueError(f"dense_sink_tokens: expected >= 0, got {self.dense_sink_tokens}")
        if self.dense_recent_tokens < 0:
            raise ValueError(f"dense_recent_tokens: expected >= 0, got {self.dense_recent_tokens}")
