"""The ``mla_quant`` configuration: schema, validation and per-layer resolution.

Pure Python (plus ``mla_formats``); no vLLM import, so it is checked before any
engine starts. The configuration is a JSON object, given in vLLM's
``--additional-config '{"mla_quant": {...}}'`` or as the path of a JSON file
(``{"mla_quant": "/path/quant.json"}``)::

    {
      "recipe": "nvfp4",                      # shorthand: all four operands
      "q": "nvfp4",                            # or {"format": "nvfp4", "amax": "dynamic"}
      "k": {"format": "nvfp4", "amax": 12.5},  # static amax for prefill and decode
      "v": {"format": "fp8", "amax": {"prefill": 3.0, "decode": 9.0}},
      "p": "nvfp4",
      "calibration": "/path/calibration.json", # static amax per layer (calibrate()), or
                                               # {"from": "calibrate"|"checkpoint"|"modelopt",
                                               #  "path": ..., "partial": false}
      "sparsity": {"n": 2, "m": 4, "dense_sink_tokens": 16, "dense_recent_tokens": 64},
      "layers": [                              # later entries win
        {"pattern": "model.layers.0.*", "recipe": "none"},
        {"pattern": "*.layers.1[0-9].*", "v": "fp8", "sparsity": null}
      ],
      "observe": {"enabled": false, "interval": 16, "max_rows": 256},
      "kv_path": "on_read",                    # or "shadow": write-once K/V shadow cache
      "shadow_storage": "fp16"                 # "fp16" or "packed" (kv_path "shadow" only)
    }

Every error is a ``MLAQuantConfigError`` (a ``ValueError``) whose message starts
with the dotted path of the bad field, e.g. ``mla_quant.layers[1].q.amax: ...``.

A calibration source must match the model's MLA layers (``check_layer_names``, run
where the layer names are first known, before any kernel): an entry for no layer, or
a layer that reads static amaxes and finds none, is an error naming both sides,
unless the source says ``"partial": true``.
"""

from __future__ import annotations

import fnmatch
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from pathlib import Path
from typing import Any, TypeVar

from mla_formats import FORMATS, AttentionQuant, NMSparsity, OperandQuant
from mla_formats.formats import check_scale
from mla_vllm.checkpoint_amax import SOURCES, AmaxSource, AmaxSourceError, load_amax_source

__all__ = [
    "CALIBRATION_FORMAT",
    "KV_PATHS",
    "ROLES",
    "SHADOW_STORAGES",
    "AmaxSource",
    "LayerRecipe",
    "MLAQuantConfig",
    "MLAQuantConfigError",
    "ObserveConfig",
    "OperandSpec",
    "config_from_vllm",
    "load_calibration",
    "load_config",
]

ROLES = ("q", "k", "p", "v")
PATHS = ("prefill", "decode")
CALIBRATION_FORMAT = "mla-quant-calibration"
_OPERAND_KEYS = frozenset({"format", "amax"})
_SPARSITY_KEYS = frozenset({"n", "m", "dense_sink_tokens", "dense_recent_tokens"})
_OBSERVE_KEYS = frozenset({"enabled", "interval", "max_rows"})
_LAYER_KEYS = frozenset({"pattern", "recipe", *ROLES, "sparsity"})
_SOURCE_KEYS = frozenset({"from", "path", "maxbound", "partial"})
CALIBRATE = "calibrate"  # {"from": "calibrate", "path": ...}: a file calibrate() wrote
_TOP_KEYS = frozenset(
    {"recipe", *ROLES, "sparsity", "calibration", "layers", "observe", "kv_path", "shadow_storage"}
)
KV_PATHS = ("on_read", "shadow")
SHADOW_STORAGES = ("fp16", "packed")  # mla_triton.shadow.STORAGES; the first is the default


class MLAQuantConfigError(ValueError):
    """A bad ``mla_quant`` field; the message starts with the field's dotted path."""


def _fail(where: str, message: str) -> MLAQuantConfigError:
    return MLAQuantConfigError(f"{where}: {message}")


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise _fail(where, f"unknown key(s) {unknown}; expected some of {sorted(allowed)}")


