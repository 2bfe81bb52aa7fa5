"""Static amax from NVIDIA ModelOpt: an exported checkpoint's KV scales, or its amax state.

Two calibration sources, given in place of a calibration file::

    "calibration": {"from": "checkpoint"}                  # the served model's safetensors
    "calibration": {"from": "checkpoint", "path": "/ckpt", "maxbound": 448}
    "calibration": {"from": "modelopt", "path": "/amax.pt"}  # or a list: one file per rank

``checkpoint`` reads the per-layer FP8/NVFP4 KV-cache scales that ModelOpt's Hugging
Face export writes (``modelopt.torch.export.quant_utils.postprocess_state_dict``):
``<p>.self_attn.k_proj.k_scale`` and ``<p>.self_attn.v_proj.v_scale``, each
``amax / maxbound`` of the attention's ``k_bmm_quantizer`` / ``v_bmm_quantizer``.
ModelOpt puts those quantizers on the inputs of Hugging Face's (not absorbed)
attention, so they saw the up-projected per-head K ``[T, H, 192]`` (nope and rope)
and V ``[T, H, 128]``: our **prefill** K and V, nothing of the decode path.

``modelopt`` reads a ``torch.save`` (or safetensors) file of quantizer ``_amax``
tensors (ModelOpt's ``amax_dict_rank*.pt`` or a state dict). Two forms map:

- ModelOpt's vLLM plugin (``_QuantVLLMMLAAttention`` on vLLM's ``MLAAttention``
  ``<L>``): ``<L>.q_bmm_quantizer`` saw the layer's query ``[T, N, 192]`` (prefill
  Q); ``<L>.kv_c_bmm_quantizer`` the latent ``[T, 512]`` and ``<L>.k_pe_bmm_quantizer``
  the rope key ``[T, 1, 64]``: the decode cache row. Decode K (576 features) gets
  ``max(kv_c, k_pe)``, decode V (the first 512) gets ``kv_c``.
- Hugging Face attention ``<p>.self_attn``: ``q/k/v_bmm_quantizer`` as above: prefill
  Q, K and V of vLLM's layer ``<p>.self_attn.attn``.

What no ModelOpt quantizer sees is not made up: decode Q (``q_nope @ W_UK`` absorbed,
512 + 64 features), prefill K and V from the vLLM plugin (up-projected from the
latent, whose amax bounds theirs only through ``kv_b_proj``), and decode anything
from Hugging Face attention keep the recipe's own amax (or the role's default).
P is not read: softmax probabilities have amax 1 by construction.

Each source returns an ``AmaxSource``: the amaxes per layer, plus the source keys each
layer's amaxes came from, so that ``mla_vllm.config`` can name both sides when the
source's layers and the model's do not match.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["MAXBOUNDS", "SOURCES", "AmaxSource", "AmaxSourceError", "load_amax_source"]

SOURCES = ("checkpoint", "modelopt")
MAXBOUNDS = {"FP8": 448.0}
"""``kv_cache_quant_algo`` -> the maxbound ModelOpt divides by. NVFP4 is absent on
purpose: ModelOpt's exporters have used both ``6 * 448`` and ``448`` for it, so an
NVFP4 checkpoint needs ``"maxbound"`` given."""

_KEYS = frozenset({"from", "path", "maxbound"})
_SCALE = re.compile(r"^(?P<p>.+)\.self_attn\.(?P<r>[kv])_proj\.(?P=r)_scale$")
_KV_SCALE = re.compile(r"^.+\.self_attn\.(?:[kv]_proj\.)?kv_scale$")
_AMAX = re.compile(r"^(?P<m>.+)\.(?P<q>q|k|v|kv_c|k_pe|kv|pe)_bmm_quantizer\._amax$")

Calibration = dict[str, dict[str, dict[str, float]]]


@dataclass(frozen=True, eq=False)
class AmaxSource(Mapping[str, Mapping[str, Mapping[str, float]]]):
    """Static amaxes per layer from one source: ``{layer: {path: {role: amax}}}``.

    A read-only mapping of ``layers`` (it compares equal to the plain dict), plus what
    the configuration's checks need to name both sides of a mismatch.
    """

    layers: Calibration
    origins: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """``{layer: the source's keys it came from}`` (a tensor name, a calibration entry)."""
    files: tuple[str, ...] = ()
    """The files read (empty for a calibration document given inline)."""
    partial: bool = False
    """The configuration says the source covers only some of the model's layers."""
    kind: str = ""
    """Its ``"from"``: ``"calibrate"``, ``"checkpoint"`` or ``"modelopt"``."""

    def __getitem__(self, layer: str) -> Mapping[str, Mapping[str, float]]:
        return self.layers[layer]

    def __iter__(self) -> Iterator[str]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def origin(self, layer: str) -> str:
        """The source's key(s) that gave ``layer``'s amaxes, for a message."""
        keys = self.origins.get(layer, (layer,))
        more = f" (+{len(keys) - 1} more)" if len(keys) > 1 else ""
        return f"{keys[0]!r}{more}"


class AmaxSourceError(ValueError):
    """A bad calibration source; the message starts with the field's dotted path.

    ``mla_vllm.config`` raises it again as its ``MLAQuantConfigError``.
    """


def _fail(where: str, message: str) -> AmaxSourceError:
    return AmaxSourceError(f"{where}: {message}")


def _files(path: Path, where: str, *, suffixes: tuple[str, ...]) -> list[Path]:
    """``path`` itself, or the files of the directory ``path`` ending in ``suffixes``."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(suffixes))
        if not files:
            raise _fail(where, f"no {'/'.join(suffixes)} file in directory {str(path)!r}")
        return files
    if not path.is_file():
        raise _fail(where, f"no such file or directory {str(path)!r}")
    return [path]


def _scalar(value: Any, key: str, where: str) -> float:
    """The largest |x| of a tensor (a per-channel amax is bounded by it), checked > 0."""
    import torch

    if not isinstance(value, torch.Tensor) or value.numel() == 0:
        raise _fail(where, f"{key!r}: expected a non-empty tensor, got {type(value).__name__}")
    amax = float(value.detach().float().abs().max())
    if not math.isfinite(amax) or amax <= 0.0:
        raise _fail(where, f"{key!r}: expected a positive finite value, got {amax}")
    return amax


def _merge(out: Calibration, layer: str, path: str, role: str, value: float) -> None:
    slot = out.setdefault(layer, {}).setdefault(path, {})
    slot[role] = max(value, slot.get(role, 0.0))


def _note(origins: dict[str, tuple[str, ...]], layer: str, *keys: str) -> None:
    """Record that ``keys`` of the source gave ``layer`` an amax."""
    known = origins.get(layer, ())
    origins[layer] = known + tuple(k for k in keys if k not in known)


def _unreadable(file: Path, where: str, exc: Exception) -> AmaxSourceError:
    """A safetensors file that cannot be read (truncated, corrupt, not safetensors)."""
    return _fail(
        where,
        f"cannot read {str(file)!r} as safetensors ({type(exc).__name__}: {exc}); the file "
        "is truncated or corrupt: copy or download it again",
    )


# ---------------------------------------------------------------- exported checkpoint


def _kv_algo(root: Path) -> str | None:
    """``kv_cache_quant_algo`` from ``hf_quant_config.json`` or ``config.json``, if any."""
    for name, keys in (
        ("hf_quant_config.json", ("quantization",)),
        ("config.json", ("quantization_config",)),
    ):
        file = root / name
        if not file.is_file():
            continue
        try:
            doc: Any = json.loads(file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        for key in keys:
            doc = doc.get(key) if isinstance(doc, Mapping) else None
        algo = doc.get("kv_cache_quant_algo") if isinstance(doc, Mapping) else None
        if isinstance(algo, str):
            return algo
    return None


def _scale_files(files: list[Path]) -> list[Path]:
    """Only the shards holding a KV scale, when a safetensors index says which."""
    root = files[0].parent
    index = root / "model.safetensors.index.json"
    if len(files) == 1 or not index.is_file():
        return files
    try:
        weight_map = json.loads(index.read_text()).get("weight_map", {})
    except (OSError, json.JSONDecodeError, AttributeError):
        return files
    wanted = {
        str(shard) for key, shard in weight_map.items() if _SCALE.match(key) or _KV_SCALE.match(key)
    }
    chosen = [f for f in files if f.name in wanted]
    return chosen or files


def _from_checkpoint(spec: Mapping[str, Any], where: str, model_path: str | None) -> AmaxSource:
    raw_path = spec.get("path", model_path)
    if raw_path is None:
        raise _fail(
            f"{where}.path",
            "the served model's path is not known here; give the checkpoint's directory",
        )
    if not isinstance(raw_path, (str, Path)):
        raise _fail(f"{where}.path", f"expected a path string, got {raw_path!r}")
    path = Path(raw_path)
    if not path.exists():
        hint = " (a hub id? give the local directory)" if "path" not in spec else ""
        raise _fail(f"{where}.path", f"no such file or directory {str(path)!r}{hint}")
    files = _files(path, f"{where}.path", suffixes=(".safetensors",))
    algo = _kv_algo(files[0].parent)
    maxbound = spec.get("maxbound")
    if maxbound is None:
        if algo is None:
            raise _fail(
                f"{where}.maxbound",
                f"{str(path)!r} names no kv_cache_quant_algo (hf_quant_config.json or "
                "config.json quantization_config); give the maxbound its scales were "
                "divided by (448 for FP8)",
            )
        if algo not in MAXBOUNDS:
            raise _fail(
                f"{where}.maxbound",
                f"kv_cache_quant_algo {algo!r}: ModelOpt versions divide its amax by "
                "6 * 448 or by 448; give the one your export used",
            )
        maxbound = MAXBOUNDS[algo]
    if isinstance(maxbound, bool) or not isinstance(maxbound, (int, float)) or maxbound <= 0:
        raise _fail(f"{where}.maxbound", f"expected a positive number, got {maxbound!r}")
    out: Calibration = {}
    origins: dict[str, tuple[str, ...]] = {}
    floor: list[tuple[str, float]] = []
    found: list[str] = []
    path_key = f"{where}.path" if "path" in spec else where
    chosen = _scale_files(files)
    for file in chosen:
        for key, tensor in _scale_tensors(file, path_key):
            if _KV_SCALE.match(key):
                raise _fail(
                    where,
                    f"{key!r} is one scale for both K and V (the deprecated kv_scale); "
                    "MLA_QUANT needs K's and V's own (k_proj.k_scale, v_proj.v_scale)",
                )
            match = _SCALE.match(key)
            if match is None:
                continue
            found.append(key)
            scale = _scalar(tensor, key, where)
            if algo == "FP8" and scale <= 1.0:
                floor.append((key, scale))
                continue
            layer = f"{match['p']}.self_attn.attn"
            _merge(out, layer, "prefill", match["r"], scale * float(maxbound))
            _note(origins, layer, key)
    if floor:
        raise _fail(where, _floor_message(floor))
    if not found:
        raise _fail(
            where,
            f"no ModelOpt KV scale (*.self_attn.k_proj.k_scale, *.self_attn.v_proj.v_scale) "
            f"in {[f.name for f in files][:4]}",
        )
    return AmaxSource(out, origins, tuple(str(f) for f in chosen), kind="checkpoint")


def _scale_tensors(file: Path, where: str) -> list[tuple[str, Any]]:
    """The KV-scale tensors of one safetensors file (``where``: its configuration key)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return [
                (key, handle.get_tensor(key))
                for key in handle.keys()  # noqa: SIM118 (safe_open has no __iter__)
                if _SCALE.match(key) or _KV_SCALE.match(key)
            ]
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise _unreadable(file, where, exc) from None


def _floor_message(floor: list[tuple[str, float]]) -> str:
    """Why FP8 scales of 1.0 or less carry no amax, and what to use instead."""
    shown = ", ".join(f"{key!r} = {scale:g}" for key, scale in floor[:3])
    shown += ", ..." if len(floor) > 3 else ""
    return (
        f"{len(floor)} FP8 KV scale(s) of 1.0 or less ({shown}). ModelOpt's FP8 export "
        "writes each scale as max(amax / 448, 1.0): it never scales values up into FP8's "
        "range, so every amax up to 448 is stored as the floor 1.0 and the calibrated "
        "amax is lost (a scale below 1.0 is not what that export writes). Such a scale "
        "gives no amax to quantize with. Instead: load the amax state ModelOpt calibrated "
        '({"from": "modelopt", "path": "amax_dict_rank0.pt"}), run mla_vllm.calibrate(), '
        'or give k and v an explicit "amax"'
    )


# ---------------------------------------------------------------- ModelOpt amax state


def _load_state(file: Path, where: str) -> Mapping[str, Any]:
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(file))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise _unreadable(file, where, exc) from None
    import torch

    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and torch errors alike: name the file
        raise _fail(where, f"cannot read {str(file)!r} with torch.load: {exc}") from None
    if not isinstance(state, Mapping):
        raise _fail(where, f"{str(file)!r}: expected a dict of tensors, got {type(state).__name__}")
    return state


