"""``prefill``'s ``impl`` dispatch (CPU): ``select_impl`` as a pure function, the
validation of ``impl`` and ``config``, the logged fallback, and what ``auto`` launches
on an sm90 device (the capability patched in; kernels captured, not run)."""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import replace
from typing import Any

import pytest
import torch

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_triton import gluon_prefill as gp
from mla_triton import prefill
from mla_triton import warmup as wu
from mla_triton.prefill import Choice, PrefillConfig, select_impl

P = importlib.import_module("mla_triton.prefill")  # the module, not the function
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the interpreter")

API = "triton 3.x lacks the Gluon API of the kernel (no warp_specialize)"
SPARSE = "sparsity: m = 128 exceeds the Gluon prefill's 64-key tiles"


def pick(impl: object = "auto", capability: Any = (9, 0), api: str | None = None,
         unsupported: str | None = None, config: str | None = None,
         nm_gated: bool = False) -> Choice:  # fmt: skip
    return select_impl(impl, capability=capability, gluon_api=api,
                       gluon_unsupported=unsupported, config_impl=config,
                       nm_gated=nm_gated)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "impl", "unexpected"),
    [
        ({}, "gluon", False),  # sm90, the API there, inputs covered
        ({"capability": (8, 0)}, "triton", False),
        ({"capability": (8, 9)}, "triton", False),
        ({"capability": (10, 0)}, "triton", False),  # Blackwell: no sm90a wgmma
        ({"capability": (9, 1)}, "triton", False),
        ({"capability": None}, "triton", False),  # CPU / the interpreter
        ({"api": API}, "triton", True),  # sm90 without the API: logged
        ({"unsupported": SPARSE}, "triton", False),  # N:M groups wider than a tile
        ({"nm_gated": True}, "triton", False),  # N:M while GLUON_NM_AUTO is off
        ({"nm_gated": True, "impl": "gluon"}, "gluon", False),  # forced: runs Gluon
        ({"nm_gated": True, "config": "gluon"}, "gluon", False),
        ({"nm_gated": True, "capability": (8, 0)}, "triton", False),
        ({"unsupported": "q: the Gluon prefill takes float16 or bfloat16"}, "triton", False),
        ({"config": "triton"}, "triton", False),  # a PrefillConfig asks for Triton
        ({"config": "gluon"}, "gluon", False),
        ({"impl": "triton"}, "triton", False),
        ({"impl": "triton", "capability": (8, 0)}, "triton", False),
        ({"impl": "gluon"}, "gluon", False),
        ({"impl": "gluon", "config": "gluon"}, "gluon", False),
    ],
)
def test_select_impl(kwargs: dict[str, Any], impl: str, unexpected: bool) -> None:
    choice = pick(**kwargs)
    assert choice.impl == impl and choice.unexpected == unexpected
    auto_fell_back = kwargs.get("impl", "auto") == "auto" and impl == "triton"
    assert (choice.reason is not None) == auto_fell_back


def test_select_impl_reasons_come_in_order() -> None:
    """The device first, then the installed Triton, then the inputs."""
    reason = pick(capability=(8, 0), api=API, unsupported=SPARSE).reason
    assert reason is not None and "sm90" in reason
    assert pick(api=API, unsupported=SPARSE).reason == API
    assert pick(unsupported=SPARSE).reason == SPARSE
    assert pick(unsupported=SPARSE, nm_gated=True).reason == SPARSE
    gated = pick(nm_gated=True).reason
    assert gated is not None and gated.startswith("sparsity: ") and "GLUON_NM_AUTO" in gated


@pytest.mark.parametrize("impl", ["Gluon", "", "cuda", "flash", None, 1, True])
def test_unknown_impl_names_impl(impl: object) -> None:
    with pytest.raises(ValueError, match=r"^impl: expected 'auto', 'triton' or 'gluon'"):
        pick(impl)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"capability": (8, 0)}, "sm90"),
        ({"capability": None}, "sm90"),
        ({"api": API}, "Gluon API"),
        ({"unsupported": SPARSE}, "sparsity: m = 128"),
    ],
)
def test_gluon_where_it_cannot_run_names_impl(kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=rf"^impl: the Gluon prefill cannot run.*{reason}"):
        pick("gluon", **kwargs)
    with pytest.raises(ValueError, match=rf"^config: the Gluon prefill cannot run.*{reason}"):
        pick("auto", config="gluon", **kwargs)  # a GluonPrefillConfig asks for Gluon


