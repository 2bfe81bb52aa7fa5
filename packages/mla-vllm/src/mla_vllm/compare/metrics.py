"""What ``mla-compare`` measures, from top-k prompt logprobs: KL, top-1, perplexity, greedy.

Pure torch (float64), no vLLM: every function takes the arrays an engine returned.
For N next-token positions and top-k size k:

- ``ids [N, k]`` (int64) and ``logprobs [N, k]`` (natural log): each position's k most
  likely tokens, best first; ``target [N]``: the logprob of the token that came next.

KL from top-k (``kl_topk``): the true KL(P || Q) of the native next-token distribution
P against the recipe's Q needs the whole vocabulary; an engine returns k entries.
Both distributions are coarse-grained onto the same partition: each token in both
top-k lists is its own bucket (its P and Q are both known), and everything else is
one remainder bucket, ``P(rest) = 1 - Σ P(bucket)`` and likewise for Q. The KL of
those coarse distributions is computed exactly. By the data-processing inequality it
is a lower bound of the full KL, equal to it when the top-k lists hold (nearly) all
the mass or when P and Q agree in proportion inside the remainder; ``rest_mass``
reports P(rest), the native mass whose detail is lost. Float noise (k probabilities summing
above 1) is handled by clamping each remainder at 0 and each KL at 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "TopK",
    "expected_acceptance",
    "first_divergence",
    "kl_topk",
    "perplexity",
    "summarize",
]

_FLOOR = 1e-30  # a remainder of exactly 0 on one side only: log of the floor, not of 0
_CHUNK = 4096  # positions per [n, k, k] comparison (k = 20: 13 MB of float64)


@dataclass(frozen=True)
class TopK:
    """One engine's teacher-forced prompt logprobs over N positions.

    Attributes:
        ids: ``[N, k]`` int64, each position's top-k token ids, most likely first.
        logprobs: ``[N, k]`` float64 natural-log probabilities of ``ids``.
        target: ``[N]`` float64 logprob of the token that actually came next.
    """

    ids: torch.Tensor
    logprobs: torch.Tensor
    target: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dim() != 2 or self.ids.shape != self.logprobs.shape:
            raise ValueError(
                f"ids: expected [N, k] like logprobs, got {tuple(self.ids.shape)} and "
                f"{tuple(self.logprobs.shape)}"
            )
        if self.target.shape != self.ids.shape[:1]:
            raise ValueError(
                f"target: expected [{self.ids.shape[0]}], got {tuple(self.target.shape)}"
            )

    @classmethod
    def from_lists(
        cls,
        ids: Sequence[Sequence[int]],
        logprobs: Sequence[Sequence[float]],
        target: Sequence[float],
    ) -> TopK:
        """From JSON lists (what the engine process writes)."""
        k = len(ids[0]) if ids else 0
        return cls(
            torch.tensor(ids, dtype=torch.int64).reshape(-1, k),
            torch.tensor(logprobs, dtype=torch.float64).reshape(-1, k),
            torch.tensor(target, dtype=torch.float64).reshape(-1),
        )

    @classmethod
    def cat(cls, parts: Sequence[TopK]) -> TopK:
        """Positions of several prompts, concatenated."""
        if not parts:
            raise ValueError("parts: expected at least one TopK")
        return cls(
            torch.cat([p.ids for p in parts]),
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.target for p in parts]),
        )


def _chunked(
    func: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ref: TopK,
    test: TopK,
) -> torch.Tensor:
    """``func(ref_ids, ref_logprobs, test_ids, test_logprobs)`` over ``_CHUNK`` positions
    at a time (bounds the ``[n, k, k]`` match), concatenated: ``[N, ...]``."""
    if ref.ids.shape[0] != test.ids.shape[0]:
        raise ValueError(
            f"test: {test.ids.shape[0]} positions, the reference has {ref.ids.shape[0]}"
        )
    parts = [
        func(ref.ids[i : i + _CHUNK], ref.logprobs[i : i + _CHUNK],
             test.ids[i : i + _CHUNK], test.logprobs[i : i + _CHUNK])
        for i in range(0, ref.ids.shape[0], _CHUNK)
    ]  # fmt: skip
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(parts)


def _shared(
    ref_ids: torch.Tensor, ref_lp: torch.Tensor, test_ids: torch.Tensor, test_lp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Over the reference's top-k entries ``[n, k]``: which the test also listed, and P
    and Q of those (0 where not shared)."""
    p = ref_lp.double().exp()  # [n, k]
    q_all = test_lp.double().exp()  # [n, k']
    match = ref_ids[:, :, None] == test_ids[:, None, :]  # [n, k, k']
    shared = match.any(dim=-1)  # ref's entries that the test also listed
    q = (match.double() * q_all[:, None, :]).sum(dim=-1)  # Q of ref's entries (0 if absent)
    zero = torch.zeros_like(p)
    return shared, torch.where(shared, p, zero), torch.where(shared, q, zero)


