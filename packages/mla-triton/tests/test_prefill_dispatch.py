"""``prefill``'s implementation choice (CPU): ``choose`` as a pure function, implementations
forced with ``mla_triton.tuning.use`` and refused before any launch, the logged fallback,
and what ``auto`` launches on an sm90 device (the capability patched in; kernels
captured, not run)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch
from calls import prefill  # mla_triton.prefill, with ``impl``/``config`` forced (tuning.use)

from mla_formats import AttentionQuant, NMSparsity, OperandQuant
from mla_triton import precompile as wu
from mla_triton import tuning
from mla_triton.common import device as dev
from mla_triton.ops.prefill import choose
from mla_triton.ops.prefill import gluon as gp
from mla_triton.ops.prefill import triton as tp
from mla_triton.ops.prefill.core import Recipe
from mla_triton.ops.prefill.triton import PrefillConfig

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="CPU tensors need the interpreter")

API = "Triton 3.7.0: the Gluon kernels are compiled and tested for Triton 3.8"
SPARSE = "sparsity: m = 128 exceeds the Gluon prefill's 64-key tiles"


def pick(
    impl: str = "auto",
    config: object = None,
    capability: Any = (9, 0),
    api: str | None = None,
    unsupported: str | None = None,
) -> tuple[str, str | None]:
    """``choose``'s family (by name) and reason."""
    family, reason = choose(impl, config, capability=capability, gluon_api=api,
                            gluon_unsupported=unsupported)  # fmt: skip
    return family.name, reason


@pytest.mark.parametrize(
    ("kwargs", "impl"),
    [
        ({}, "gluon"),  # sm90, the Gluon release of Triton, inputs covered
        ({"capability": (8, 0)}, "triton"),
        ({"capability": (8, 9)}, "triton"),
        ({"capability": (10, 0)}, "triton"),  # Blackwell: no sm90a wgmma
        ({"capability": (9, 1)}, "triton"),
        ({"capability": None}, "triton"),  # CPU / the interpreter
        ({"api": API}, "triton"),  # sm90 on another Triton release
        ({"unsupported": SPARSE}, "triton"),  # N:M groups wider than a tile
        ({"unsupported": "q: the Gluon prefill takes float16 or bfloat16"}, "triton"),
        ({"impl": "triton"}, "triton"),
        ({"impl": "triton", "capability": (8, 0)}, "triton"),
        ({"impl": "triton", "config": PrefillConfig(32, 32)}, "triton"),
        ({"impl": "gluon"}, "gluon"),
        ({"impl": "gluon", "config": gp.GluonPrefillConfig()}, "gluon"),
    ],
    ids=["sm90", "sm80", "sm89", "sm100", "sm91", "cpu", "other-triton", "wide-nm", "float32",
         "triton", "triton-sm80", "triton-config", "gluon", "gluon-config"],
)  # fmt: skip
def test_choose(kwargs: dict[str, Any], impl: str) -> None:
    """The family; a reason exactly where ``auto`` did not take Gluon."""
    name, reason = pick(**kwargs)
    assert name == impl
    auto_fell_back = kwargs.get("impl", "auto") == "auto" and impl == "triton"
    assert (reason is not None) == auto_fell_back


def test_choose_reasons_come_in_order() -> None:
    """The device first, then the installed Triton, then the inputs."""
    _, reason = pick(capability=(8, 0), api=API, unsupported=SPARSE)
    assert reason is not None and "sm90" in reason
    assert pick(api=API, unsupported=SPARSE)[1] == API
    assert pick(unsupported=SPARSE)[1] == SPARSE


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"capability": (8, 0)}, "sm90"),
        ({"capability": None}, "sm90"),
        ({"api": API}, "compiled and tested for Triton"),
        ({"unsupported": SPARSE}, "sparsity: m = 128"),
    ],
    ids=["sm80", "cpu", "other-triton", "wide-nm"],
)
def test_forced_gluon_where_it_cannot_run_names_impl(kwargs: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=rf"^impl: the Gluon prefill cannot run.*{reason}"):
        pick("gluon", **kwargs)
    with pytest.raises(ValueError, match=rf"^impl: the Gluon prefill cannot run.*{reason}"):
        pick("gluon", gp.GluonPrefillConfig(), **kwargs)  # a config forces its family


