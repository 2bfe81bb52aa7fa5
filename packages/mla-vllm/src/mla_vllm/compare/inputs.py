"""``mla-compare``'s inputs: prompts (text or token ids) and recipes, checked before any engine.

Prompt files:

- ``.jsonl``: one prompt a line: a JSON string (text), a list of token ids, or an
  object with ``"text"`` / ``"prompt"`` (text) or ``"token_ids"`` / ``"prompt_token_ids"``;
- ``.json``: a list of the same;
- anything else (``.txt``): one text prompt per non-empty line.

Text goes through the model's tokenizer (``transformers.AutoTokenizer``) here, in the
parent process, so every engine is fed the same token ids.

Recipes (``--recipe``): ``[NAME=]VALUE`` where VALUE is an ``mla_quant`` JSON object,
the path of a JSON file holding one, or a format name (``nvfp4`` for
``{"recipe": "nvfp4"}``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_formats import FORMATS
from mla_vllm.config import MLAQuantConfig

__all__ = [
    "TOKENIZER_FILES",
    "Prompt",
    "Recipe",
    "add_calibrated",
    "check_layer_names",
    "check_lengths",
    "check_model",
    "check_out_dir",
    "follow_up_ids",
    "layer_names",
    "load_prompts",
    "model_max_len",
    "parse_recipe",
    "parse_recipes",
    "tokenize",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_NAME = re.compile(r"^(?P<name>[A-Za-z0-9_.+-]+)=(?P<value>.+)$", re.DOTALL)
# a Hugging Face hub id: "name" or "owner/name" (no leading "/", ".", "~", one "/" at most)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
# vLLM 0.33's MLA layer names by architecture (deepseek_v2.py: DeepseekV2DecoderLayer's
# self_attn and its MLA wrapper's attn), for checking ``layers[i].pattern`` up front
_MLA_LAYER_NAMES = {
    "DeepseekV2ForCausalLM": "model.layers.{}.self_attn.attn",
    "DeepseekV3ForCausalLM": "model.layers.{}.self_attn.attn",
    "DeepseekV32ForCausalLM": "model.layers.{}.self_attn.attn",
}


def check_model(model: str) -> None:
    """``MODEL`` names a model directory holding ``config.json``, or is a hub id.

    A path that does not exist (absolute, ``./``, ``~``, two or more ``/``, or a first
    component that is a local directory) is a ``ValueError`` naming ``MODEL``, so a
    mistyped path is reported before any tokenizer or engine reads it.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(
                f"MODEL: {model!r} is a directory without config.json (not a Hugging Face "
                "model directory)"
            )
        return
    if path.exists():
        raise ValueError(f"MODEL: {model!r} is a file; expected a model directory or hub id")
    first = Path(model.split("/", 1)[0])
    if _HUB_ID.match(model) and not ("/" in model and first.is_dir()):
        return  # a hub id: vLLM and the tokenizer download it
    raise ValueError(
        f"MODEL: no such model directory {model!r} (and not a hub id such as "
        "'deepseek-ai/DeepSeek-V2-Lite')"
    )


def check_out_dir(out: str | Path, argument: str) -> None:
    """``out`` is a directory that exists or can be made: ``ValueError`` naming ``argument``
    when it, or the nearest of its parents that exists, is a file, or is not writable."""
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{argument}: {str(out)!r} is a file; expected a directory")
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(
            f"{argument}: cannot make {str(out)!r}: {str(existing)!r} is a file, not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{argument}: cannot write into {str(existing)!r} (permission denied)")


def layer_names(model: str) -> list[str] | None:
    """The MLA layer names vLLM gives a local model, from its ``config.json``; None for
    a hub id or an architecture whose naming is not known here."""
    config = Path(model).expanduser() / "config.json"
    try:
        obj = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(obj, Mapping):
        return None
    layers = obj.get("num_hidden_layers")
    archs = obj.get("architectures") or []
    names = {_MLA_LAYER_NAMES.get(a) for a in archs if isinstance(a, str)} - {None}
    if not isinstance(layers, int) or layers < 1 or len(names) != 1:
        return None
    template = str(names.pop())
    return [template.format(i) for i in range(layers)]