def _from_modelopt(spec: Mapping[str, Any], where: str) -> AmaxSource:
    raw = spec.get("path")
    paths: Iterable[object] = raw if isinstance(raw, list) else [raw]
    files: list[tuple[Path, str]] = []
    for i, item in enumerate(paths):
        at = f"{where}.path" + (f"[{i}]" if isinstance(raw, list) else "")
        if not isinstance(item, (str, Path)) or not str(item):
            raise _fail(at, f"expected a file path, got {item!r}")
        files += [(f, at) for f in _files(Path(item), at, suffixes=(".pt", ".pth", ".safetensors"))]
    if not files:
        raise _fail(f"{where}.path", "expected at least one file")
    amaxes: dict[tuple[str, str], float] = {}
    keys: dict[tuple[str, str], tuple[str, ...]] = {}
    for file, at in files:  # several files: tensor-parallel ranks, merged by max
        for key, value in _load_state(file, at).items():
            match = _AMAX.match(str(key))
            if match is None:
                continue
            if match["q"] in ("kv", "pe"):
                raise _fail(
                    where,
                    f"{key!r}: DeepSeek's own inference code's latent/rope cache quantizers "
                    "(ModelOpt's examples/deepseek); their module names do not follow vLLM's "
                    "and their forward use is not ModelOpt's public API: calibrate on vLLM "
                    "(ModelOpt's vLLM plugin) or Hugging Face attention",
                )
            slot = (match["m"], match["q"])
            amaxes[slot] = max(_scalar(value, str(key), where), amaxes.get(slot, 0.0))
            if str(key) not in keys.setdefault(slot, ()):
                keys[slot] += (str(key),)
    if not amaxes:
        raise _fail(
            where,
            f"no attention quantizer amax (*.q/k/v/kv_c/k_pe_bmm_quantizer._amax) in "
            f"{[f.name for f, _ in files][:4]}",
        )
    modules: dict[str, dict[str, float]] = {}
    for (module, quantizer), value in amaxes.items():
        modules.setdefault(module, {})[quantizer] = value
    out: Calibration = {}
    origins: dict[str, tuple[str, ...]] = {}
    for module, q in sorted(modules.items()):
        if "kv_c" in q or "k_pe" in q:  # vLLM's MLAAttention (ModelOpt's vLLM plugin)
            if "k" in q or "v" in q:
                raise _fail(where, f"{module!r} has both vLLM-plugin and Hugging Face quantizers")
            layer = module
            if "q" in q:
                _merge(out, module, "prefill", "q", q["q"])
            decode_k = max(q.get("kv_c", 0.0), q.get("k_pe", 0.0))
            _merge(out, module, "decode", "k", decode_k)
            if "kv_c" in q:
                _merge(out, module, "decode", "v", q["kv_c"])
        else:  # Hugging Face attention: <p>.self_attn -> vLLM's <p>.self_attn.attn
            layer = module if module.endswith(".attn") else f"{module}.attn"
            if layer.startswith("layers."):
                layer = f"model.{layer}"
            for role in ("q", "k", "v"):
                if role in q:
                    _merge(out, layer, "prefill", role, q[role])
        for quantizer in sorted(q):
            _note(origins, layer, *keys[module, quantizer])
    return AmaxSource(out, origins, tuple(str(f) for f, _ in files), kind="modelopt")


