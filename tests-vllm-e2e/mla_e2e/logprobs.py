"""Logprob differences of two runs on the same prompts, and how the report says them."""

from __future__ import annotations

import math
from typing import Any


def max_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], tol: float = 0.0) -> dict[str, Any]:
    """Prompt and generated logprob differences of two runs on the same prompts.

    Generated logprobs are compared up to each prompt's first token divergence; a
    divergence is a near tie when ``a``'s top-2 margin there is within ``2 * tol``.
    """
    prompt_max = prompt_sum = gen_max = 0.0
    prompt_n = 0
    divergences: list[dict[str, Any]] = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for p, q in zip(x["prompt_logprobs"], y["prompt_logprobs"], strict=True):
            if p is not None and q is not None:
                prompt_max = max(prompt_max, abs(p - q))
                prompt_sum += abs(p - q)
                prompt_n += 1
        for step, (t, u) in enumerate(zip(x["tokens"], y["tokens"], strict=True)):
            if t != u:
                top = x.get("top2", [])
                margin = (
                    top[step][0][1] - top[step][1][1]
                    if step < len(top) and len(top[step]) > 1
                    else math.inf
                )
                divergences.append({"prompt": i, "step": step, "margin": margin})
                break
            gen_max = max(gen_max, abs(x["logprobs"][step] - y["logprobs"][step]))
    near_ties = all(d["margin"] <= 2 * tol for d in divergences)
    return {
        "prompt_max": prompt_max,
        "prompt_mean": prompt_sum / max(1, prompt_n),
        "gen_max": gen_max,
        "same_tokens": not divergences,
        "divergences": divergences,
        "divergences_near_ties": near_ties,
    }


def describe_diff(d: dict[str, Any], who: str = "native") -> str:
    """The report's words for ``max_diff``'s ``d``; ``who``: whose top-2 margin."""
    tokens = (
        "identical"
        if d["same_tokens"]
        else "diverge at "
        + ", ".join(
            f"prompt {v['prompt']} step {v['step']} ({who} top-2 margin {v['margin']:.4f})"
            for v in d["divergences"]
        )
    )
    return (
        f"max |Δ prompt logprob| {d['prompt_max']:.4f} (mean {d['prompt_mean']:.5f}), "
        f"max |Δ generated logprob| {d['gen_max']:.4f}, greedy tokens {tokens}"
    )