def _mapping(obj: object, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise _fail(where, f"expected a JSON object, got {type(obj).__name__} {obj!r}")
    for key in obj:
        if not isinstance(key, str):
            raise _fail(where, f"keys must be strings, got {key!r}")
    return obj


def _format_name(obj: object, where: str) -> str:
    if not isinstance(obj, str) or obj not in FORMATS:
        raise _fail(where, f"unknown format {obj!r}; expected one of {sorted(FORMATS)}")
    return obj


def _positive(obj: object, where: str) -> float:
    if isinstance(obj, bool) or not isinstance(obj, (int, float)):
        raise _fail(where, f"expected a positive finite number, got {obj!r}")
    value = float(obj)
    if not math.isfinite(value) or value <= 0.0:
        raise _fail(where, f"expected a positive finite number, got {obj!r}")
    return value


def _int(obj: object, where: str, minimum: int) -> int:
    if isinstance(obj, bool) or not isinstance(obj, int) or obj < minimum:
        raise _fail(where, f"expected an integer >= {minimum}, got {obj!r}")
    return obj


AmaxValue = float | str  # a positive float or "dynamic"


@dataclass(frozen=True)
class OperandSpec:
    """One operand as configured: a format and, optionally, its amax per path.

    ``amax`` maps ``"prefill"`` / ``"decode"`` to a positive float or ``"dynamic"``;
    a path that is absent takes the calibration file's value or the role default.
    """

    format: str
    amax: Mapping[str, AmaxValue] = field(default_factory=dict)
    amax_where: Mapping[str, str] = field(default_factory=dict, compare=False)
    """The dotted path of each path's amax in the configuration (for errors)."""


def _amax(obj: object, role: str, where: str) -> AmaxValue:
    if obj == "dynamic":
        if role in ("p", "v"):
            raise _fail(
                where,
                "a dynamic amax is only defined for q and k (blocked along the features); "
                f"{role} takes a static amax",
            )
        return "dynamic"
    return _positive(obj, where)


def _operand(obj: object, role: str, where: str) -> OperandSpec:
    if isinstance(obj, str):
        return OperandSpec(_format_name(obj, where))
    spec = _mapping(obj, where)
    _check_keys(spec, _OPERAND_KEYS, where)
    if "format" not in spec:
        raise _fail(where, "missing key 'format'")
    fmt = _format_name(spec["format"], f"{where}.format")
    amax: dict[str, AmaxValue] = {}
    amax_where: dict[str, str] = {}
    raw = spec.get("amax")
    if raw is None:
        pass
    elif isinstance(raw, Mapping):
        amax_map = _mapping(raw, f"{where}.amax")
        _check_keys(amax_map, frozenset(PATHS), f"{where}.amax")
        for path, value in amax_map.items():
            amax_where[path] = f"{where}.amax.{path}"
            amax[path] = _amax(value, role, amax_where[path])
    else:
        value = _amax(raw, role, f"{where}.amax")
        amax = dict.fromkeys(PATHS, value)
        amax_where = dict.fromkeys(PATHS, f"{where}.amax")
    if fmt == "none" and amax:
        raise _fail(f"{where}.amax", "format 'none' takes no amax")
    for path, value in amax.items():
        if isinstance(value, float):
            try:  # a global scale that is a normal float32 (docs/numerics.md)
                check_scale(FORMATS[fmt], value, "amax")
            except ValueError as exc:
                raise _fail(amax_where[path], str(exc).removeprefix("amax: ")) from None
    return OperandSpec(fmt, amax, amax_where)


def _sparsity(obj: object, where: str) -> NMSparsity | None:
    if obj is None:
        return None
    spec = _mapping(obj, where)
    _check_keys(spec, _SPARSITY_KEYS, where)
    for key in ("n", "m"):
        if key not in spec:
            raise _fail(where, f"missing key {key!r}")
    values = {key: _int(spec[key], f"{where}.{key}", 0) for key in spec}
    try:
        return NMSparsity(**values)
    except ValueError as exc:  # mla_formats names the field: prefix our path
        raise _fail(where, str(exc)) from None


@dataclass(frozen=True)
class ObserveConfig:
    """Accuracy observation: off by default.

    Attributes:
        enabled: compare the quantized attention output with the unquantized one.
        interval: observe every ``interval``-th call of each layer and path.
        max_rows: at most this many query rows (tokens) are compared per call.
    """

    enabled: bool = False
    interval: int = 16
    max_rows: int = 256


def _observe(obj: object, where: str) -> ObserveConfig:
    if obj is None:
        return ObserveConfig()
    spec = _mapping(obj, where)
    _check_keys(spec, _OBSERVE_KEYS, where)
    enabled = spec.get("enabled", False)
    if not isinstance(enabled, bool):
        raise _fail(f"{where}.enabled", f"expected true or false, got {enabled!r}")
    return ObserveConfig(
        enabled=enabled,
        interval=_int(spec.get("interval", 16), f"{where}.interval", 1),
        max_rows=_int(spec.get("max_rows", 256), f"{where}.max_rows", 1),
    )


@dataclass(frozen=True)
class _Settings:
    """Operand specs and sparsity as set at one level (top or a layer override)."""

    operands: Mapping[str, OperandSpec]
    sparsity: NMSparsity | None
    has_sparsity: bool


def _settings(spec: Mapping[str, Any], where: str) -> _Settings:
    operands: dict[str, OperandSpec] = {}
    if "recipe" in spec:
        name = _format_name(spec["recipe"], f"{where}.recipe")
        operands = {role: OperandSpec(name) for role in ROLES}
    for role in ROLES:
        if role in spec:
            operands[role] = _operand(spec[role], role, f"{where}.{role}")
    has_sparsity = "sparsity" in spec
    sparsity = _sparsity(spec.get("sparsity"), f"{where}.sparsity")
    return _Settings(operands, sparsity, has_sparsity)


@dataclass(frozen=True)
class _Override:
    pattern: str
    settings: _Settings


@dataclass(frozen=True)
class LayerRecipe:
    """What one layer runs: the recipe of each path and the prefill sparsity.

    ``prefill`` quantizes ``Q [T, H, Dqk]``, ``K [T, H, Dqk]``, ``V [T, H, Dv]``;
    ``decode`` the absorbed ``q [B, H, 576]`` and the latent rows (K: 576
    features, V: the first 512). Each has its own static amaxes.
    """

    prefill: AttentionQuant
    decode: AttentionQuant
    sparsity: NMSparsity | None

    @property
    def is_identity(self) -> bool:
        """True when neither path quantizes and there is no sparsity."""
        return self.prefill.is_identity and self.decode.is_identity and self.sparsity is None


def load_calibration(
    obj: object, where: str = "calibration", *, model_path: str | None = None
) -> AmaxSource:
    """Validate a calibration source: a ``calibrate()`` document (its path or the parsed
    JSON object), or an object with a ``"from"`` key.

    Returns the mapping ``{layer: {"prefill"|"decode": {"q"|"k"|"v": amax}}}`` (an
    ``AmaxSource``). ``{"from": "calibrate", "path": ...}`` is a ``calibrate()`` file;
    ``{"from": "checkpoint"|"modelopt", ...}`` a ModelOpt source
    (``mla_vllm.checkpoint_amax``; ``model_path``, the served model's directory, is its
    default checkpoint). ``"partial": true`` on such an object says the source covers
    only some of the model's layers (``MLAQuantConfig.check_layer_names``).
    """
    if isinstance(obj, Mapping) and "from" in obj:
        return _amax_source(obj, where, model_path)
    if isinstance(obj, (str, Path)):
        return _document(_read_json(Path(obj), where), where, (str(obj),))
    return _document(obj, where, ())


def _amax_source(obj: Mapping[str, Any], where: str, model_path: str | None) -> AmaxSource:
    spec = _mapping(obj, where)
    _check_keys(spec, _SOURCE_KEYS, where)
    kind = spec["from"]
    if kind not in (CALIBRATE, *SOURCES):
        raise _fail(f"{where}.from", f"expected one of {[CALIBRATE, *SOURCES]}, got {kind!r}")
    partial = spec.get("partial", False)
    if not isinstance(partial, bool):
        raise _fail(f"{where}.partial", f"expected true or false, got {partial!r}")
    if kind == CALIBRATE:
        if "maxbound" in spec:
            raise _fail(f"{where}.maxbound", "only for 'checkpoint' (a file holds amax itself)")
        path = spec.get("path")
        if not isinstance(path, (str, Path)) or not str(path):
            raise _fail(f"{where}.path", f"expected the path of a calibrate() file, got {path!r}")
        source = _document(_read_json(Path(path), f"{where}.path"), where, (str(path),))
    else:
        try:
            source = load_amax_source(
                {k: v for k, v in spec.items() if k != "partial"}, where, model_path
            )
        except AmaxSourceError as exc:
            raise MLAQuantConfigError(str(exc)) from None
    return replace(source, partial=partial, kind=kind)


def _document(doc: object, where: str, files: tuple[str, ...]) -> AmaxSource:
    """A ``calibrate()`` document, validated."""
    top = _mapping(doc, where)
    _check_keys(top, frozenset({"format", "version", "layers", "meta"}), where)
    if top.get("format") != CALIBRATION_FORMAT:
        raise _fail(
            f"{where}.format", f"expected {CALIBRATION_FORMAT!r}, got {top.get('format')!r}"
        )
    if top.get("version") != 1:
        raise _fail(f"{where}.version", f"expected 1, got {top.get('version')!r}")
    layers = _mapping(top.get("layers"), f"{where}.layers")
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name, entry in layers.items():
        at = f"{where}.layers[{name!r}]"
        paths = _mapping(entry, at)
        _check_keys(paths, frozenset(PATHS), at)
        result[name] = {}
        for path, values in paths.items():
            ops = _mapping(values, f"{at}.{path}")
            _check_keys(ops, frozenset({"q", "k", "v"}), f"{at}.{path}")
            result[name][path] = {
                role: _positive(value, f"{at}.{path}.{role}") for role, value in ops.items()
            }
    return AmaxSource(result, files=files, kind=CALIBRATE)


def _read_json(path: Path, where: str) -> object:
    try:
        text = path.read_text()
    except OSError as exc:
        raise _fail(where, f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(where, f"{str(path)!r} is not valid JSON: {exc}") from None


@dataclass(frozen=True)
class MLAQuantConfig:
    """A validated ``mla_quant`` configuration; ``recipe_for(name)`` resolves a layer."""

    base: _Settings
    overrides: tuple[_Override, ...]
    calibration: AmaxSource | None
    """The static amaxes of the ``calibration`` key, if given."""
    observe: ObserveConfig
    source: str = "<inline>"
    kv_path: str = "on_read"
    """``"on_read"`` (K/V quantized from the raw cache at every decode step) or
    ``"shadow"`` (quantized once at cache-write time into a shadow cache that lives
    in the same KV-cache block as the raw latent; see ``mla_vllm.shadow``)."""
    shadow_storage: str = SHADOW_STORAGES[0]
    """Shadow storage (``mla_triton.shadow``): ``"fp16"`` (the faster) or ``"packed"``."""
    where: str = "mla_quant"
    """The dotted path of this configuration, which its errors start with."""

    @classmethod
    def from_obj(
        cls, obj: object, *, where: str = "mla_quant", model_path: str | None = None
    ) -> MLAQuantConfig:
        """Validate a parsed JSON object (or a path to a JSON file) up front.

        ``model_path``: the served model's directory (for ``"calibration": {"from": ...}``).
        """
        source = "<inline>"
        if isinstance(obj, (str, Path)):
            source = str(obj)
            if isinstance(obj, str) and obj in FORMATS and not Path(obj).exists():
                raise _fail(
                    where,
                    f"{obj!r} is a recipe name, not a configuration file: give "
                    f'{{"recipe": "{obj}"}} (a string here is the path of a JSON file)',
                )
            obj = _read_json(Path(obj), where)
        spec = _mapping(obj, where)
        _check_keys(spec, _TOP_KEYS, where)
        base = _settings(spec, where)
        overrides: list[_Override] = []
        raw_layers = spec.get("layers", [])
        if not isinstance(raw_layers, list):
            raise _fail(f"{where}.layers", f"expected a list, got {type(raw_layers).__name__}")
        for i, entry in enumerate(raw_layers):
            at = f"{where}.layers[{i}]"
            item = _mapping(entry, at)
            for key in ("kv_path", "shadow_storage"):
                if key in item:
                    raise _fail(
                        f"{at}.{key}",
                        "the KV path is global: every MLA layer shares one KV cache spec "
                        "(one page size), so set it at the top level only",
                    )
            _check_keys(item, _LAYER_KEYS, at)
            pattern = item.get("pattern")
            if not isinstance(pattern, str) or not pattern:
                raise _fail(f"{at}.pattern", f"expected a non-empty glob string, got {pattern!r}")
            overrides.append(_Override(pattern, _settings(item, at)))
        calibration: AmaxSource | None = None
        if spec.get("calibration") is not None:
            calibration = load_calibration(
                spec["calibration"], f"{where}.calibration", model_path=model_path
            )
        observe = _observe(spec.get("observe"), f"{where}.observe")
        kv_path, storage = _kv_path(spec, where)
        config = cls(base, tuple(overrides), calibration, observe, source, kv_path, storage, where)
        config.recipe_for("")  # resolve once: format/amax combinations are checked here
        return config

    def check_layer_names(self, layer_names: Iterable[str], where: str = "mla_quant") -> None:
        """Check the configuration against the model's MLA layers, before any kernel runs.

        Raises when a ``layers[i].pattern`` matches none of ``layer_names``, or when the
        ``calibration`` source and the layers do not match: an entry of the source for
        no layer, or a layer that reads static amaxes from the source and finds none
        (both allowed by ``"partial": true``, as long as one entry matches a layer).
        """
        names = list(layer_names)
        for i, override in enumerate(self.overrides):
            if not any(fnmatch.fnmatchcase(name, override.pattern) for name in names):
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                raise _fail(
                    f"{where}.layers[{i}].pattern",
                    f"{override.pattern!r} matches no MLA layer (layers: {shown})",
                )
        source = self.calibration
        if source is None or not names:
            return
        known = set(names)
        stray = [layer for layer in source if layer not in known]
        missing = [name for name in names if name not in source and self._reads_source(name)]
        matched = len(source) > len(stray)
        if matched and (source.partial or not (stray or missing)):
            return
        problems: list[str] = []
        if not source:
            problems.append("the source has no layer entries")
        elif not matched:  # every layer that reads it is missing too: the source's side says it
            entries = (
                "its entry is" if len(source) == 1 else f"none of its {len(source)} entries is"
            )
            problems.append(
                f"{entries} for an MLA layer of the model (another model's source, or names "
                f"with another prefix?): {_stray(source, stray, names)}"
            )
        else:
            if stray:
                problems.append(
                    f"{len(stray)} of its {len(source)} entries are for no MLA layer of the "
                    f"model: {_stray(source, stray, names)}"
                )
            if missing:
                problems.append(_missing(source, missing))
        if matched:
            problems.append(_partial_hint(source, f"{where}.calibration"))
        elif source.partial:
            problems.append('"partial": true allows some layers unmatched, not all')
        raise _fail(f"{where}.calibration", "; ".join(problems))

    def _operands(self, layer_name: str) -> tuple[dict[str, OperandSpec], NMSparsity | None]:
        """The operand specs and sparsity of ``layer_name`` (before calibration)."""
        operands: dict[str, OperandSpec] = {role: OperandSpec("none") for role in ROLES}
        operands.update(self.base.operands)
        sparsity = self.base.sparsity
        for override in self.overrides:
            if fnmatch.fnmatchcase(layer_name, override.pattern):
                operands.update(override.settings.operands)
                if override.settings.has_sparsity:
                    sparsity = override.settings.sparsity
        return operands, sparsity

    def _reads_source(self, layer_name: str) -> bool:
        """True when some q, k or v of the layer takes its amax from the calibration."""
        operands, _ = self._operands(layer_name)
        return any(
            operands[role].format != "none" and operands[role].amax.get(path) is None
            for role in ("q", "k", "v")
            for path in PATHS
        )

    def recipe_for(self, layer_name: str) -> LayerRecipe:
        """The recipe of the layer named ``layer_name`` (vLLM's layer prefix).

        A layer that reads static amaxes from a ``calibration`` source without
        ``"partial": true`` and finds none there is refused (``check_layer_names``
        checks every layer, and the source's side, at once).
        """
        operands, sparsity = self._operands(layer_name)
        source = self.calibration
        calibrated: Mapping[str, Mapping[str, float]] = {}
        if source is not None:
            calibrated = source.get(layer_name, {})
            uncovered = layer_name and not calibrated and not source.partial
            if uncovered and self._reads_source(layer_name):
                raise _fail(
                    f"{self.where}.calibration",
                    f"{_missing(source, [layer_name])}; "
                    + _partial_hint(source, f"{self.where}.calibration"),
                )
        paths: dict[str, AttentionQuant] = {}
        for path in PATHS:
            resolved: dict[str, OperandQuant | str] = {}
            wheres: dict[str, str] = {}
            for role in ROLES:
                spec = operands[role]
                amax = spec.amax.get(path)
                wheres[role] = spec.amax_where.get(path, f"{self.where}.{role}")
                if amax is None and role != "p":
                    amax = calibrated.get(path, {}).get(role)
                    if amax is not None:
                        wheres[role] = (
                            f"{self.where}.calibration.layers[{layer_name!r}].{path}.{role}"
                        )
                if spec.format == "none" or amax is None:
                    resolved[role] = spec.format
                elif role == "p" and isinstance(amax, float) and amax < 1.0:
                    # docs/numerics.md "Edge cases we chose" (mla_formats refuses it too):
                    # the kernels' P never exceeds 1,
                    # and below 1 whether P saturates would depend on the online softmax's
                    # running maximum. Raised when the layer is bound, so the message
                    # names the layer (also from a tensor-parallel worker).
                    raise _fail(
                        wheres[role],
                        f"{_layer(layer_name)}P's static amax must be at least 1 ({path} "
                        f"path), got {amax}",
                    )
                else:
                    keys = {"amax": wheres[role], role: wheres[role]}
                    resolved[role] = _from_formats(
                        keys, self.where, layer_name, OperandQuant, spec.format, amax
                    )
            paths[path] = _from_formats(wheres, self.where, layer_name, AttentionQuant, **resolved)
        if self.kv_path == "shadow" and paths["decode"].v.is_dynamic:
            # unreachable through the schema (v takes static amaxes); kept for direct use
            raise _fail(
                f"{self.where}.kv_path",
                f"'shadow' needs a static V amax; layer {layer_name!r} has a dynamic one",
            )
        return LayerRecipe(paths["prefill"], paths["decode"], sparsity)


_T = TypeVar("_T")


def _from_formats(
    keys: Mapping[str, str],
    where: str,
    layer_name: str,
    build: Callable[..., _T],
    *args: Any,
    **kwargs: Any,
) -> _T:
    """``build(*args, **kwargs)``; an ``mla_formats`` ``ValueError`` is raised naming the key.

    ``mla_formats`` starts its messages with the argument's name (``p: ...``,
    ``amax: ...``); ``keys`` maps such names to the dotted path of the configuration
    key that set them (an unknown name: ``where``).
    """
    try:
        return build(*args, **kwargs)
    except ValueError as exc:
        name, sep, rest = str(exc).partition(": ")
        if sep and name in keys:
            key, message = keys[name], rest
        else:
            key, message = where, str(exc)
        raise _fail(key, _layer(layer_name) + message) from None


def _shown(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _closest(name: str, candidates: Iterable[str]) -> str | None:
    found = get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def _entry(source: AmaxSource, layer: str) -> str:
    """A source entry as a message names it: its key in the source, and its layer."""
    if layer in source.origins:
        return f"{source.origin(layer)} for layer {layer!r}"
    return repr(layer)


def _stray(source: AmaxSource, stray: Sequence[str], names: Sequence[str]) -> str:
    """The source's entries for no MLA layer, each with the closest MLA layer's name."""
    shown = []
    for layer in stray[:3]:
        close = _closest(layer, names)
        shown.append(_entry(source, layer) + (f" (closest MLA layer {close!r})" if close else ""))
    return ", ".join(shown) + (f", and {len(stray) - 3} more" if len(stray) > 3 else "")


def _missing(source: AmaxSource, missing: Sequence[str]) -> str:
    """Layers that read static amaxes and get none, each with the closest source entry."""
    shown = []
    for layer in missing[:3]:
        close = _closest(layer, source)
        hint = f" (closest source entry: {_entry(source, close)})" if close else ""
        shown.append(f"{layer!r}{hint}")
    more = f", and {len(missing) - 3} more" if len(missing) > 3 else ""
    files = f" ({_shown(source.files, 2)})" if source.files else ""
    return (
        f"{len(missing)} MLA layer(s) take static amaxes from the source{files}, which has "
        "none for them: " + ", ".join(shown) + more
    )


def _partial_hint(source: AmaxSource, where: str) -> str:
    if source.kind == CALIBRATE and source.files:
        form = f'{{"from": "calibrate", "path": {json.dumps(source.files[0])}, "partial": true}}'
    else:
        form = f'"partial": true beside "from" in {where}'
    return f"if the source is meant to cover only some layers, say so: {form}"


def _layer(name: str) -> str:
    """``layer '<name>': `` for an error of one layer's recipe (nothing for the default)."""
    return f"layer {name!r}: " if name else ""


def _kv_path(spec: Mapping[str, Any], where: str) -> tuple[str, str]:
    kv_path = spec.get("kv_path", "on_read")
    if kv_path not in KV_PATHS:
        raise _fail(f"{where}.kv_path", f"expected one of {list(KV_PATHS)}, got {kv_path!r}")
    if "shadow_storage" not in spec:
        return kv_path, SHADOW_STORAGES[0]
    storage = spec["shadow_storage"]
    if storage not in SHADOW_STORAGES:
        raise _fail(
            f"{where}.shadow_storage", f"expected one of {list(SHADOW_STORAGES)}, got {storage!r}"
        )
    if kv_path != "shadow":
        raise _fail(
            f"{where}.shadow_storage",
            f"only used with kv_path 'shadow' (kv_path is {kv_path!r})",
        )
    return kv_path, storage


def load_config(
    obj: object, *, where: str = "mla_quant", model_path: str | None = None
) -> MLAQuantConfig:
    """``MLAQuantConfig`` from a dict, a JSON file path, an existing config or None.

    None (no ``mla_quant`` key) means no quantization: every operand ``none``.
    """
    if isinstance(obj, MLAQuantConfig):
        return obj
    if obj is None:
        return MLAQuantConfig.from_obj({}, where=where)
    return MLAQuantConfig.from_obj(obj, where=where, model_path=model_path)


def config_from_vllm(vllm_config: object) -> MLAQuantConfig:
    """The ``mla_quant`` entry of vLLM's ``--additional-config`` (a dict or a JSON file path).

    ``vllm_config`` is a ``vllm.config.VllmConfig`` or None (no quantization); only
    its ``additional_config`` is read, so this needs no vLLM import.
    """
    extra = getattr(vllm_config, "additional_config", None) or {}
    if isinstance(extra, str):  # e.g. lm-eval's key=value model_args with JSON true/null
        raise _fail(
            "additional_config",
            f"expected a JSON object, got the string {extra[:80]!r} (lm-eval: give "
            "--model_args as one JSON object)",
        )
    raw = extra.get("mla_quant") if isinstance(extra, Mapping) else None
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    model_path = model if isinstance(model, str) else None
    return load_config(raw, where="additional_config.mla_quant", model_path=model_path)
