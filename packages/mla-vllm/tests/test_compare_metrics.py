"""mla-compare's maths against direct computations on full distributions."""

from __future__ import annotations

import math

import pytest
import torch

from mla_vllm.compare.metrics import TopK, first_divergence, kl_topk, perplexity, summarize

VOCAB = 50


def _topk(logits: torch.Tensor, k: int, target: torch.Tensor) -> TopK:
    """What an engine returns: the top-k of each row's log-softmax and the target's logprob."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    values, ids = lp.topk(k, dim=-1)
    return TopK(ids, values, lp.gather(-1, target[:, None])[:, 0])


def _coarse_kl(p: torch.Tensor, q: torch.Tensor, p_ids: list[int], q_ids: list[int]) -> float:
    """The partition KL written out: shared tokens one bucket each, the rest one bucket."""
    shared = [t for t in p_ids if t in q_ids]
    kl = sum(float(p[t] * (p[t].log() - q[t].log())) for t in shared)
    p_rest = 1.0 - sum(float(p[t]) for t in shared)
    q_rest = 1.0 - sum(float(q[t]) for t in shared)
    return kl + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0)


@pytest.fixture
def pair() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ref = torch.randn(64, VOCAB, generator=gen, dtype=torch.float64) * 2.0
    test = ref + 0.3 * torch.randn(64, VOCAB, generator=gen, dtype=torch.float64)
    target = torch.randint(0, VOCAB, (64,), generator=gen)
    return ref, test, target


def test_full_vocabulary_topk_is_the_exact_kl(pair: tuple[torch.Tensor, ...]) -> None:
    ref, test, target = pair
    p = torch.softmax(ref, -1)
    exact = (p * (torch.log_softmax(ref, -1) - torch.log_softmax(test, -1))).sum(-1)
    kl, rest = kl_topk(_topk(ref, VOCAB, target), _topk(test, VOCAB, target))
    torch.testing.assert_close(kl, exact, rtol=1e-9, atol=1e-12)
    assert float(rest.max()) < 1e-12


@pytest.mark.parametrize("k", [2, 5, 20])
def test_topk_kl_is_the_partition_kl_and_a_lower_bound(
    pair: tuple[torch.Tensor, ...], k: int
) -> None:
    ref, test, target = pair
    r, t = _topk(ref, k, target), _topk(test, k, target)
    kl, rest = kl_topk(r, t)
    p, q = torch.softmax(ref, -1), torch.softmax(test, -1)
    exact = (p * (p.log() - q.log())).sum(-1)
    for n in range(ref.shape[0]):
        want = _coarse_kl(p[n], q[n], r.ids[n].tolist(), t.ids[n].tolist())
        assert float(kl[n]) == pytest.approx(want, rel=1e-9, abs=1e-12)
        shared = [x for x in r.ids[n].tolist() if x in t.ids[n].tolist()]
        assert float(rest[n]) == pytest.approx(1.0 - float(p[n, shared].sum()), abs=1e-12)
    assert bool((kl <= exact + 1e-12).all())
    assert float(kl.mean()) > 0.0


def test_identical_engines_give_zero_and_full_agreement(pair: tuple[torch.Tensor, ...]) -> None:
    ref, _, target = pair
    a = _topk(ref, 8, target)
    summary = summarize(a, a)
    assert summary["kl_mean"] == 0.0 and summary["kl_max"] == 0.0
    assert summary["top1_agreement"] == 1.0 and summary["ppl_delta"] == 0.0
    # a float-noise sum above 1 (k entries) clamps the remainder at 0 instead of NaN
    noisy = TopK(a.ids, a.logprobs + 1e-9, a.target)
    kl, _ = kl_topk(noisy, noisy)
    assert bool(torch.isfinite(kl).all()) and float(kl.max()) == 0.0


def test_summary_values(pair: tuple[torch.Tensor, ...]) -> None:
    ref, test, target = pair
    r, t = _topk(ref, 4, target), _topk(test, 4, target)
    s = summarize(r, t, tie_margin=0.1)
    kl, _ = kl_topk(r, t)
    assert s["kl_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)))
    want_top1 = float((ref.argmax(-1) == test.argmax(-1)).double().mean())
    assert s["top1_agreement"] == pytest.approx(want_top1)
    lp = torch.log_softmax(ref, -1)
    assert s["ppl_native"] == pytest.approx(math.exp(-float(lp.gather(-1, target[:, None]).mean())))
    top2 = lp.topk(2, -1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 0.1
    assert s["decisive_positions"] == float(decisive.sum())
    agree = ref.argmax(-1) == test.argmax(-1)
    assert s["top1_agreement_decisive"] == pytest.approx(float(agree[decisive].double().mean()))
    assert s["ppl_ratio"] == pytest.approx(s["ppl"] / s["ppl_native"])


def test_perplexity_greedy_and_bad_input() -> None:
    assert perplexity(torch.tensor([math.log(0.5), math.log(0.25)])) == pytest.approx(
        math.sqrt(8.0)
    )
    assert first_divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert first_divergence([1, 2], [1, 2]) == 2
    with pytest.raises(ValueError, match="target: no positions"):
        perplexity(torch.zeros(0))
    with pytest.raises(ValueError, match=r"ids: expected \[N, k\]"):
        TopK(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 3), torch.zeros(3))
    a = TopK(torch.zeros(3, 2, dtype=torch.int64), torch.zeros(3, 2), torch.zeros(3))
    b = TopK(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(ValueError, match="test: 2 positions"):
        kl_topk(a, b)
    with pytest.raises(ValueError, match="tie_margin"):
        summarize(a, a, tie_margin=-1.0)


def test_chunks_give_the_same_kl(
    pair: tuple[torch.Tensor, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    from mla_vllm.compare import metrics

    ref, test, target = pair
    r, t = _topk(ref, 6, target), _topk(test, 6, target)
    whole = kl_topk(r, t)
    monkeypatch.setattr(metrics, "_CHUNK", 5)  # 64 positions: 13 chunks, the last short
    chunked = kl_topk(r, t)
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=0)
    torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=0)
