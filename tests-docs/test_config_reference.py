"""The ``mla_quant`` reference of docs/vllm.md against the schema in ``mla_vllm.config``.

The key table must list exactly the schema's keys, and every configuration the docs
and READMEs show (``<!-- mla_quant -->`` JSON blocks, ``--additional-config`` values,
the lm-eval YAML's ``additional_config``) must validate. Needs no vLLM:
``mla_vllm.config`` imports only ``mla_formats``.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from typing import Any

import pytest
from blocks import ROOT, all_blocks

try:
    import yaml
except ImportError:
    yaml = None

try:
    from mla_vllm import config
except ImportError:  # the docs session installs no vLLM: take the source tree
    sys.path.insert(0, str(ROOT / "packages" / "mla-vllm" / "src"))
    from mla_vllm import config

PAGE = ROOT / "docs" / "vllm.md"
SECTION = "## The `mla_quant` configuration"


def _table_keys() -> dict[str, str]:
    """{key: its row} of the reference table: the backticked names of the first cell."""
    text = PAGE.read_text()
    section = text[text.index(SECTION) :]
    section = section[: section.index("\n## ", len(SECTION))]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for key in re.findall(r"`([^`]+)`", first):
            rows[key] = line
    return rows


def test_reference_lists_every_key_of_the_schema() -> None:
    schema = set(
        config._TOP_KEYS
        | config._OPERAND_KEYS
        | config._SPARSITY_KEYS
        | config._OBSERVE_KEYS
        | config._LAYER_KEYS
        | config._SOURCE_KEYS
    )
    documented = set(_table_keys())
    assert documented - schema == set(), "keys in docs/vllm.md the schema does not know"
    assert schema - documented == set(), "schema keys docs/vllm.md does not document"


def test_reference_lists_every_allowed_value() -> None:
    rows = _table_keys()
    for value in config.KV_PATHS:
        assert f'"{value}"' in rows["kv_path"]
    for value in config.SHADOW_STORAGES:
        assert f'"{value}"' in rows["shadow_storage"]
    for name in config.FORMATS:
        assert f'"{name}"' in rows["recipe"] and f'"{name}"' in rows["format"]


def _shown_configs() -> list[tuple[str, Any]]:
    shown: list[tuple[str, Any]] = []
    for block in all_blocks():
        if "mla_quant" in block.markers:
            shown.append((block.id, json.loads(block.source)))
        if block.lang in ("bash", "sh"):
            words = shlex.split(block.source.replace("\\\n", " "), comments=True)
            for i, word in enumerate(words[:-1]):
                if word == "--additional-config":
                    shown.append((block.id, json.loads(words[i + 1])["mla_quant"]))
                if word == "--model_args" and words[i + 1].startswith("{"):
                    extra = json.loads(words[i + 1]).get("additional_config", {})
                    shown.append((block.id, extra.get("mla_quant")))
        if block.lang == "yaml":
            if yaml is None:  # the docs_examples session installs PyYAML
                continue
            doc = yaml.safe_load(block.source)
            extra = doc.get("model_args", {}).get("additional_config", {})
            shown.append((block.id, extra.get("mla_quant")))
    return shown


SHOWN = _shown_configs()


def test_configurations_were_found() -> None:
    assert len(SHOWN) >= 5


@pytest.mark.parametrize(("where", "obj"), SHOWN, ids=[w for w, _ in SHOWN])
def test_shown_configuration_validates(where: str, obj: Any) -> None:
    assert obj is not None, f"{where}: no mla_quant configuration found"
    config.load_config(obj)


def test_reference_example_is_complete() -> None:
    """The JSON example of the reference sets every top-level key but the two that
    exclude each other's defaults (``calibration`` needs a file, ``shadow_storage`` the
    shadow path)."""
    block = next(b for b in all_blocks() if b.path == PAGE and "mla_quant" in b.markers)
    shown = set(json.loads(block.source))
    assert config._TOP_KEYS - shown == {"calibration", "shadow_storage"}