@pytest.mark.parametrize(
    ("impl", "config"),
    [("triton", gp.GluonPrefillConfig()), ("gluon", PrefillConfig(32, 32))],
    ids=["triton-gluon-config", "gluon-triton-config"],
)
def test_config_of_the_other_family_names_config(impl: str, config: object) -> None:
    with pytest.raises(ValueError, match=rf"^config: impl '{impl}' takes a tuning\."):
        pick(impl, config)


def _inputs(dtype: torch.dtype = torch.float16, dim: int = 64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(21, 2, dim, generator=gen).to(dtype)
    k = torch.randn(21, 1, dim, generator=gen).to(dtype)
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
    """Both attention kernels captured (the Q/K/V passes run)."""
    captured = {"triton": _Capture(), "gluon": _Capture()}
    monkeypatch.setattr(tp, "prefill_fwd_kernel", captured["triton"])
    monkeypatch.setattr(gp, "gluon_prefill_kernel", captured["gluon"])
    return captured


@pytest.fixture
def as_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """``prefill`` dispatches CPU tensors as on an H200; the Q/K/V passes keep the
    interpreter's E4M3 conversions."""
    monkeypatch.setattr(dev, "capability", lambda device: (9, 0))
    monkeypatch.setattr(dev, "hw_fp8", lambda device: False)


@pytest.fixture
def fresh_api_check() -> Iterator[None]:
    """``gluon_api_missing`` recomputed (and its warning logged again) inside the test."""
    dev.gluon_api_missing.cache_clear()
    yield
    dev.gluon_api_missing.cache_clear()


@needs_interpreter
@pytest.mark.parametrize("impl", ["GLUON", "fa3", ""])
def test_unknown_impl_is_refused_before_any_launch(impl: str, kernels: dict[str, _Capture]) -> None:
    q, k, v, cu = _inputs()
    with pytest.raises(ValueError, match=r"^impl: expected one of gluon, gluon_ws, triton"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl=impl)
    assert not kernels["triton"].launches and not kernels["gluon"].launches


@pytest.mark.parametrize(
    ("choice", "match"),
    [((32, 32), r"^use: expected an implementation name or a tuning config, got tuple"),
     (None, r"^use: expected an implementation name"), ("Triton", r"^impl: expected one of")],
    ids=["tuple", "none", "capitalized-name"],
)  # fmt: skip
def test_use_refuses_what_is_not_an_implementation(choice: object, match: str) -> None:
    with pytest.raises(ValueError, match=match), tuning.use(choice):  # type: ignore[arg-type]
        pass


@needs_interpreter
def test_forced_gluon_on_cpu_is_refused_before_any_launch(kernels: dict[str, _Capture]) -> None:
    q, k, v, cu = _inputs()
    with pytest.raises(ValueError, match=r"^impl: the Gluon prefill cannot run.*sm90"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl="gluon")  # a CPU tensor
    with pytest.raises(ValueError, match=r"^impl: the Gluon prefill cannot run.*sm90"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, config=gp.GluonPrefillConfig())
    assert not kernels["triton"].launches and not kernels["gluon"].launches


@needs_interpreter
def test_auto_is_the_triton_kernel_off_sm90() -> None:
    """On a CPU (no sm90) ``auto`` computes exactly what the forced Triton kernel does."""
    q, k, v, cu = _inputs()
    quant = AttentionQuant(p="fp8")
    a, lse_a = prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, return_lse=True)
    b, lse_b = prefill(q, k, v, cu, cu, softmax_scale=0.1, quant=quant, return_lse=True,
                       impl="triton")  # fmt: skip
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)


