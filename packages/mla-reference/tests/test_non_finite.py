"""The NaN/inf rule (docs/numerics.md "Non-finite input"): poisoning by row, exactly.

Every case puts one NaN, +inf or -inf into one operand and checks exactly which rows
of out and LSE are NaN, against masks written here from the rule; the other rows must
equal a run with that element finite (the oracle zeroes what a row does not see, so
they are bit-identical here; kernels need only keep them finite).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_decode import paged
from test_prefill import packed, visible_mask

from mla_formats import AttentionQuant, NMSparsity
from mla_reference import decode, prefill

BAD = [math.nan, math.inf, -math.inf]
FORMATS = ["none", "fp8", "nvfp4"]
SCALE = 0.125


def recipe(fmt: str) -> AttentionQuant:
    return AttentionQuant.uniform(fmt)


def assert_nan_exactly(got: torch.Tensor, want: torch.Tensor, clean: torch.Tensor) -> None:
    """``got`` is NaN where ``want`` says (every feature of a poisoned row) and equal to
    ``clean`` elsewhere; ``want`` broadcasts against ``got``."""
    want = want.expand(got.shape)
    assert torch.equal(got.isnan(), want)
    assert not bool(clean[~want].isnan().any())
    assert torch.equal(got[~want], clean[~want])


# ----------------------------------------------------------------------------- prefill

LENS_Q, LENS_K = [5, 20], [9, 40]  # sequence 1: queries at key positions 20..39
HEADS, KV_HEADS, DIM, DIM_V = 4, 2, 32, 16  # heads 0, 1 read kv head 0; 2, 3 kv head 1


def prefill_inputs() -> tuple[torch.Tensor, ...]:
    return packed(LENS_Q, LENS_K, HEADS, KV_HEADS, DIM, DIM_V, dtype=torch.float32, seed=4)


def run_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    fmt: str,
    causal: bool,
    sparsity: NMSparsity | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return prefill(
        q,
        k,
        v,
        cu_q,
        cu_k,
        softmax_scale=SCALE,
        causal=causal,
        quant=recipe(fmt),
        sparsity=sparsity,
        return_lse=True,
        out_dtype=torch.float64,
    )


def rows_seeing(keys: range, causal: bool, kv_head: int) -> torch.Tensor:
    """bool [T, H]: rows of sequence 1 in kv head ``kv_head``'s query heads that see one of
    ``keys`` (positions in sequence 1)."""
    mask = torch.zeros(sum(LENS_Q), HEADS, dtype=torch.bool)
    visible = visible_mask(LENS_Q[1], LENS_K[1], causal)  # [Lq, Lk]
    sees = visible[:, list(keys)].any(dim=1)
    group = HEADS // KV_HEADS
    for h in range(kv_head * group, (kv_head + 1) * group):
        mask[LENS_Q[0] :, h] = sees
    return mask


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("operand", ["q", "k", "v"])
def test_prefill_one_bad_element_poisons_exactly_the_rows_that_read_it(
    operand: str, bad: float, fmt: str, causal: bool
) -> None:
    q, k, v, cu_q, cu_k = prefill_inputs()
    out_c, lse_c = run_prefill(q, k, v, cu_q, cu_k, fmt, causal)
    want = torch.zeros(sum(LENS_Q), HEADS, dtype=torch.bool)
    if operand == "q":  # token 7 (sequence 1), head 2: that row, out and LSE
        q[7, 2, 30] = bad
        want[7, 2] = True
        want_lse = want
    elif operand == "k":  # sequence 1's key 27, kv head 1: causal rows with q_pos >= 27
        k[LENS_K[0] + 27, 1, 3] = bad
        want = rows_seeing(range(27, 28), causal, kv_head=1)
        assert not causal or not bool(want[LENS_Q[0] :, 2:].all())
        want_lse = want
    else:  # key 37, kv head 0; nvfp4 V is blocked along the keys: v̂ of keys 32..39 is NaN
        v[LENS_K[0] + 37, 0, 5] = bad
        keys = range(32, 40) if fmt == "nvfp4" else range(37, 38)
        want = rows_seeing(keys, causal, kv_head=0)
        want_lse = torch.zeros_like(want)  # V never reaches the LSE
    out, lse = run_prefill(q, k, v, cu_q, cu_k, fmt, causal)
    assert_nan_exactly(out, want.unsqueeze(-1), out_c)
    assert_nan_exactly(lse, want_lse.T, lse_c)


@pytest.mark.parametrize("operand", ["k", "v"])
@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_prefill_a_key_nm_drops_still_poisons(operand: str, fmt: str) -> None:
    """N:M does not change "sees": rows that dropped the key are poisoned too."""
    q, k, v, cu_q, cu_k = prefill_inputs()
    sparsity = NMSparsity(2, 4)
    debug: dict[str, object] = {}
    prefill(
        q, k, v, cu_q, cu_k, softmax_scale=SCALE, quant=recipe(fmt), sparsity=sparsity, debug=debug
    )
    keep = debug["keep"]
    assert isinstance(keep, list)
    key = 21
    dropped = ~keep[1][0, :, key] & visible_mask(LENS_Q[1], LENS_K[1], True)[:, key]
    assert bool(dropped.any())  # some rows of head 0 see key 21 and N:M dropped it
    target = k if operand == "k" else v
    target[LENS_K[0] + key, 0, 0] = math.nan
    out, lse = run_prefill(q, k, v, cu_q, cu_k, fmt, True, sparsity)
    keys = range(16, 32) if (operand == "v" and fmt == "nvfp4") else range(key, key + 1)
    want = rows_seeing(keys, True, kv_head=0)
    assert torch.equal(out.isnan(), want.unsqueeze(-1).expand(out.shape))
    assert torch.equal(lse.isnan(), want.T if operand == "k" else torch.zeros_like(want.T))


@pytest.mark.parametrize("fmt", FORMATS)
def test_prefill_keys_a_row_does_not_see_never_poison_it(fmt: str) -> None:
    """NaN in every operand element of the last key of sequence 1: only the last query sees
    it; sequence 0 shares no key with it."""
    q, k, v, cu_q, cu_k = prefill_inputs()
    out_c, lse_c = run_prefill(q, k, v, cu_q, cu_k, fmt, True)
    k[-1] = math.inf
    v[-1] = math.nan
    out, lse = run_prefill(q, k, v, cu_q, cu_k, fmt, True)
    want = torch.zeros(sum(LENS_Q), HEADS, dtype=torch.bool)
    want[-1] = True  # but nvfp4 V of keys 32..39 is NaN: rows from q_pos 32 read it
    if fmt == "nvfp4":
        want_out = rows_seeing(range(32, 40), True, 0) | rows_seeing(range(32, 40), True, 1)
    else:
        want_out = want
    assert_nan_exactly(out, want_out.unsqueeze(-1), out_c)
    assert_nan_exactly(lse, want.T, lse_c)


def test_prefill_row_without_keys_stays_zero_with_a_nan_query() -> None:
    q, k, v, cu_q, cu_k = packed([4], [2], 2, 1, 16, 16, seed=1)
    q[:] = math.nan  # queries 0 and 1 sit at key positions -2, -1: they see no key
    out, lse = prefill(q, k, v, cu_q, cu_k, softmax_scale=SCALE, return_lse=True)
    assert torch.equal(out[:2], torch.zeros(2, 2, 16, dtype=out.dtype))
    assert bool(lse[:, :2].isneginf().all())
    assert bool(out[2:].isnan().all()) and bool(lse[:, 2:].isnan().all())


# ----------------------------------------------------------------------------- decode

DECODE_LENS = [37, 20, 0]  # request 0's last page (16 tokens) is partly past seq_len


def decode_inputs(
    fmt_seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cache, table, lens = paged(DECODE_LENS, 16, dtype=torch.float32, seed=fmt_seed)
    q = torch.randn(len(DECODE_LENS), 4, 576, generator=torch.Generator().manual_seed(2))
    return q, cache, table, lens


def run_decode(
    q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return decode(
        q, cache, table, lens, softmax_scale=SCALE, quant=recipe(fmt), out_dtype=torch.float64
    )


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_bad_q_poisons_its_row_and_lse(bad: float, fmt: str) -> None:
    q, cache, table, lens = decode_inputs()
    out_c, lse_c = run_decode(q, cache, table, lens, fmt)
    q[1, 3, 100] = bad
    q[2, 0, 0] = bad  # request 2 has no token: out 0, LSE -inf whatever q holds
    out, lse = run_decode(q, cache, table, lens, fmt)
    want = torch.zeros(3, 4, dtype=torch.bool)
    want[1, 3] = True
    assert_nan_exactly(out, want.unsqueeze(-1), out_c)
    assert_nan_exactly(lse, want, lse_c)
    assert bool(lse[2].isneginf().all()) and not bool(out[2].any())


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("feature", [7, 540])  # in V's 512 features (K and V), rope (K only)
def test_decode_bad_latent_poisons_its_request(bad: float, fmt: str, feature: int) -> None:
    """A latent row is K (and, below 512, V) of every head of its request: all of that
    request's rows are NaN, out and LSE; rows of other requests are untouched."""
    q, cache, table, lens = decode_inputs()
    out_c, lse_c = run_decode(q, cache, table, lens, fmt)
    token = 13
    cache[int(table[1, token // 16]), token % 16, feature] = bad
    out, lse = run_decode(q, cache, table, lens, fmt)
    want = torch.zeros(3, 4, dtype=torch.bool)
    want[1] = True
    assert_nan_exactly(out, want.unsqueeze(-1), out_c)
    assert_nan_exactly(lse, want, lse_c)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_cache_rows_past_seq_len_never_poison(fmt: str) -> None:
    """Tokens 37..47 of request 0's last page and a spare page hold NaN and inf: nothing
    changes (the nvfp4 V tail block is zero-padded)."""
    q, cache, table, lens = decode_inputs()
    out_c, lse_c = run_decode(q, cache, table, lens, fmt)
    cache[int(table[0, 2]), 37 % 16 :] = math.nan
    cache[int(table[0, 2]), 40 % 16, :4] = math.inf
    used = set(table[0, :3].tolist()) | set(table[1, :2].tolist())
    spare = next(p for p in range(cache.shape[0]) if p not in used)
    cache[spare] = math.nan
    out, lse = run_decode(q, cache, table, lens, fmt)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
