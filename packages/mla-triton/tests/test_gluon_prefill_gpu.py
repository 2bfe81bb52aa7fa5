"""The Gluon sm90 prefill on a GPU (a GPU suite: skipped without an sm90 GPU, a failure
under ``MLA_REQUIRE_GPU=1``): causal and not, ragged lengths and GQA, against
``mla_reference.prefill``. The CPU part (compiles, dispatch, launch arguments):
test_gluon_prefill.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from calls import prefill  # mla_triton.prefill, with ``impl``/``config`` forced (tuning.use)


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
    out, lse = prefill(q, k, v, cu_q, cu_k, softmax_scale=192**-0.5, causal=causal,
                       return_lse=True, impl="gluon")  # fmt: skip
    ref, ref_lse = mla_reference.prefill(
        q, k, v, cu_q, cu_k, softmax_scale=192**-0.5, causal=causal, return_lse=True,
        compute_dtype=torch.float32,
    )  # fmt: skip
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse.float(), atol=1e-3, rtol=1e-4)