@pytest.mark.parametrize(("impl", "config"), [("triton", "gluon"), ("gluon", "triton")])
def test_config_of_the_other_family_names_config(impl: str, config: str) -> None:
    with pytest.raises(ValueError, match=r"^config: "):
        pick(impl, config=config)


def _inputs(dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(21, 2, 64, generator=gen).to(dtype)
    k = torch.randn(21, 1, 64, generator=gen).to(dtype)
    v = torch.randn(21, 1, 64, generator=gen).to(dtype)
    return q, k, v, torch.tensor([0, 3, 21], dtype=torch.int32)


class _Capture:
    """Stands in for a kernel: records each launch (grid, keyword constexprs; the
    positional arguments in ``args``), runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, dict[str, Any]]] = []
        self.args: list[tuple[Any, ...]] = []

    def __getitem__(self, grid: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> None:
            self.launches.append((grid, kwargs))
            self.args.append(args)

        return run


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> dict[str, _Capture]:
    """Both attention kernels captured (the Q/K/V pass runs); the logged set emptied."""
    from mla_triton.kernels import gluon_prefill as gk

    captured = {"triton": _Capture(), "gluon": _Capture()}
    monkeypatch.setattr(P, "prefill_fwd_kernel", captured["triton"])
    monkeypatch.setattr(gk, "gluon_prefill_kernel", captured["gluon"])
    monkeypatch.setattr(P, "_LOGGED", set())
    return captured


@needs_interpreter
@pytest.mark.parametrize("impl", ["GLUON", "fa3", None])
def test_prefill_rejects_impl_before_any_launch(impl: object, kernels: dict[str, _Capture]) -> None:
    q, k, v, cu = _inputs()
    with pytest.raises(ValueError, match=r"^impl: "):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl=impl)  # type: ignore[arg-type]
    assert not kernels["triton"].launches and not kernels["gluon"].launches


@needs_interpreter
def test_prefill_config_checks(kernels: dict[str, _Capture]) -> None:
    q, k, v, cu = _inputs()
    with pytest.raises(ValueError, match=r"^config: expected None, a PrefillConfig or a Gluon"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, config=(32, 32))
    with pytest.raises(ValueError, match=r"^config: "):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl="triton", config=gp.GluonPrefillConfig())
    with pytest.raises(ValueError, match=r"^impl: the Gluon prefill cannot run.*sm90"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl="gluon")  # a CPU tensor
    assert not kernels["triton"].launches and not kernels["gluon"].launches


@needs_interpreter
def test_auto_is_the_triton_kernel_off_sm90() -> None:
    """On a CPU (no sm90) ``auto`` computes exactly what ``impl="triton"`` does."""
    q, k, v, cu = _inputs()
    quant = AttentionQuant(p="fp8")
    a, lse_a = prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, return_lse=True)
    b, lse_b = prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, return_lse=True,
                       impl="triton")  # fmt: skip
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)


@needs_interpreter
@pytest.mark.parametrize("recipe", ["none", "fp8", "nvfp4"])
def test_auto_on_sm90_launches_gluon_with_the_measured_tiling(
    recipe: str, kernels: dict[str, _Capture], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0))
    q, k, v, cu = _inputs()
    # P's format picks the tiling (Q/K/V left raw: no interpreted pass)
    quant = None if recipe == "none" else AttentionQuant(p=recipe)
    prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, max_seqlen_q=18, max_seqlen_k=18)
    assert not kernels["triton"].launches
    ((grid, constexprs),) = kernels["gluon"].launches
    want = gp.AUTO_CONFIGS[recipe]
    assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"], constexprs["NUM_STAGES"]) == (
        want.block_m, want.block_n, want.num_stages)  # fmt: skip
    assert constexprs["WARP_SPEC"] == want.warp_specialize
    assert constexprs["P_FMT"] == {"none": 0, "fp8": 1, "nvfp4": 2}[recipe]
    assert grid == (1, 2, 2)


@needs_interpreter
def test_expected_fallbacks_on_sm90_are_silent(
    kernels: dict[str, _Capture], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """N:M sparsity (``GLUON_NM_AUTO`` off), float32 and a PrefillConfig go to the Triton
    kernel, unlogged."""
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(P, "GLUON_NM_AUTO", False)
    q, k, v, cu = _inputs()
    q32, k32, v32, _ = _inputs(torch.float32)
    with caplog.at_level(logging.INFO, logger="mla_triton"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, sparsity=NMSparsity(2, 4))
        prefill(q32, k32, v32, cu, cu, softmax_scale=0.1)
        prefill(q, k, v, cu, cu, softmax_scale=0.1, config=PrefillConfig(32, 32))
    assert len(kernels["triton"].launches) == 3 and not kernels["gluon"].launches
    assert not caplog.records


@needs_interpreter
def test_missing_gluon_api_on_sm90_is_logged_once(
    kernels: dict[str, _Capture], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(gp, "api_missing", lambda: API)
    q, k, v, cu = _inputs()
    with caplog.at_level(logging.WARNING, logger="mla_triton"):
        for _ in range(3):
            prefill(q, k, v, cu, cu, softmax_scale=0.1)
    assert len(kernels["triton"].launches) == 3 and not kernels["gluon"].launches
    (record,) = caplog.records
    assert record.name == "mla_triton" and API in record.getMessage()
    with pytest.raises(ValueError, match=r"^impl: .*Gluon API"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl="gluon")


def test_the_installed_triton_has_the_gluon_api() -> None:
    """Triton 3.8 (the established set) has it; the check runs once (cached)."""
    gp.api_missing.cache_clear()
    assert gp.api_missing() is None
    assert gp.api_missing() is None and gp.api_missing.cache_info().hits >= 1


def test_auto_configs_are_gluon_tilings_for_every_p_format() -> None:
    formats = ("none", "fp8", "nvfp4")
    assert set(gp.AUTO_CONFIGS) == {*formats, *(f"{f}+nm" for f in formats)}
    for key, config in gp.AUTO_CONFIGS.items():
        assert isinstance(config, gp.GluonPrefillConfig), key
        fmt, sparse = key.removesuffix("+nm"), key.endswith("+nm")
        recipe = P.Recipe.of(AttentionQuant() if fmt == "none" else AttentionQuant.uniform(fmt))
        assert gp.auto_config(recipe, sparse) is config


@pytest.mark.parametrize(
    ("q", "p", "sparse", "in_kernel"),
    [("fp8", "fp8", False, True), (OperandQuant("fp8", 5.0), "fp8", False, True),
     ("fp8", "none", False, True), ("fp8", "fp8", True, True),
     ("nvfp4", "nvfp4", False, False), ("nvfp4", "nvfp4", True, False),
     (OperandQuant("nvfp4", 5.0), "nvfp4", False, False),
     (OperandQuant("nvfp4", 5.0), "nvfp4", True, True), ("none", "fp8", False, False)],
)  # fmt: skip
def test_auto_q_qdq_in_kernel(q: Any, p: str, sparse: bool, in_kernel: bool) -> None:
    """Where ``auto``'s tilings QDQ Q in the kernel (sitting 17's measurements): fp8 Q with
    any scale on the tilings of P none / fp8 and of N:M, static nvfp4 Q with N:M only; a
    dynamic nvfp4 Q never (the pass); no Q format, no QDQ."""
    recipe = P.Recipe.of(AttentionQuant(q=q, k="fp8", p=p, v="fp8"))
    config = gp.auto_config(recipe, sparse)
    assert gp.q_qdq_in_kernel(config, recipe) is in_kernel
    assert not gp.q_qdq_in_kernel(replace(config, q_in_kernel=False), recipe)


@needs_interpreter
@pytest.mark.parametrize("switch", [False, True], ids=["switch-off", "switch-on"])
def test_nm_on_sm90_goes_to_gluon_behind_the_switch(
    switch: bool, kernels: dict[str, _Capture], monkeypatch: pytest.MonkeyPatch
) -> None:
    """N:M on sm90: ``auto`` takes the Gluon kernel only with ``GLUON_NM_AUTO`` on (with
    the N:M constexprs, dense-token counts and the "+nm" tiling); ``impl="gluon"`` and
    a GluonPrefillConfig take it either way."""
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(P, "GLUON_NM_AUTO", switch)
    q, k, v, cu = _inputs()
    sparsity = NMSparsity(2, 4, dense_sink_tokens=5, dense_recent_tokens=7)
    quant = AttentionQuant(p="nvfp4")
    kw: dict[str, Any] = {"softmax_scale": 0.1, "quant": quant, "sparsity": sparsity,
                          "max_seqlen_q": 18, "max_seqlen_k": 18}  # fmt: skip
    prefill(q, k, v, cu, cu, **kw)
    assert len(kernels["triton"].launches) == (not switch)
    assert len(kernels["gluon"].launches) == switch
    prefill(q, k, v, cu, cu, impl="gluon", **kw)
    prefill(q, k, v, cu, cu, config=gp.GluonPrefillConfig(64, 64, 2), **kw)
    *_, (_, forced), (_, tiled) = kernels["gluon"].launches
    for constexprs in (forced, tiled):
        assert (constexprs["NM_N"], constexprs["NM_M"], constexprs["NM_DENSE"]) == (2, 4, True)
    want = gp.AUTO_CONFIGS["nvfp4+nm"]
    assert (forced["BLOCK_M"], forced["BLOCK_N"]) == (want.block_m, want.block_n)
    assert (tiled["BLOCK_M"], tiled["BLOCK_N"]) == (64, 64)
    # the dense counts are runtime arguments (after ``group``)
    assert kernels["gluon"].args[-1][15:18] == (2, 5, 7)  # group = 2 / 1, sink, recent
    with pytest.raises(ValueError, match=r"^impl: the Gluon prefill cannot run.*sparsity: m"):
        prefill(q, k, v, cu, cu, impl="gluon", **(kw | {"sparsity": NMSparsity(2, 128)}))
    prefill(q, k, v, cu, cu, impl="gluon", softmax_scale=0.1, max_seqlen_q=18, max_seqlen_k=18)
    (_, dense) = kernels["gluon"].launches[-1]
    assert (dense["NM_N"], dense["NM_DENSE"]) == (0, False)
    assert dense["PINGPONG"] == gp.AUTO_CONFIGS["none"].pingpong
    assert kernels["gluon"].args[-1][16:18] == (0, 0)


@needs_interpreter
def test_gluon_key_does_not_depend_on_the_batch_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Gluon kernel's grid arguments (read by the persistent variant) are not
    specialized: batches of other lengths and sequence counts (query tiles 1 or 3,
    sequences 1 or 2) compile nothing new, so ``warmup_prefill``'s small inputs cover
    them."""
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0))

    def keys_for(lens: list[int]) -> set[tuple[str, str]]:
        total = sum(lens)
        q, k = torch.randn(total, 4, 192).bfloat16(), torch.randn(total, 4, 192).bfloat16()
        v = torch.randn(total, 4, 128).bfloat16()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        with wu.record_keys() as keys:
            prefill(q, k, v, cu, cu, softmax_scale=0.1, max_seqlen_q=max(lens),
                    max_seqlen_k=max(lens), return_lse=True)  # fmt: skip
        return {key for key in keys if key[0].endswith("gluon_prefill_kernel")}

    one = keys_for([100])
    assert len(one) == 1
    assert keys_for([300, 17]) == one


