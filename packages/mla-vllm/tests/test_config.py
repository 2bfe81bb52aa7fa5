"""The ``mla_quant`` schema: resolution per layer, and errors naming the bad field."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mla_formats import NMSparsity
from mla_vllm.config import (
    CALIBRATION_FORMAT,
    MLAQuantConfigError,
    config_from_vllm,
    load_calibration,
    load_config,
)


def test_defaults_and_recipe_shorthand() -> None:
    assert load_config(None).recipe_for("any").is_identity
    recipe = load_config({"recipe": "nvfp4", "v": "fp8"}).recipe_for(
        "model.layers.0.self_attn.attn"
    )
    assert recipe.prefill.q.format.name == "nvfp4" and recipe.prefill.q.is_dynamic
    assert recipe.decode.k.static_amax() == 2688.0
    assert recipe.prefill.p.static_amax() == 1.0
    assert recipe.decode.v.format.name == "fp8" and recipe.decode.v.static_amax() == 448.0
    assert recipe.sparsity is None


def test_amax_per_path_and_overrides_in_order() -> None:
    config = load_config(
        {
            "q": {"format": "fp8", "amax": 30.0},
            "k": {"format": "nvfp4", "amax": {"decode": 5.0}},
            "sparsity": {"n": 2, "m": 4, "dense_sink_tokens": 16},
            "layers": [
                {"pattern": "*.layers.1.*", "recipe": "none", "sparsity": None},
                {"pattern": "*.layers.1.*", "p": "fp8"},
                {"pattern": "*.layers.2.*", "k": "fp8"},
            ],
        }
    )
    r0 = config.recipe_for("model.layers.0.self_attn.attn")
    assert r0.prefill.q.static_amax() == 30.0 and r0.decode.q.static_amax() == 30.0
    assert r0.decode.k.static_amax() == 5.0 and r0.prefill.k.static_amax() == 2688.0
    assert r0.sparsity == NMSparsity(2, 4, dense_sink_tokens=16)
    r1 = config.recipe_for("model.layers.1.self_attn.attn")
    assert r1.sparsity is None and r1.prefill.q.is_identity and r1.prefill.p.format.name == "fp8"
    r2 = config.recipe_for("model.layers.2.self_attn.attn")
    assert r2.prefill.k.format.name == "fp8" and r2.sparsity is not None


def _calibration(tmp_path: Path) -> Path:
    path = tmp_path / "calib.json"
    path.write_text(
        json.dumps(
            {
                "format": CALIBRATION_FORMAT,
                "version": 1,
                "layers": {
                    "model.layers.0.self_attn.attn": {
                        "prefill": {"q": 9.0, "k": 7.0, "v": 3.0},
                        "decode": {"q": 40.0, "k": 2.5},
                    }
                },
            }
        )
    )
    return path


def test_calibration_file_gives_static_amax(tmp_path: Path) -> None:
    path = _calibration(tmp_path)
    config = load_config(
        {"recipe": "nvfp4", "v": {"format": "nvfp4", "amax": 1.5}, "calibration": str(path)}
    )
    r = config.recipe_for("model.layers.0.self_attn.attn")
    assert r.prefill.q.static_amax() == 9.0 and r.decode.q.static_amax() == 40.0
    assert r.prefill.k.static_amax() == 7.0 and r.decode.k.static_amax() == 2.5
    assert r.prefill.v.static_amax() == 1.5  # explicit amax wins over calibration
    with pytest.raises(
        MLAQuantConfigError,
        match=r"^mla_quant\.calibration: 1 MLA layer\(s\) take static amaxes from the source "
        r".*'model\.layers\.9\.self_attn\.attn' \(closest source entry: "
        r"'model\.layers\.0\.self_attn\.attn'\).*\"partial\": true",
    ):
        config.recipe_for("model.layers.9.self_attn.attn")  # not calibrated: no fallback
    partial = load_config(
        {
            "recipe": "nvfp4",
            "calibration": {"from": "calibrate", "path": str(path), "partial": True},
        }
    )
    assert partial.recipe_for("model.layers.0.self_attn.attn").prefill.q.static_amax() == 9.0
    other = partial.recipe_for("model.layers.9.self_attn.attn")  # partial: defaults
    assert other.prefill.q.is_dynamic


def test_config_from_a_json_file(tmp_path: Path) -> None:
    path = tmp_path / "quant.json"
    path.write_text(json.dumps({"recipe": "fp8"}))
    assert load_config(str(path)).recipe_for("x").decode.v.format.name == "fp8"
    assert load_config(str(path)).source == str(path)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ([1], r"^mla_quant: expected a JSON object"),
        ({"recipes": "fp8"}, r"^mla_quant: unknown key\(s\) \['recipes'\]"),
        ({"recipe": "int4"}, r"^mla_quant\.recipe: unknown format 'int4'"),
        ({"q": {"amax": 3.0}}, r"^mla_quant\.q: missing key 'format'"),
        ({"q": {"format": "fp8", "scale": 1}}, r"^mla_quant\.q: unknown key\(s\) \['scale'\]"),
        ({"k": {"format": "fp8", "amax": -1}}, r"^mla_quant\.k\.amax: expected a positive"),
        ({"k": {"format": "fp8", "amax": True}}, r"^mla_quant\.k\.amax: expected a positive"),
        ({"p": {"format": "fp8", "amax": "dynamic"}}, r"^mla_quant\.p\.amax: a dynamic amax"),
        (
            {"v": {"format": "fp8", "amax": {"decod": 1.0}}},
            r"^mla_quant\.v\.amax: unknown key\(s\) \['decod'\]",
        ),
        (
            {"v": {"format": "fp8", "amax": {"decode": float("nan")}}},
            r"^mla_quant\.v\.amax\.decode: expected a positive",
        ),
        ({"q": {"format": "none", "amax": 2.0}}, r"^mla_quant\.q\.amax: format 'none' takes no"),
        ({"sparsity": {"n": 2}}, r"^mla_quant\.sparsity: missing key 'm'"),
        ({"sparsity": {"n": 4, "m": 4}}, r"^mla_quant\.sparsity: n: expected 1 <= n < m"),
        ({"sparsity": {"n": 1, "m": 3}}, r"^mla_quant\.sparsity: m: expected a power of two"),
        (
            {"sparsity": {"n": 1, "m": 4, "dense_sink_tokens": -1}},
            r"^mla_quant\.sparsity\.dense_sink_tokens: expected an integer >= 0",
        ),
        ({"layers": {"pattern": "*"}}, r"^mla_quant\.layers: expected a list"),
        (
            {"layers": [{"recipe": "fp8"}]},
            r"^mla_quant\.layers\[0\]\.pattern: expected a non-empty",
        ),
        ({"layers": [{"pattern": "*", "q": "fp9"}]}, r"^mla_quant\.layers\[0\]\.q: unknown format"),
        (
            {"layers": [{"pattern": "*", "calibration": "x"}]},
            r"^mla_quant\.layers\[0\]: unknown key\(s\) \['calibration'\]",
        ),
        ({"observe": {"enabled": "yes"}}, r"^mla_quant\.observe\.enabled: expected true or false"),
        ({"observe": {"interval": 0}}, r"^mla_quant\.observe\.interval: expected an integer >= 1"),
        ({"calibration": "/nonexistent/calib.json"}, r"^mla_quant\.calibration: cannot read"),
    ],
)
def test_errors_name_the_field(config: object, message: str) -> None:
    with pytest.raises(MLAQuantConfigError, match=message):
        load_config(config)


def test_bad_files_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"^mla_quant: .*bad\.json' is not valid JSON"):
        load_config(str(bad))
    calib = tmp_path / "calib.json"
    calib.write_text(
        json.dumps(
            {"format": CALIBRATION_FORMAT, "version": 1, "layers": {"l0": {"prefill": {"p": 1.0}}}}
        )
    )
    with pytest.raises(
        ValueError,
        match=r"^mla_quant\.calibration\.layers\['l0'\]\.prefill: "
        r"unknown key\(s\) \['p'\]",
    ):
        load_config({"calibration": str(calib)})
    with pytest.raises(ValueError, match=r"^calibration\.format: expected 'mla-quant-calibration'"):
        load_calibration({"format": "other", "version": 1, "layers": {}})


def test_unmatched_pattern_is_named() -> None:
    config = load_config(
        {
            "layers": [
                {"pattern": "*.layers.0.*", "recipe": "fp8"},
                {"pattern": "decoder.*", "recipe": "fp8"},
            ]
        }
    )
    config.check_layer_names(["model.layers.0.self_attn.attn", "decoder.attn"], where="x")
    with pytest.raises(ValueError, match=r"^x\.layers\[1\]\.pattern: 'decoder\.\*' matches no"):
        config.check_layer_names(["model.layers.0.self_attn.attn"], where="x")


def test_static_p_amax_below_one_is_refused_naming_the_key_and_layer() -> None:
    """P's static amax is at least 1, on both paths (mla_formats refuses it too).

    The rule: docs/numerics.md "Edge cases we chose".
    """
    config = load_config(
        {
            "recipe": "nvfp4",
            "layers": [{"pattern": "*.layers.1.*", "p": {"format": "nvfp4", "amax": 0.5}}],
        }
    )
    assert not config.recipe_for("model.layers.0.self_attn.attn").is_identity
    with pytest.raises(
        MLAQuantConfigError,
        match=r"^mla_quant\.layers\[0\]\.p\.amax: layer 'model\.layers\.1\.self_attn\.attn': "
        r"P's static amax must be at least 1 \(prefill path\), got 0\.5$",
    ):
        config.recipe_for("model.layers.1.self_attn.attn")
    refused = [
        ({"p": {"format": "fp8", "amax": 0.25}}, r"mla_quant\.p\.amax", "prefill"),
        (
            {"p": {"format": "nvfp4", "amax": {"decode": 0.5}}},
            r"mla_quant\.p\.amax\.decode",
            "decode",
        ),
    ]
    for obj, key, path in refused:
        with pytest.raises(
            MLAQuantConfigError,
            match=rf"^{key}: P's static amax must be at least 1 \({path} path\)",
        ):
            load_config(obj)
    with pytest.raises(MLAQuantConfigError, match=r"^additional_config\.mla_quant\.p\.amax: "):
        config_from_vllm(SimpleNamespace(additional_config={"mla_quant": refused[0][0]}))
    for amax in (1.0, {"prefill": 1.0, "decode": 4.0}):
        recipe = load_config({"p": {"format": "nvfp4", "amax": amax}}).recipe_for("x")
        assert recipe.prefill.p.static_amax() == 1.0
    assert load_config({"p": "nvfp4"}).recipe_for("x").decode.p.static_amax() == 1.0


def test_mla_formats_refusals_name_the_config_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``mla_formats`` ``ValueError`` (its message starts with the role) is raised as an
    ``MLAQuantConfigError`` naming the key that set that role."""
    import mla_vllm.config as config_module

    real = config_module.AttentionQuant

    def refuse_v(**roles: object) -> object:
        if roles["v"] != "none":
            raise ValueError("v: refused by mla_formats")
        return real(**roles)  # type: ignore[arg-type]

    monkeypatch.setattr(config_module, "AttentionQuant", refuse_v)
    config = load_config({"layers": [{"pattern": "*.1.*", "v": {"format": "fp8", "amax": 3.0}}]})
    with pytest.raises(
        MLAQuantConfigError, match=r"^mla_quant\.layers\[0\]\.v\.amax: layer 'm\.1\.a': refused"
    ):
        config.recipe_for("m.1.a")
    with pytest.raises(MLAQuantConfigError, match=r"^mla_quant\.v: refused by mla_formats$"):
        load_config({"recipe": "fp8"})


@pytest.mark.parametrize(
    ("amax", "message"),
    [(1e39, "beyond float32's range"), (1e-40, "below float32's smallest normal")],
)
def test_amax_without_a_float32_scale_is_refused_naming_the_key(amax: float, message: str) -> None:
    """A static amax whose global scale is not a normal float32 is refused when the
    configuration is read, naming its dotted key (not after the engine starts)."""
    with pytest.raises(MLAQuantConfigError, match=rf"^mla_quant\.k\.amax: amax .*{message}"):
        load_config({"recipe": "nvfp4", "k": {"format": "nvfp4", "amax": amax}})
    with pytest.raises(MLAQuantConfigError, match=rf"^mla_quant\.v\.amax\.decode: .*{message}"):
        load_config({"v": {"format": "fp8", "amax": {"prefill": 3.0, "decode": amax}}})


def test_a_recipe_name_as_the_whole_configuration_says_where_it_goes() -> None:
    with pytest.raises(MLAQuantConfigError, match=r'^mla_quant: .nvfp4. is a recipe name, not a '
                       r'configuration file: give \{"recipe": "nvfp4"\}'):  # fmt: skip
        load_config("nvfp4")
