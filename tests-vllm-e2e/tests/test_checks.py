"""CPU tests of the e2e's checks on the run recorded in ``tests-vllm-e2e/results/``.

No GPU and no vLLM: ``mla_e2e.checks`` and ``mla_e2e.tp`` read result dicts. The
recorded run must pass every check (the bounds were derived from it, with their
margins), the checks it recorded in ``results.json`` must come out the same, and
results that a real bug would give must fail the bound that is there for it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mla_e2e.bounds import LOGPROB_MARGIN, MEASURED, STATS_MARGIN, bounds
from mla_e2e.checks import evaluate, max_diff
from mla_e2e.tp import compare_tp, load_results

Change = Callable[[dict[str, Any]], None]  # edits a copy of the recorded results
RESULTS = Path(__file__).resolve().parent.parent / "results"
TOL = 0.05


@pytest.fixture(scope="module")
def recorded() -> dict[str, Any]:
    found = load_results(RESULTS)
    assert set(MEASURED) <= set(found), "results/ lacks a bounded configuration"
    return found


def failing(results: dict[str, Any]) -> list[str]:
    checks, _ = evaluate(results, TOL, RESULTS)
    return [c["check"] for c in checks if not c["ok"]]


def test_recorded_run_passes_every_check_and_every_bound(recorded: dict[str, Any]) -> None:
    checks, lines = evaluate(copy.deepcopy(recorded), TOL, RESULTS)
    assert [c["check"] for c in checks if not c["ok"]] == []
    labels = [c["check"] for c in checks]
    for name, m in MEASURED.items():
        assert any(label.startswith(f"{name} vs {m.native} (prompt max") for label in labels)
        if m.rel_l2_max is not None:
            assert any(label.startswith(f"{name}: every layer's rel_l2 mean") for label in labels)
    assert not any("[info]" in line for line in lines)


def test_recorded_checks_come_out_the_same(recorded: dict[str, Any]) -> None:
    """Every check in results.json (written before the split) again, label, verdict, value."""
    before = json.loads((RESULTS / "results.json").read_text())["checks"]
    checks, _ = evaluate(copy.deepcopy(recorded), TOL, RESULTS)
    assert before
    assert [c for c in checks if c in before] == before


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_bounds_leave_their_margin_over_the_recorded_run(
    recorded: dict[str, Any], name: str
) -> None:
    b, m = bounds(name), MEASURED[name]
    d = max_diff(recorded[m.native]["outputs"], recorded[name]["outputs"])
    room = LOGPROB_MARGIN * 0.99  # MEASURED is rounded to four significant digits
    assert d["prompt_max"] * room <= b.prompt_max
    assert d["gen_max"] * room <= b.gen_max
    assert b.prompt_mean_low * room <= d["prompt_mean"] <= b.prompt_mean_high / room
    if m.rel_l2_max is None:
        assert "stats" not in recorded[name] or not recorded[name]["eager"]
        return
    assert b.rel_l2_max is not None and b.rel_l2_mean_low is not None
    entries = [s for per_path in recorded[name]["stats"].values() for s in per_path.values()]
    assert len(entries) == 4
    room = STATS_MARGIN * 0.99
    assert max(s["rel_l2_max"] for s in entries) * room <= b.rel_l2_max
    assert min(s["rel_l2_mean"] for s in entries) >= b.rel_l2_mean_low * room


def _shift_prompt(name: str, prompt: int, delta: float, every: bool = False) -> Change:
    def change(r: dict[str, Any]) -> None:
        lps = r[name]["outputs"][prompt]["prompt_logprobs"]
        for i in range(1, len(lps)) if every else (len(lps) // 2,):
            lps[i] += delta

    return change


def _shift_generated(name: str, prompt: int, delta: float) -> Change:
    def change(r: dict[str, Any]) -> None:
        r[name]["outputs"][prompt]["logprobs"][0] += delta

    return change


def _set_stats(name: str, key: str, value: float) -> Change:
    def change(r: dict[str, Any]) -> None:
        for per_path in r[name]["stats"].values():
            for s in per_path.values():
                s[key] = value

    return change


def _copy_from(name: str, source: str, key: str) -> Change:
    def change(r: dict[str, Any]) -> None:
        r[name][key] = copy.deepcopy(r[source][key])

    return change


def _drop_stats(name: str) -> Change:
    def change(r: dict[str, Any]) -> None:
        del r[name]["stats"]

    return change


def _both(*changes: Change) -> Change:
    def change(r: dict[str, Any]) -> None:
        for c in changes:
            c(r)

    return change


BUGS = {
    # one prompt position off by a nat (a wrong scale in one block, say)
    "prompt outlier": (_shift_prompt("fp8_eager", 3, 1.0), ["fp8_eager vs triton_eager"]),
    # the first generated token's logprob off by a nat (decode, before any divergence)
    "decode outlier": (
        _shift_generated("nvfp4_calibrated", 3, 1.0),
        ["nvfp4_calibrated vs triton_eager"],
    ),
    # every prompt logprob of the 300-token prompt moved a little: of the bounds only
    # the mean's sees it (the shadow run no longer matches on-read decode, either)
    "prompt drift": (
        _shift_prompt("nvfp4_graphs", 3, 0.4, every=True),
        ["nvfp4_graphs vs triton_graphs", "nvfp4_shadow_graphs vs nvfp4_graphs"],
    ),
    # the recipe silently not applied on both KV paths: they still agree with each
    # other, and only the bounds' lower end on the mean sees it
    "graphs not quantized": (
        _both(
            _copy_from("nvfp4_graphs", "quant_none_graphs", "outputs"),
            _copy_from("nvfp4_shadow_graphs", "quant_none_graphs", "outputs"),
        ),
        ["nvfp4_graphs vs triton_graphs", "nvfp4_shadow_graphs vs triton_graphs"],
    ),
    "fp8 not quantized": (_set_stats("fp8_eager", "rel_l2_mean", 0.0), ["fp8_eager: every"]),
    # fp8 errors where nvfp4 ran: a weaker recipe in its place
    "nvfp4 ran as fp8": (
        _copy_from("nvfp4_shadow_eager", "fp8_eager", "stats"),
        ["nvfp4_shadow_eager: every"],
    ),
    "fp8 error too large": (_set_stats("fp8_eager", "rel_l2_max", 0.1), ["fp8_eager: every"]),
    "statistics missing": (
        _drop_stats("nvfp4_calibrated"),
        ["nvfp4_calibrated: every", "nvfp4_calibrated: finite"],
    ),
}


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_bug_fails_its_bound(recorded: dict[str, Any], bug: str) -> None:
    change, expected = BUGS[bug]
    results = copy.deepcopy(recorded)
    change(results)
    failed = failing(results)
    assert len(failed) == len(expected), failed
    for prefix, label in zip(sorted(expected), sorted(failed), strict=True):
        assert label.startswith(prefix), (prefix, label)


def test_bounds_refuse_an_unknown_configuration() -> None:
    with pytest.raises(ValueError, match=r"^name: 'triton_eager'"):
        bounds("triton_eager")


def _write(folder: Path, results: dict[str, Any]) -> Path:
    folder.mkdir()
    for name, result in results.items():
        (folder / f"{name}.json").write_text(json.dumps(result))
    return folder


def test_compare_tp_passes_a_folder_against_itself_and_fails_a_moved_one(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    ok, lines, rows = compare_tp(RESULTS, RESULTS)
    assert ok and rows and all(r["ok"] for r in rows), lines
    moved = copy.deepcopy(recorded)
    _shift_prompt("nvfp4_eager", 2, 0.2)(moved)  # above TP_TOL["nvfp4"] = 0.15
    ok, _, rows = compare_tp(RESULTS, _write(tmp_path / "b", moved))
    assert not ok
    assert [r["check"] for r in rows if not r["ok"]] == [
        "nvfp4_eager TP=1 vs TP=1: logprobs (max 0.15, mean 0.03 nats)"
    ]
