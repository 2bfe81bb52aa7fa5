"""The Gluon sm90 prefill: every variant compiles for sm_90a (CPU), the launcher's
checks and TMA views (CPU), and the kernel against ``mla_reference`` (Hopper GPU only).

Compiling needs no GPU (Triton's ptxas is bundled); the numbers themselves come
from ``benchmarks/gluon_prefill.py`` and the GPU test below on an H200.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import triton

from mla_formats import AttentionQuant, NMSparsity
from mla_triton import gluon_prefill as gp

SMEM_LIMIT = 227 * 1024  # bytes of shared memory a block may use on sm90
_CUOBJDUMP = Path(str(triton.__file__)).parent / "backends/nvidia/bin/cuobjdump"

# (dtype, Dqk, Dv, config, causal, return_lse): the default tiling in each mode, fp16,
# head dims 128/64, and the other tilings the benchmark sweeps.
DEFAULT = gp.GluonPrefillConfig()
VARIANTS = [
    (torch.bfloat16, 192, 128, DEFAULT, True, True),
    (torch.bfloat16, 192, 128, DEFAULT, True, False),
    (torch.bfloat16, 192, 128, DEFAULT, False, True),
    (torch.float16, 192, 128, DEFAULT, False, False),
    (torch.bfloat16, 128, 64, DEFAULT, True, True),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(128, 64, 2), True, True),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(128, 128, 2), True, True),
    (torch.bfloat16, 192, 128, gp.GluonPrefillConfig(64, 64, 3), True, True),
]


def _resources(cubin: bytes) -> dict[str, int]:
    """``cuobjdump --dump-resource-usage`` of a cubin: REG, STACK, LOCAL, ..."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(_CUOBJDUMP), "--dump-resource-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", text.splitlines()[-1])}


@pytest.mark.parametrize(
    ("dtype", "dim", "dim_v", "config", "causal", "lse"),
    VARIANTS,
    ids=[str(i) for i in range(len(VARIANTS))],
)
def test_compiles_for_sm90a(
    dtype: torch.dtype, dim: int, dim_v: int, config: Any, causal: bool, lse: bool
) -> None:
    kernel: Any = gp.compile_sm90(dtype, dim, dim_v, config, causal=causal, return_lse=lse)
    ptx: str = kernel.asm["ptx"]
    assert ".target sm_90a" in ptx
    # wgmma: Q K^T over Dqk / 16 k-steps and P V over block_n / 16, per 64-row warpgroup
    n_wgmma = ptx.count("wgmma.mma_async")
    assert n_wgmma >= dim // 16 + config.block_n // 16
    assert "cp.async.bulk.tensor.2d" in ptx  # TMA loads
    assert "mbarrier.try_wait" in ptx
    assert 0 < kernel.metadata.shared <= SMEM_LIMIT
    assert ("st.global.b32" in ptx or "st.global.f32" in ptx) == lse  # LSE stores only if asked
    usage = _resources(kernel.asm["cubin"])
    assert usage["REG"] <= 255
    if config == DEFAULT:
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0  # no spills at the default tiling


def _qkv(dim: int = 192, dim_v: int = 128, dtype: torch.dtype = torch.bfloat16) -> Any:
    q = torch.zeros(8, 4, dim, dtype=dtype)
    v = torch.zeros(8, 4, dim_v, dtype=dtype)
    return q, v


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"quant": AttentionQuant.uniform("fp8")}, "quant"),
        ({"quant": AttentionQuant(p="nvfp4")}, "quant"),
        ({"sparsity": NMSparsity(2, 4)}, "sparsity"),
        ({"dtype": torch.float32}, "q"),
        ({"dim": 160}, "q"),
        ({"dim": 320}, "q"),
        ({"dim_v": 96}, "v"),
        ({}, "q"),  # a CPU tensor: not a Hopper GPU
    ],
)
def test_unsupported_names_the_argument(kwargs: dict[str, Any], name: str) -> None:
    shape = {k: kwargs.pop(k) for k in ("dim", "dim_v", "dtype") if k in kwargs}
    q, v = _qkv(**shape)
    reason = gp.unsupported(q, v, kwargs.get("quant"), kwargs.get("sparsity"))
    assert reason is not None and reason.startswith(f"{name}: ")
    with pytest.raises(ValueError, match=f"^{name}: "):
        gp.launch(
            q, q, v, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
            softmax_scale=1.0, causal=True, return_lse=False, out=v, lse=v,
            max_seqlen_q=8, **kwargs,
        )  # fmt: skip