def check_layer_names(recipes: Sequence[Recipe], model: str, model_path: str | None) -> None:
    """Every recipe against the model's MLA layers: each ``layers[i].pattern`` matches
    one, and a ``calibration`` source matches them (``MLAQuantConfig.check_layer_names``).

    Checked where the model's layer names are known (``layer_names``); the engine checks
    them again when it binds the layers.
    """
    names = layer_names(model)
    if names is None:
        return
    for recipe in recipes:
        config = MLAQuantConfig.from_obj(
            recipe.config, where=f"--recipe {recipe.name}: mla_quant", model_path=model_path
        )
        config.check_layer_names(names, where=f"--recipe {recipe.name}: mla_quant")


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text (None for token ids) and, once tokenized, its ids."""

    where: str
    text: str | None = None
    ids: tuple[int, ...] | None = None


def _prompt(item: object, where: str) -> Prompt:
    if isinstance(item, str):
        return Prompt(where, text=item)
    if isinstance(item, list):
        if not item or not all(isinstance(t, int) and not isinstance(t, bool) for t in item):
            raise ValueError(f"{where}: expected a non-empty list of token ids (integers)")
        if min(item) < 0:
            raise ValueError(f"{where}: token ids must be >= 0, got {min(item)}")
        return Prompt(where, ids=tuple(item))
    if isinstance(item, Mapping):
        for key in ("token_ids", "prompt_token_ids"):
            if key in item:
                return _prompt(list(item[key]) if isinstance(item[key], list) else None, where)
        for key in ("text", "prompt"):
            if key in item and isinstance(item[key], str):
                return Prompt(where, text=item[key])
        raise ValueError(
            f"{where}: expected a 'text'/'prompt' string or 'token_ids' list, got keys "
            f"{sorted(map(str, item))}"
        )
    raise ValueError(
        f"{where}: expected text, a list of token ids or an object, got {type(item).__name__}"
    )


def load_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a ``.jsonl``, ``.json`` or text file (module docstring)."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ValueError(f"prompts: cannot read {str(file)!r}: {exc.strerror or exc}") from None
    prompts: list[Prompt] = []
    if file.suffix == ".jsonl":
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            where = f"prompts: {file.name} line {n}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON: {exc}") from None
            prompts.append(_prompt(item, where))
    elif file.suffix == ".json":
        try:
            items = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompts: {file.name} is not valid JSON: {exc}") from None
        if not isinstance(items, list):
            raise ValueError(f"prompts: {file.name}: expected a JSON list of prompts")
        prompts = [_prompt(item, f"prompts: {file.name}[{i}]") for i, item in enumerate(items)]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                prompts.append(Prompt(f"prompts: {file.name} line {n}", text=line))
    if not prompts:
        raise ValueError(f"prompts: {str(file)!r} holds no prompt")
    return prompts


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def tokenize(
    prompts: Sequence[Prompt],
    model: str,
    tokenizer: str | None = None,
    *,
    add_special_tokens: bool = True,
) -> list[Prompt]:
    """Every prompt with its token ids; text through ``tokenizer`` (default: the model's),
    with its BOS (``add_special_tokens``) where the tokenizer adds one.

    A text prompt with no tokenizer to use is a ``ValueError`` naming the prompt.
    """
    texts = [p for p in prompts if p.ids is None]
    if not texts:
        return list(prompts)
    source = tokenizer or model
    local = Path(source)
    if local.is_dir() and not _has_tokenizer(local):
        raise ValueError(
            f"{texts[0].where}: text, but {str(local)!r} has no tokenizer "
            f"({', '.join(TOKENIZER_FILES)}); give token ids ([1, 2, 3]) or --tokenizer"
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{texts[0].where}: cannot load the tokenizer {source!r}: {exc}") from None
    out: list[Prompt] = []
    for p in prompts:
        if p.ids is not None:
            out.append(p)
            continue
        ids = tok(p.text, add_special_tokens=add_special_tokens)["input_ids"]
        if not ids:
            raise ValueError(f"{p.where}: the tokenizer made no token of {p.text!r}")
        out.append(Prompt(p.where, p.text, tuple(int(t) for t in ids)))
    return out


def model_max_len(model: str, given: int | None) -> int | None:
    """``given``, else ``max_position_embeddings`` of a local ``config.json`` (or None)."""
    if given is not None:
        if given < 2:
            raise ValueError(f"max_model_len: expected >= 2, got {given}")
        return given
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    try:
        value = json.loads(config.read_text()).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return int(value) if isinstance(value, int) else None


def check_lengths(prompts: Sequence[Prompt], max_model_len: int | None) -> None:
    """Every prompt has 2+ tokens (one predicted position) and fits ``max_model_len``."""
    for p in prompts:
        n = len(p.ids or ())
        if n < 2:
            raise ValueError(f"{p.where}: {n} token(s); a prompt needs 2 or more")
        if max_model_len is not None and n > max_model_len:
            raise ValueError(
                f"{p.where}: {n} tokens, longer than max_model_len {max_model_len} "
                "(shorten it or raise --max-model-len)"
            )


@dataclass(frozen=True)
class Recipe:
    """A named ``mla_quant`` configuration (validated); ``calibration_of`` names the
    recipe it copies with a ``--calibration`` source (None for a ``--recipe``)."""

    name: str
    config: Mapping[str, Any] = field(default_factory=dict)
    calibration_of: str | None = None


def _default_name(obj: Mapping[str, Any], fallback: str) -> str:
    name = obj.get("recipe") if isinstance(obj.get("recipe"), str) else fallback
    if obj.get("kv_path") == "shadow":
        name = f"{name}-shadow"
    if obj.get("calibration") is not None:
        name = f"{name}-calibrated"
    return str(name)


def parse_recipe(spec: str, index: int, model_path: str | None = None) -> Recipe:
    """One ``--recipe`` value (module docstring), validated as an ``mla_quant`` object."""
    where = f"--recipe {spec!r}"
    name: str | None = None
    value = spec.strip()
    match = None if value.startswith("{") else _NAME.match(value)
    if match is not None:
        name, value = match["name"], match["value"].strip()
    obj: object
    if value.startswith("{"):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc}") from None
        fallback = f"recipe{index}"
    elif value in FORMATS:
        obj = {"recipe": value}
        fallback = value
    else:
        file = Path(value)
        if not file.is_file():
            raise ValueError(
                f"{where}: no such recipe file {value!r}, and not a format name "
                f"({', '.join(sorted(FORMATS))}) or a JSON object"
            )
        try:
            obj = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: {value!r} is not valid JSON: {exc}") from None
        if isinstance(obj, Mapping) and set(obj) == {"mla_quant"}:
            obj = obj["mla_quant"]  # an --additional-config file
        fallback = file.stem
    if not isinstance(obj, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    MLAQuantConfig.from_obj(obj, where=f"{where}: mla_quant", model_path=model_path)
    return Recipe(name or _default_name(obj, fallback), dict(obj))


def parse_recipes(specs: Sequence[str], model_path: str | None = None) -> list[Recipe]:
    """Every ``--recipe``; repeated names get ``-2``, ``-3``, ..."""
    if not specs:
        raise ValueError("--recipe: give at least one recipe")
    recipes: list[Recipe] = []
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        recipe = parse_recipe(spec, i, model_path)
        count = seen.get(recipe.name, 0) + 1
        seen[recipe.name] = count
        if count > 1:
            recipe = Recipe(f"{recipe.name}-{count}", recipe.config)
        recipes.append(recipe)
    return recipes


def follow_up_ids(value: str, model: str, tokenizer: str | None = None) -> list[int]:
    """``--follow-up``: a JSON list of token ids, or text tokenized like the prompts but
    without a BOS token (it continues a sequence)."""
    text = value.strip()
    if text.startswith("["):
        try:
            item = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--follow-up: not a valid JSON list of token ids: {exc}") from None
        return list(_prompt(item, "--follow-up").ids or ())
    if not value:
        raise ValueError("--follow-up: empty; give text or a JSON list of token ids")
    prompt = tokenize(
        [Prompt("--follow-up", text=value)], model, tokenizer, add_special_tokens=False
    )[0]
    return list(prompt.ids or ())


def _calibration_source(value: str, where: str) -> object:
    """A ``--calibration`` SOURCE: a JSON object, ``checkpoint``, or a calibrate() file
    (made absolute: the engines may run elsewhere than the parent's directory)."""
    if value.startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON: {exc}") from None
    if value == "checkpoint":
        return {"from": "checkpoint"}
    file = Path(value).expanduser()
    if not file.is_file():
        raise ValueError(
            f"{where}: no such calibration file {value!r} (and not 'checkpoint' or a JSON "
            'object such as \'{"from": "modelopt", "path": "amax.pt"}\')'
        )
    return str(file.resolve())


def add_calibrated(
    recipes: Sequence[Recipe], values: Sequence[str], model: str, model_path: str | None = None
) -> list[Recipe]:
    """``recipes`` with, after each, its copy under every ``--calibration [RECIPE=]SOURCE``
    (named ``RECIPE-calibrated``, ``-calibrated-2``, ...; ``calibration_of`` set).

    Without ``RECIPE=``, a source applies to every recipe that quantizes (not ``none``)
    and has no ``calibration`` of its own. Each copy is validated (the source read) and
    checked against the model's layers (``layer_names``) here, before any engine starts.
    """
    by_name = {r.name: r for r in recipes}
    twins: dict[str, list[Recipe]] = {r.name: [] for r in recipes}
    names = layer_names(model)
    taken = set(by_name)
    for value in values:
        where = f"--calibration {value!r}"
        text = value.strip()
        match = None if text.startswith("{") else _NAME.match(text)
        if match is not None and match["name"] in by_name:
            targets = [by_name[match["name"]]]
            text = match["value"].strip()
        elif match is not None and not Path(text).expanduser().exists():
            raise ValueError(
                f"{where}: no recipe named {match['name']!r} (recipes: {', '.join(by_name)})"
            )
        else:
            targets = [
                r
                for r in recipes
                if r.config.get("recipe", "none") != "none" and r.config.get("calibration") is None
            ]
            if not targets:
                raise ValueError(f"{where}: no recipe that quantizes and has no calibration")
        source = _calibration_source(text, where)
        for base in targets:
            name, n = f"{base.name}-calibrated", 2
            while name in taken:
                name, n = f"{base.name}-calibrated-{n}", n + 1
            taken.add(name)
            config = {**base.config, "calibration": source}
            checked = MLAQuantConfig.from_obj(
                config, where=f"{where}: mla_quant", model_path=model_path
            )
            if names is not None:
                checked.check_layer_names(names, where=f"{where}: mla_quant")
            twins[base.name].append(Recipe(name, config, calibration_of=base.name))
    return [r for base in recipes for r in (base, *twins[base.name])]