# ---------------------------------------------------------------- entry point

_CACHE: dict[tuple[object, ...], AmaxSource] = {}


def _cache_key(spec: Mapping[str, Any], model_path: str | None) -> tuple[object, ...]:
    """The spec plus each named file's size and mtime (a rewritten file is read again)."""
    raw = spec.get("path", model_path)
    paths = raw if isinstance(raw, list) else [raw]
    stamps: list[object] = []
    for item in paths:
        p = Path(str(item))
        entries = sorted(p.iterdir()) if p.is_dir() else [p]
        for entry in entries:
            try:
                st = entry.stat()
            except OSError:
                continue
            stamps.append((str(entry), st.st_size, st.st_mtime_ns))
    return (json.dumps(spec, sort_keys=True, default=str), model_path, tuple(stamps))


def load_amax_source(
    spec: Mapping[str, Any], where: str = "calibration", model_path: str | None = None
) -> AmaxSource:
    """``{layer: {"prefill"|"decode": {"q"|"k"|"v": amax}}}`` from a ModelOpt source.

    ``spec`` is ``{"from": "checkpoint" | "modelopt", "path": ..., "maxbound": ...}``;
    ``model_path`` is the served model's directory (the default checkpoint path).
    Results are cached per file set (vLLM validates the configuration per layer).
    """
    unknown = sorted(str(k) for k in spec if k not in _KEYS)
    if unknown:
        raise _fail(where, f"unknown key(s) {unknown}; expected some of {sorted(_KEYS)}")
    source = spec.get("from")
    if source not in SOURCES:
        raise _fail(f"{where}.from", f"expected one of {list(SOURCES)}, got {source!r}")
    if source == "modelopt" and "maxbound" in spec:
        raise _fail(f"{where}.maxbound", "only for 'checkpoint' (a state file holds amax itself)")
    key = _cache_key(spec, model_path)
    if key not in _CACHE:
        if source == "checkpoint":
            _CACHE[key] = _from_checkpoint(spec, where, model_path)
        else:
            _CACHE[key] = _from_modelopt(spec, where)
    return _CACHE[key]