@needs_interpreter
@pytest.mark.parametrize("recipe", ["none", "fp8", "nvfp4"])
def test_auto_on_sm90_launches_gluon_with_the_measured_tiling(
    recipe: str, kernels: dict[str, _Capture], as_sm90: None
) -> None:
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
    kernels: dict[str, _Capture], as_sm90: None, caplog: pytest.LogCaptureFixture
) -> None:
    """float32, a head dim the Gluon kernel does not cover, and a forced Triton tiling go
    to the Triton kernel, unlogged."""
    q, k, v, cu = _inputs()
    q32, k32, v32, _ = _inputs(torch.float32)
    q160, k160, v160, _ = _inputs(dim=160)
    assert gp.unsupported(q160.dtype, 160, 64, None) is not None
    with caplog.at_level(logging.INFO, logger="mla_triton"):
        prefill(q32, k32, v32, cu, cu, softmax_scale=0.1)
        prefill(q160, k160, v160, cu, cu, softmax_scale=0.1)
        prefill(q, k, v, cu, cu, softmax_scale=0.1, config=PrefillConfig(32, 32))
    assert len(kernels["triton"].launches) == 3 and not kernels["gluon"].launches
    assert not caplog.records


@needs_interpreter
def test_other_triton_release_on_sm90_is_logged_once(
    kernels: dict[str, _Capture],
    as_sm90: None,
    fresh_api_check: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On a Triton release other than the Gluon kernels' one, sm90 runs the Triton kernel;
    one warning names the release; the forced Gluon kernel is refused naming ``impl``."""
    monkeypatch.setattr(dev, "triton_release", lambda: (3, 7))
    q, k, v, cu = _inputs()
    with caplog.at_level(logging.WARNING, logger="mla_triton"):
        for _ in range(3):
            prefill(q, k, v, cu, cu, softmax_scale=0.1)
    assert len(kernels["triton"].launches) == 3 and not kernels["gluon"].launches
    (record,) = caplog.records
    assert record.name == "mla_triton"
    assert "compiled and tested for Triton 3.8" in record.getMessage()
    with pytest.raises(ValueError, match=r"^impl: .*compiled and tested for Triton 3\.8"):
        prefill(q, k, v, cu, cu, softmax_scale=0.1, impl="gluon")
    assert not kernels["gluon"].launches


def test_the_installed_triton_has_the_gluon_api(fresh_api_check: None) -> None:
    """The installed Triton is the Gluon kernels' release; the check runs once (cached)."""
    assert dev.triton_release() == dev.GLUON_TRITON
    assert dev.gluon_api_missing() is None
    assert dev.gluon_api_missing() is None and dev.gluon_api_missing.cache_info().hits >= 1


def test_auto_configs_are_gluon_tilings_for_every_p_format() -> None:
    formats = ("none", "fp8", "nvfp4")
    assert set(gp.AUTO_CONFIGS) == {*formats, *(f"{f}+nm" for f in formats)}
    for key, config in gp.AUTO_CONFIGS.items():
        assert isinstance(config, gp.GluonPrefillConfig), key
        fmt, sparse = key.removesuffix("+nm"), key.endswith("+nm")
        recipe = Recipe.of(AttentionQuant() if fmt == "none" else AttentionQuant.uniform(fmt))
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
    """Where ``auto``'s tilings QDQ Q in the kernel: fp8 Q with any scale on the tilings of
    P none / fp8 and of N:M, static nvfp4 Q with N:M only; a dynamic nvfp4 Q never (the
    pass); no Q format, no QDQ."""
    recipe = Recipe.of(AttentionQuant(q=q, k="fp8", p=p, v="fp8"))
    config = gp.auto_config(recipe, sparse)
    assert gp.q_qdq_in_kernel(config, recipe) is in_kernel
    assert not gp.q_qdq_in_kernel(replace(config, q_in_kernel=False), recipe)


@needs_interpreter
def test_nm_on_sm90_goes_to_gluon(kernels: dict[str, _Capture], as_sm90: None) -> None:
    """N:M on sm90: ``auto``, the forced Gluon kernel and a Gluon tiling launch the Gluon
    kernel with the N:M constexprs, the dense-token counts and the "+nm" tiling; N:M groups
    wider than its tiles are refused where Gluon is forced."""
    q, k, v, cu = _inputs()
    sparsity = NMSparsity(2, 4, dense_sink_tokens=5, dense_recent_tokens=7)
    quant = AttentionQuant(p="nvfp4")
    kw: dict[str, Any] = {"softmax_scale": 0.1, "quant": quant, "sparsity": sparsity,
                          "max_seqlen_q": 18, "max_seqlen_k": 18}  # fmt: skip
    prefill(q, k, v, cu, cu, **kw)
    prefill(q, k, v, cu, cu, impl="gluon", **kw)
    prefill(q, k, v, cu, cu, config=gp.GluonPrefillConfig(64, 64, 2), **kw)
    assert not kernels["triton"].launches
    (_, auto), (_, forced), (_, tiled) = kernels["gluon"].launches
    for constexprs in (auto, forced, tiled):
        assert (constexprs["NM_N"], constexprs["NM_M"], constexprs["NM_DENSE"]) == (2, 4, True)
    want = gp.AUTO_CONFIGS["nvfp4+nm"]
    for constexprs in (auto, forced):
        assert (constexprs["BLOCK_M"], constexprs["BLOCK_N"]) == (want.block_m, want.block_n)
    assert (tiled["BLOCK_M"], tiled["BLOCK_N"]) == (64, 64)
    # the dense counts are runtime arguments (after ``group``)
    assert kernels["gluon"].args[-1][17:20] == (2, 5, 7)  # group = 2 / 1, sink, recent
    with pytest.raises(ValueError, match=r"^impl: the Gluon prefill cannot run.*sparsity: m"):
        prefill(q, k, v, cu, cu, impl="gluon", **(kw | {"sparsity": NMSparsity(2, 128)}))
    prefill(q, k, v, cu, cu, impl="gluon", softmax_scale=0.1, max_seqlen_q=18, max_seqlen_k=18)
    (_, dense) = kernels["gluon"].launches[-1]
    assert (dense["NM_N"], dense["NM_DENSE"]) == (0, False)
    assert dense["PINGPONG"] == gp.AUTO_CONFIGS["none"].pingpong
    assert kernels["gluon"].args[-1][18:20] == (0, 0)
    assert len(kernels["gluon"].launches) == 4 and not kernels["triton"].launches


@needs_interpreter
def test_gluon_key_does_not_depend_on_the_batch_shape(as_sm90: None) -> None:
    """The Gluon kernel's compile key does not depend on the batch: batches of other
    lengths and sequence counts (query tiles 1 or 3,
    sequences 1 or 2) compile nothing new, so ``warmup_prefill``'s small inputs cover
    them."""

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
def test_warmup_covers_what_auto_launches_on_sm90(as_sm90: None) -> None:
    """On sm90 ``warmup_prefill`` compiles the Gluon kernel (and the Q/K/V passes) for the
    dense and the N:M-sparse calls, the Triton kernel for none of them: the same keys as
    with the Gluon kernel forced."""
    kw: dict[str, Any] = {"num_heads": 4, "head_dim_qk": 192, "head_dim_v": 128,
                          "dtype": torch.bfloat16, "device": torch.device("cpu"),
                          "softmax_scale": 0.1}  # fmt: skip
    gluon_name = "mla_triton.ops.prefill.gluon_kernels.gluon_prefill_kernel"
    triton_name = "mla_triton.ops.prefill.triton_kernels.prefill_fwd_kernel"
    for quant, sparsity in ((None, None), (AttentionQuant.uniform("nvfp4"), NMSparsity(2, 4))):
        with wu.record_keys() as keys:
            calls = wu.warmup_prefill(quant=quant, sparsity=sparsity, **kw)
        kernels = {name for name, _ in keys}
        assert calls == 16
        assert gluon_name in kernels and triton_name not in kernels
        with tuning.use("gluon"), wu.record_keys() as forced:
            wu.warmup_prefill(quant=quant, sparsity=sparsity, **kw)
        assert forced == keys
