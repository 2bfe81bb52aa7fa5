"""The MLA identity across packages: prefill on the up-projected form equals decode on
the absorbed form (quant none).

With latent rows ``kv_c [L, 512]`` and rope keys ``k_pe [L, 64]``, head ``h`` sees
``k = [kv_c W_UK[h], k_pe]`` and ``v = kv_c W_UV[h]``. Absorbing ``W_UK`` into the
query, ``q_abs = [W_UK[h] q_nope, q_pe]`` scores the latent rows ``[kv_c, k_pe]``
identically, and ``(P kv_c) W_UV[h] = P v``. So ``mla_triton.decode`` over the
paged latent cache, up-projected by ``W_UV`` afterwards, must give
``mla_triton.prefill``'s output and LSE for the same query positions.

Values are small dyadic integers, so both forms' fp16 inputs are exact and the
scores agree to float32 rounding; what remains is P's and the output's fp16
rounding (decode rounds its 512-wide output before the up-projection).
"""

from __future__ import annotations

import torch

from mla_triton import decode, prefill

KV_LORA_RANK, ROPE, NOPE, DV, HEADS, PAGE = 512, 64, 128, 128, 4, 16


def _ternary(g: torch.Generator, *shape: int, density: float = 0.1) -> torch.Tensor:
    """Sparse {-1, 0, 1} entries: products and sums stay exact small integers."""
    sign = torch.randint(0, 2, shape, generator=g).float() * 2 - 1
    return sign * (torch.rand(shape, generator=g) < density).float()


def test_prefill_up_projected_equals_decode_absorbed() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = [37, 70]
    total = sum(lengths)
    kv_c = _ternary(g, total, KV_LORA_RANK)
    k_pe = _ternary(g, total, ROPE, density=0.3)
    w_uk = _ternary(g, HEADS, KV_LORA_RANK, NOPE, density=0.05)
    w_uv = _ternary(g, HEADS, KV_LORA_RANK, DV, density=0.05)
    q_nope = _ternary(g, total, HEADS, NOPE, density=0.3) * 0.5
    q_pe = _ternary(g, total, HEADS, ROPE, density=0.3) * 0.5
    scale = (NOPE + ROPE) ** -0.5

    # prefill: every token of each sequence is a query (causal), up-projected K and V
    k_nope = torch.einsum("tr,hrd->thd", kv_c, w_uk)
    q = torch.cat([q_nope, q_pe], dim=-1).half()
    k = torch.cat([k_nope, k_pe[:, None, :].expand(total, HEADS, ROPE)], dim=-1).half()
    v = torch.einsum("tr,hrd->thd", kv_c, w_uv).half()
    cu = torch.tensor([0, lengths[0], total], dtype=torch.int32)
    out_p, lse_p = prefill(q, k, v, cu, cu, softmax_scale=scale, causal=True, return_lse=True)

    # decode: one request per chosen query position, over a shuffled paged cache
    positions = [(0, 0), (0, 15), (0, 16), (0, 36), (1, 5), (1, 33), (1, 69)]
    pages = [-(-n // PAGE) for n in lengths]
    num_blocks = sum(pages) + 3
    order = torch.randperm(num_blocks, generator=g)[: sum(pages)].tolist()
    cache = torch.zeros(num_blocks, PAGE, KV_LORA_RANK + ROPE, dtype=torch.float16)
    tables: list[list[int]] = []
    start = 0
    for seq, n in enumerate(lengths):
        blocks = order[sum(pages[:seq]) : sum(pages[: seq + 1])]
        tables.append(blocks)
        latent = torch.cat([kv_c[start : start + n], k_pe[start : start + n]], dim=-1)
        for t in range(n):
            cache[blocks[t // PAGE], t % PAGE] = latent[t].half()
        start += n
    width = max(pages)
    block_table = torch.tensor(
        [tables[s] + [0] * (width - len(tables[s])) for s, _ in positions], dtype=torch.int32
    )
    seq_lens = torch.tensor([t + 1 for _, t in positions], dtype=torch.int32)
    token = [sum(lengths[:s]) + t for s, t in positions]
    q_abs = torch.cat(
        [torch.einsum("bhd,hrd->bhr", q_nope[token], w_uk), q_pe[token]], dim=-1
    ).half()
    out_d, lse_d = decode(
        q_abs, cache, block_table, seq_lens, softmax_scale=scale, kv_lora_rank=KV_LORA_RANK
    )
    assert out_d.shape == (len(positions), HEADS, KV_LORA_RANK)
    out_d_up = torch.einsum("bhr,hrd->bhd", out_d.double(), w_uv.double())

    want = out_p[token].double()
    err = (out_d_up - want).abs().max().item()
    assert err <= 1e-3 * want.abs().max().item(), err  # measured 4e-4 (fp16 rounding)
    assert torch.allclose(lse_d.float(), lse_p[:, token].t(), atol=1e-5, rtol=1e-5)
