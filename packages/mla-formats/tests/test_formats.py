"""Format descriptions, AttentionQuant defaults and NMSparsity validation."""

from __future__ import annotations

import pytest

from mla_formats import FP8, NONE, NVFP4, AttentionQuant, NMSparsity, OperandQuant, get_format


def test_formats_and_unit_amax() -> None:
    assert get_format("nvfp4") is NVFP4 and NVFP4.block_size == 16 and NVFP4.unit_amax == 2688.0
    assert get_format("fp8") is FP8 and FP8.block_size is None and FP8.unit_amax == 448.0
    assert get_format(NONE).is_identity
    with pytest.raises(ValueError, match="fmt: unknown format 'fp4'"):
        get_format("fp4")


def test_attention_quant_defaults_per_role() -> None:
    recipe = AttentionQuant.uniform("nvfp4")
    assert recipe.q.amax == "dynamic"
    assert recipe.k.amax == 2688.0 and recipe.v.amax == 2688.0
    assert recipe.p.amax == 1.0 and recipe.p.global_scale() == 1.0 / 2688.0
    fp8 = AttentionQuant.uniform("fp8")
    assert fp8.k.amax == 448.0 and fp8.k.global_scale() == 1.0 and fp8.p.amax == 1.0
    assert AttentionQuant().is_identity and not recipe.is_identity
    mixed = AttentionQuant(k="fp8", v=OperandQuant("nvfp4", amax=12.0))
    assert mixed.q.is_identity and mixed.k.format is FP8 and mixed.v.amax == 12.0
    assert hash(mixed) == hash(AttentionQuant(k="fp8", v=OperandQuant("nvfp4", amax=12.0)))


def test_attention_quant_rejects_bad_operands() -> None:
    with pytest.raises(ValueError, match="v: a dynamic amax"):
        AttentionQuant(v=OperandQuant("nvfp4", amax="dynamic"))
    with pytest.raises(ValueError, match="p: a dynamic amax"):
        AttentionQuant(p=OperandQuant("fp8", amax="dynamic"))
    with pytest.raises(ValueError, match="k: unknown format"):
        AttentionQuant(k="int8")
    with pytest.raises(ValueError, match="amax: amax must be positive"):
        OperandQuant("fp8", amax=-3.0)
    with pytest.raises(ValueError, match="q: expected a format name"):
        AttentionQuant(q=3)  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("amax", [0.999, 0.5, 1e-3])
def test_attention_quant_refuses_a_static_p_amax_below_one(fmt: str, amax: float) -> None:
    with pytest.raises(ValueError, match=r"^p: a static amax below 1 is refused.*split counts"):
        AttentionQuant(p=OperandQuant(fmt, amax))
    assert AttentionQuant(p=OperandQuant(fmt, 1.0)).p.static_amax() == 1.0
    assert AttentionQuant(p=OperandQuant(fmt, 1.5)).p.static_amax() == 1.5
    assert AttentionQuant(p=OperandQuant("none", amax)).p.is_identity  # none has no scale
    # k and v may take any positive static amax
    assert AttentionQuant(k=OperandQuant(fmt, amax), v=OperandQuant(fmt, amax)).v.amax == amax


def test_static_amax_of_dynamic_operand_raises() -> None:
    with pytest.raises(ValueError, match="dynamic amax"):
        AttentionQuant.uniform("fp8").q.static_amax()


def test_nm_sparsity_validation() -> None:
    sparsity = NMSparsity(2, 4, dense_sink_tokens=4, dense_recent_tokens=64)
    assert (sparsity.n, sparsity.m) == (2, 4)
    for kwargs, message in [
        ({"n": 4, "m": 4}, "n: expected 1 <= n < m"),
        ({"n": 0, "m": 4}, "n: expected"),
        ({"n": 2, "m": 6}, "m: expected a power of two"),
        ({"n": 2, "m": 4, "dense_sink_tokens": -1}, "dense_sink_tokens"),
        ({"n": 2, "m": 4, "dense_recent_tokens": -5}, "dense_recent_tokens"),
        ({"n": 2.0, "m": 4}, "n: expected an int"),
    ]:
        with pytest.raises(ValueError, match=message):
            NMSparsity(**kwargs)  # type: ignore[arg-type]