@needs_interpreter
def test_warmup_covers_what_auto_launches_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """On sm90 ``warmup_prefill`` compiles the Gluon kernel (and Q/K/V passes) for the
    dense calls, the Triton kernel only for the N:M-sparse new tokens."""
    monkeypatch.setattr(P, "_capability", lambda device: (9, 0))
    kw: dict[str, Any] = {"num_heads": 4, "head_dim_qk": 192, "head_dim_v": 128,
                          "dtype": torch.bfloat16, "device": torch.device("cpu"),
                          "softmax_scale": 0.1}  # fmt: skip
    names = "mla_triton.kernels.gluon_prefill.gluon_prefill_kernel"
    triton_name = "mla_triton.kernels.prefill_kernel.prefill_fwd_kernel"
    for quant, sparsity in ((None, None), (AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4))):
        with wu.record_keys() as keys:
            calls = wu.warmup_prefill(quant=quant, sparsity=sparsity, **kw)
        kernels = {name for name, _ in keys}
        assert calls == 16
        assert names in kernels
        # N:M: the Triton kernel while GLUON_NM_AUTO is off
        assert (triton_name in kernels) == (sparsity is not None and not P.GLUON_NM_AUTO)
        # the same keys with impl spelled out (what serving with auto reaches)
        with wu.record_keys() as again:
            wu.warmup_prefill(quant=quant, sparsity=sparsity, impl="auto", **kw)
        assert again == keys
