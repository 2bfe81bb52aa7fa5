"""The generation-fidelity driver's prompts, command and check, without a GPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from generation_fidelity import NOISE_KL, RECIPES, check_none, compare_command, write_prompts


def test_prompts_are_seeded_token_ids(tmp_path: Path) -> None:
    write_prompts(tmp_path / "a.jsonl", 64)
    write_prompts(tmp_path / "b.jsonl", 64)
    text = (tmp_path / "a.jsonl").read_text()
    assert text == (tmp_path / "b.jsonl").read_text()
    prompts = [json.loads(line) for line in text.splitlines()]
    assert len(prompts) == 64
    assert all(16 <= len(p) <= 256 and all(2 <= t < 4096 for t in p) for p in prompts)


def test_command_runs_every_recipe_with_graphs(tmp_path: Path) -> None:
    cmd = compare_command(
        tmp_path / "m", tmp_path / "p.jsonl", tmp_path / "o", tokens=1024, jobs=3,
        backend="FLASHMLA", extra=["--turns", "2"],
    )  # fmt: skip
    assert cmd[1:3] == ["-m", "mla_vllm.compare"]
    assert [cmd[i + 1] for i, w in enumerate(cmd) if w == "--recipe"] == list(RECIPES)
    for flag in ("--cuda-graphs", "--ignore-eos"):
        assert flag in cmd
    assert cmd[cmd.index("--generate") + 1] == "1024"
    assert cmd[cmd.index("--backend") + 1] == "FLASHMLA"
    assert cmd[-2:] == ["--turns", "2"]
    cli = pytest.importorskip("mla_vllm.compare.cli")  # the options exist (where installed)
    args = cli.build_parser().parse_args(cmd[3:])
    assert args.cuda_graphs and args.generate == 1024 and args.turns == 2


def _report(kl: float) -> dict[str, Any]:
    figure = {"kl": {"mean": kl}, "kl_max": kl, "top1": {"mean": 1.0}}
    return {"recipes": {"none": {"generation": {"by_position": {"0-256": figure}}}}}


def test_none_must_stay_at_noise_level() -> None:
    passed, detail = check_none(_report(NOISE_KL / 10))
    assert passed and "0-256: KL mean" in detail
    assert not check_none(_report(NOISE_KL * 2))[0]
    failed = {"recipes": {"none": {"error": "engine process exited with 1"}}}
    assert check_none(failed) == (False, "engine process exited with 1")