def kl_topk(ref: TopK, test: TopK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position KL(P_ref || Q_test) from top-k lists, and the remainder's P(rest).

    P(rest) is the native mass outside the shared buckets (outside either top-k list).

    Returns two ``[N]`` float64 tensors (nats, and a probability). See the module
    docstring for the approximation (a lower bound, exact when k covers the mass).
    """
    both = _chunked(_kl_chunk, ref, test)
    if both.numel() == 0:
        return both, both.clone()
    return both[:, 0].contiguous(), both[:, 1].contiguous()


def expected_acceptance(ref: TopK, test: TopK) -> torch.Tensor:
    """Per-position ``Σ min(P(t), Q(t))`` over the tokens both top-k lists hold: ``[N]``.

    The probability that a token drawn from one distribution is accepted by speculative
    sampling against the other (1 for identical distributions given the whole
    vocabulary). From top-k lists it is a lower bound: mass outside the shared tokens
    is not counted (at most ``min(P(rest), Q(rest))`` more).
    """
    return _chunked(_acceptance_chunk, ref, test)


def _acceptance_chunk(
    ref_ids: torch.Tensor, ref_lp: torch.Tensor, test_ids: torch.Tensor, test_lp: torch.Tensor
) -> torch.Tensor:
    _, p_in, q_in = _shared(ref_ids, ref_lp, test_ids, test_lp)
    return torch.minimum(p_in, q_in).sum(dim=-1)


def _kl_chunk(
    ref_ids: torch.Tensor, ref_lp: torch.Tensor, test_ids: torch.Tensor, test_lp: torch.Tensor
) -> torch.Tensor:
    """``kl_topk`` on at most ``_CHUNK`` positions: ``[n, 2]`` (KL, P(rest))."""
    shared, p_in, q_in = _shared(ref_ids, ref_lp, test_ids, test_lp)
    terms = torch.where(
        shared, p_in * (p_in.clamp_min(_FLOOR).log() - q_in.clamp_min(_FLOOR).log()), 0.0
    )
    p_rest = (1.0 - p_in.sum(dim=-1)).clamp_min(0.0)
    q_rest = (1.0 - q_in.sum(dim=-1)).clamp_min(0.0)
    rest = torch.where(
        p_rest > 0.0,
        p_rest * (p_rest.clamp_min(_FLOOR).log() - q_rest.clamp_min(_FLOOR).log()),
        0.0,
    )
    kl = (terms.sum(dim=-1) + rest).clamp_min(0.0)
    return torch.stack([kl, p_rest], dim=-1)


def perplexity(target: torch.Tensor) -> float:
    """``exp(-mean log p(next token))`` over all positions (token-weighted)."""
    if target.numel() == 0:
        raise ValueError("target: no positions")
    return float((-target.double().mean()).exp())


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two greedy generations share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def summarize(ref: TopK, test: TopK, *, tie_margin: float = 0.0) -> dict[str, float]:
    """KL mean/p99/max, remainder mass, top-1 agreement and perplexities of ``test``.

    ``top1_agreement_decisive`` counts only positions where the reference's top-2
    logprob margin exceeds ``tie_margin`` nats (near ties flip on float noise).
    """
    if tie_margin < 0.0:
        raise ValueError(f"tie_margin: expected >= 0, got {tie_margin}")
    kl, rest = kl_topk(ref, test)
    agree = ref.ids[:, 0] == test.ids[:, 0]
    if ref.ids.shape[1] >= 2:
        decisive = (ref.logprobs[:, 0] - ref.logprobs[:, 1]) > tie_margin
    else:
        decisive = torch.ones_like(agree)
    ppl_ref, ppl = perplexity(ref.target), perplexity(test.target)
    n_decisive = int(decisive.sum())
    return {
        "positions": float(kl.numel()),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
        "kl_max": float(kl.max()),
        "rest_mass_mean": float(rest.mean()),
        "top1_agreement": float(agree.double().mean()),
        "top1_agreement_decisive": (
            float(agree[decisive].double().mean()) if n_decisive else float("nan")
        ),
        "decisive_positions": float(n_decisive),
        "ppl": ppl,
        "ppl_native": ppl_ref,
        "ppl_delta": ppl - ppl_ref,
        "ppl_ratio": ppl / ppl_ref,
    }
