"""LSE merge of chunked prefill: two non-causal context chunks plus the causal
new-token pass, merged by their LSEs, equal one causal pass over all keys.

This is how vLLM's chunked-context prefill uses ``mla_triton.prefill`` (``causal=
False`` over each context chunk, ``causal=True`` over the new tokens, then
``merge_attn_states``). Chunk boundaries sit at multiples of 16 keys, so V's and
P's nvfp4 blocks coincide with the single pass's; each pass has its own
power-of-two reference point, under which QDQ commutes (docs/numerics.md
"Softmax, P and schedule invariance"), so the
quantized merge agrees up to the same rare P-code flips the oracle tests allow.
"""

from __future__ import annotations

import pytest
import torch

from mla_formats import AttentionQuant
from mla_triton import prefill


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``out = sum_i exp(lse_i - lse) out_i`` with ``lse = logsumexp_i lse_i``."""
    lses = torch.stack([lse for _, lse in parts])  # [parts, H, T]
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    out = sum(torch.exp(l_i - safe).t()[:, :, None] * o_i.double() for o_i, l_i in parts)
    assert isinstance(out, torch.Tensor)
    return out, lse


def _cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("quant", [None, AttentionQuant.uniform("nvfp4")], ids=["none", "nvfp4"])
def test_two_context_chunks_plus_new_tokens_equal_one_pass(quant: AttentionQuant | None) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, dim_v = 4, 2, 64, 32
    new = [24, 9, 1]  # new tokens (queries) per sequence
    chunk1 = [32, 32, 16]  # context chunks, multiples of 16 keys
    chunk2 = [32, 0, 48]  # the second sequence has no second chunk
    seqs = []
    for n, c1, c2 in zip(new, chunk1, chunk2, strict=True):
        length = c1 + c2 + n
        seqs.append(
            (
                torch.randn(n, heads, dim, generator=g),
                torch.randn(length, kv_heads, dim, generator=g),
                torch.randn(length, kv_heads, dim_v, generator=g),
            )
        )
    scale = 2.0 / dim**0.5
    q = torch.cat([s[0] for s in seqs])
    cu_q = _cu(new)

    def run(pieces: list[slice], causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.cat([s[1][p] for s, p in zip(seqs, pieces, strict=True)])
        v = torch.cat([s[2][p] for s, p in zip(seqs, pieces, strict=True)])
        cu_k = _cu([s[1][p].shape[0] for s, p in zip(seqs, pieces, strict=True)])
        return prefill(
            q, k, v, cu_q, cu_k, softmax_scale=scale, causal=causal, quant=quant, return_lse=True
        )

    full = run([slice(None)] * 3, causal=True)
    ctx1 = run([slice(0, c) for c in chunk1], causal=False)
    ctx2 = run([slice(c1, c1 + c2) for c1, c2 in zip(chunk1, chunk2, strict=True)], causal=False)
    fresh = run([slice(c1 + c2, None) for c1, c2 in zip(chunk1, chunk2, strict=True)], causal=True)
    assert bool(torch.isneginf(ctx2[1][:, 24:33]).all())  # the empty chunk: lse -inf
    assert bool((ctx2[0][24:33] == 0).all())

    out, lse = _merge([ctx1, ctx2, fresh])
    assert torch.allclose(lse.float(), full[1], atol=1e-5, rtol=1e-5)
    err = (out - full[0].double()).abs()
    tight = 1e-5 * full[0].abs().max().item()
    if quant is None:
        assert err.max().item() <= tight
    else:  # a P code may flip where a value sits at a rounding midpoint
        assert (err > tight).double().mean().item() <= 0.005
        assert err.max().item() <= 0.35 * full[0].abs().max().item()