def test_recipe_none_is_not_refused_for_its_quant() -> None:
    q, v = _qkv()
    reason = gp.unsupported(q, v, AttentionQuant(), None)
    assert reason is not None and "Hopper" in reason  # only the device is wrong on CPU


@pytest.mark.parametrize(("field", "value"), [("block_m", 32), ("block_n", 256), ("num_stages", 0)])
def test_config_rejects(field: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"config.{field}"):
        gp.GluonPrefillConfig(**{field: value})


def test_descriptor_views_a_strided_tensor() -> None:
    """V as a slice of a wider tensor (vLLM's kv split): the 2-d view keeps its strides."""
    wide = torch.zeros(10, 3, 256, dtype=torch.bfloat16)
    v = wide[:, :, 128:]
    desc: Any = gp._descriptor(gp._tma_ready(v), [64, 128])
    assert desc.base.data_ptr() == v.data_ptr()
    assert list(desc.shape) == [10, 2 * 256 + 128] and list(desc.strides) == [3 * 256, 1]
    # element (t, h, d) sits at row t, column h * stride_h + d of the view
    t, h, d = 7, 2, 5
    flat = desc.base.as_strided((10, desc.shape[1]), (3 * 256, 1))
    v[t, h, d] = 3.0
    assert float(flat[t, h * 256 + d]) == 3.0


def test_tma_ready_copies_an_unaligned_token_stride() -> None:
    wide = torch.zeros(10, 1, 200, dtype=torch.bfloat16)[:, :, :196]  # 400-byte rows: ok
    assert gp._tma_ready(wide) is wide
    odd = torch.zeros(10, 1, 196 + 4, dtype=torch.bfloat16).view(-1)[4:].as_strided(
        (9, 1, 192), (196, 196, 1)
    )  # fmt: skip
    ready = gp._tma_ready(odd)  # 392-byte rows (not a multiple of 16) and an offset base
    assert ready is not odd and ready.is_contiguous() and torch.equal(ready, odd)


def _hopper() -> bool:
    return (
        torch.cuda.is_available()
        and os.environ.get("TRITON_INTERPRET") != "1"
        and torch.cuda.get_device_capability()[0] == 9
    )


@pytest.mark.skipif(not _hopper(), reason="needs a Hopper (sm90) CUDA GPU")
@pytest.mark.parametrize("causal", [True, False])
def test_matches_the_oracle_on_a_gpu(causal: bool) -> None:
    import mla_reference

    lens_q, lens_k = [1, 17, 128, 300], [1, 40, 128, 300]
    gen = torch.Generator(device="cuda").manual_seed(0)
    t, tk, heads = sum(lens_q), sum(lens_k), 8
    q = torch.randn(t, heads, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(tk, 2, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(tk, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], device="cuda").int()
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], device="cuda").int()
    out = torch.empty(t, heads, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(heads, t, device="cuda")
    gp.launch(q, k, v, cu_q, cu_k, softmax_scale=192**-0.5, causal=causal, return_lse=True,
              out=out, lse=lse, max_seqlen_q=max(lens_q))  # fmt: skip
    ref, ref_lse = mla_reference.prefill(
        q, k, v, cu_q, cu_k, softmax_scale=192**-0.5, causal=causal, return_lse=True,
        compute_dtype=torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=1e-4)
