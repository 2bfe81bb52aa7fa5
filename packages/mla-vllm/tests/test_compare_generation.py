"""Generation-fidelity and task statistics on hand-made distributions with known answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from mla_vllm.compare.generation import (
    Generated,
    bootstrap_mean,
    bucket_label,
    position_metrics,
    summarize_generation,
)
from mla_vllm.compare.metrics import TopK, expected_acceptance, kl_topk
from mla_vllm.compare.tasks import (
    TaskRuns,
    compare_runs,
    flips,
    load_lm_eval_samples,
    mcnemar_exact,
)


def _full(probs: list[list[float]], target: list[int]) -> TopK:
    """A TopK over the whole vocabulary (k = vocabulary): the bounds are exact."""
    p = torch.tensor(probs, dtype=torch.float64)
    lp, ids = p.log().sort(dim=-1, descending=True, stable=True)
    return TopK(ids, lp, p.log().gather(-1, torch.tensor(target)[:, None])[:, 0])


def test_identical_distributions() -> None:
    a = _full([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], [0, 2])
    m = position_metrics(a, a)
    assert m["kl"].tolist() == [0.0, 0.0]
    assert m["top1"].tolist() == [1.0, 1.0]
    assert m["dnll"].tolist() == [0.0, 0.0]
    assert m["acceptance"] == pytest.approx([1.0, 1.0], abs=1e-12)


def test_two_point_distributions() -> None:
    """P = (0.5, 0.5), Q = (0.9, 0.1): KL = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1)."""
    p = _full([[0.5, 0.5]], [1])
    q = _full([[0.9, 0.1]], [1])
    kl, rest = kl_topk(p, q)
    assert float(kl[0]) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(5.0))
    assert float(kl[0]) == pytest.approx(0.5108256237659907)
    assert float(rest[0]) == pytest.approx(0.0, abs=1e-12)
    assert float(expected_acceptance(p, q)[0]) == pytest.approx(0.6)
    m = position_metrics(p, q)
    assert float(m["dnll"][0]) == pytest.approx(math.log(0.1) - math.log(0.5))
    # Q's top-1 is token 0; P's is a tie, sorted by id: token 0 first, so they agree
    assert float(m["top1"][0]) == 1.0
    r = _full([[0.2, 0.8]], [1])
    assert float(position_metrics(q, r)["top1"][0]) == 0.0


def test_acceptance_from_top_k_is_a_lower_bound() -> None:
    """Top-2 of a 4-token vocabulary: only tokens in both lists count."""
    p = TopK(torch.tensor([[0, 1]]), torch.tensor([[0.6, 0.3]]).log(), torch.tensor([0.6]).log())
    q = TopK(torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.4]]).log(), torch.tensor([0.05]).log())
    assert float(expected_acceptance(p, q)[0]) == pytest.approx(0.3)
    assert expected_acceptance(
        TopK(torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), torch.zeros(0)),
        TopK(torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2), torch.zeros(0)),
    ).shape == (0,)


def test_mcnemar_exact_known_table() -> None:
    assert mcnemar_exact(10, 2) == pytest.approx(0.03857421875)
    assert mcnemar_exact(2, 10) == mcnemar_exact(10, 2)
    assert round(mcnemar_exact(10, 2), 4) == 0.0386
    assert mcnemar_exact(0, 0) == 1.0
    assert mcnemar_exact(3, 3) == 1.0
    assert mcnemar_exact(5, 0) == pytest.approx(2 / 32)
    with pytest.raises(ValueError, match="b, c"):
        mcnemar_exact(-1, 2)


def test_flips_and_compare_runs() -> None:
    # 14 questions, one repeat: native right on 0..11; the recipe loses 0..9 and gains
    # 12 and 13 -> b = 10, c = 2
    native = {str(i): int(i < 12) for i in range(14)}
    recipe = {str(i): int(i >= 10) for i in range(14)}
    f = flips(
        torch.tensor([[float(native[str(i)])] for i in range(14)]),
        torch.tensor([[float(recipe[str(i)])] for i in range(14)]),
    )
    assert f == {"lost": 10, "gained": 2, "pairs": 14, "flip_rate": 12 / 14}
    out = compare_runs(TaskRuns.from_mapping([native]), TaskRuns.from_mapping([recipe]))
    assert out["flips"] == f
    assert out["mcnemar"] == {"b": 10, "c": 2, "p_value": pytest.approx(0.03857421875)}
    acc = out["accuracy_native"]
    assert isinstance(acc, dict) and acc["mean"] == pytest.approx(12 / 14)
    assert acc["low"] <= acc["mean"] <= acc["high"]
    delta = out["delta"]
    assert isinstance(delta, dict) and delta["mean"] == pytest.approx(-8 / 14)
    assert delta["high"] < 0.0
    with pytest.raises(ValueError, match="recipe: other questions"):
        compare_runs(TaskRuns.from_mapping([native]), TaskRuns.from_mapping([{"0": 1}]))
    with pytest.raises(ValueError, match="correct: expected only 0 and 1"):
        TaskRuns(("a",), torch.tensor([[0.5]]))


def test_repeats_majority_and_pairs() -> None:
    """Three repeats: flips pair repeat r with repeat r; McNemar uses the majorities."""
    native = TaskRuns.from_mapping([{"a": 1, "b": 1}, {"a": 1, "b": 0}, {"a": 0, "b": 0}])
    recipe = TaskRuns.from_mapping([{"a": 0, "b": 1}, {"a": 0, "b": 1}, {"a": 0, "b": 0}])
    out = compare_runs(native, recipe)
    assert out["repeats"] == 3 and out["questions"] == 2
    assert out["flips"] == {"lost": 2, "gained": 1, "pairs": 6, "flip_rate": 0.5}
    # majorities: native a right, b wrong; recipe a wrong, b right
    assert out["mcnemar"] == {"b": 1, "c": 1, "p_value": 1.0}
    with pytest.raises(ValueError, match="runs\\[1\\]: other questions"):
        TaskRuns.from_mapping([{"a": 1}, {"b": 1}])


def test_lm_eval_samples(tmp_path: Path) -> None:
    rows = [
        {"doc_id": 0, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 1.0},
        {"doc_id": 1, "filter": "strict-match", "metrics": ["exact_match"], "exact_match": 0.0},
        {"doc_id": 0, "filter": "flexible", "metrics": ["exact_match"], "exact_match": 0.0},
        {"doc_id": 1, "filter": "flexible", "metrics": ["exact_match"], "exact_match": 0.0},
    ]
    path = tmp_path / "samples_gsm8k_x.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = load_lm_eval_samples([path, path], "exact_match", "strict-match")
    assert runs.questions == ("0", "1")
    assert runs.correct.tolist() == [[1.0, 1.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match=r"filter_name: .* has filters"):
        load_lm_eval_samples([path], "exact_match")
    with pytest.raises(ValueError, match=r"metric: .* has no 'acc'"):
        load_lm_eval_samples([path], "acc", "flexible")
    with pytest.raises(ValueError, match="paths: cannot read"):
        load_lm_eval_samples([tmp_path / "missing.jsonl"], "acc")


def test_bootstrap_interval_covers_the_true_mean() -> None:
    """200 seeded normal samples of 40: the 95% interval covers the mean ~95% of the time."""
    gen = torch.Generator().manual_seed(0)
    covered = 0
    for rep in range(200):
        sample = 3.0 + 2.0 * torch.randn(40, generator=gen, dtype=torch.float64)
        ci = bootstrap_mean(sample, resamples=1000, seed=rep)
        assert ci["low"] <= ci["mean"] <= ci["high"]
        covered += ci["low"] <= 3.0 <= ci["high"]
    assert 0.88 <= covered / 200 <= 0.99


def test_bootstrap_groups_and_bad_input() -> None:
    values = torch.tensor([1.0, 1.0, 1.0, 5.0])
    same = bootstrap_mean(values, seed=3)
    assert same == bootstrap_mean(values, seed=3)
    grouped = bootstrap_mean(values, torch.tensor([0, 0, 0, 1]), resamples=500, seed=3)
    assert grouped["mean"] == 2.0 and grouped["n"] == 4
    assert grouped["low"] == pytest.approx(1.0) and grouped["high"] == pytest.approx(5.0)
    assert math.isnan(bootstrap_mean(torch.zeros(0))["mean"])
    with pytest.raises(ValueError, match="level"):
        bootstrap_mean(values, level=1.0)
    with pytest.raises(ValueError, match="groups"):
        bootstrap_mean(values, torch.tensor([0, 1]))


def _gen(prompt_len: int, n: int, noise: float, seed: int) -> Generated:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 12, generator=gen, dtype=torch.float64) * 2.0
    other = base + noise * torch.randn(n, 12, generator=gen, dtype=torch.float64)
    tokens = other.argmax(dim=-1)

    def topk(logits: torch.Tensor) -> TopK:
        lp = torch.log_softmax(logits, dim=-1)
        values, ids = lp.topk(12, dim=-1)
        return TopK(ids, values, lp.gather(-1, tokens[:, None])[:, 0])

    return Generated(prompt_len, topk(base), topk(other))


def test_summary_buckets_and_per_prompt() -> None:
    prompts = [_gen(900, 300, 0.3, 1), _gen(10, 1100, 0.3, 2)]
    s = summarize_generation(prompts, resamples=200)
    overall = s["overall"]
    assert isinstance(overall, dict) and overall["positions"] == 1400
    assert set(s["by_position"]) == {"0-256", "256-1k", "1k-4k"}  # type: ignore[arg-type]
    by_ctx = s["by_context"]
    assert isinstance(by_ctx, dict) and set(by_ctx) == {"0-1k", "1k-4k"}
    # context 0-1k: prompt 0's first 124 positions and prompt 1's first 1014
    assert by_ctx["0-1k"]["positions"] == 124 + 1014
    kl = overall["kl"]
    assert kl["low"] <= kl["mean"] <= kl["high"] and kl["mean"] > 0
    assert overall["kl_p50"] <= overall["kl_p90"] <= overall["kl_p99"] <= overall["kl_max"]
    per = s["per_prompt"]
    assert isinstance(per, list) and [p["generated"] for p in per] == [300, 1100]
    assert per[0]["first_top1_miss"] is not None
    curve = s["curve"]
    assert isinstance(curve, dict) and len(curve["position"]) == len(curve["kl"]) <= 64
    same = summarize_generation([_gen(5, 20, 0.0, 3)], resamples=50)
    o = same["overall"]
    assert isinstance(o, dict) and o["kl_max"] == 0.0 and o["top1"]["mean"] == 1.0
    assert o["acceptance"]["mean"] == pytest.approx(1.0)
    assert same["per_prompt"][0]["first_top1_miss"] is None  # type: ignore[index]
    with pytest.raises(ValueError, match="position_edges"):
        summarize_generation(prompts, position_edges=(0, 10, 5))
    with pytest.raises(ValueError, match="prompts"):
        summarize_generation([])
    assert bucket_label((0, 256, 1024, 4096, 16384), 1) == "256-1k"
    assert bucket_label((0, 256, 1024, 4096, 16384), 4) == "16k+"
