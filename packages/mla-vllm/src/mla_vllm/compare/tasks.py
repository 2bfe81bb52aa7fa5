"""Task-level statistics: accuracy with intervals, answer flips and a paired test.

One task answered by the native engine and by a recipe's, question by question,
``R`` times each (``R`` sampled runs for reasoning tasks, 1 for greedy): an engine's
results are a ``TaskRuns``, ``correct [Q, R]`` in {0, 1}. ``compare_runs`` pairs two
of them by question id and reports:

- ``accuracy`` of each, over all ``Q × R`` answers, with a bootstrap interval that draws
  whole questions (the repeats of one question are not independent);
- ``delta``: recipe minus native accuracy, with a paired bootstrap interval (the same
  questions drawn for both);
- ``flips``: answers native got right and the recipe wrong (``lost``) and the reverse
  (``gained``), pairing repeat ``r`` of one with repeat ``r`` of the other; with
  sampling, some flips are sampling noise (compare with the ``none`` recipe's);
- ``mcnemar``: the exact McNemar test on each question's majority outcome (correct in
  more than half its repeats): ``b`` questions only native got right, ``c`` only the
  recipe, two-sided p-value of ``b`` against Binomial(b + c, 1/2).

``load_lm_eval_samples`` reads lm-evaluation-harness's ``--log_samples`` files
(``samples_TASK_DATE.jsonl``, one file per repeat) into a ``TaskRuns``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_vllm.compare.generation import bootstrap_mean

__all__ = [
    "TaskRuns",
    "compare_runs",
    "flips",
    "load_lm_eval_samples",
    "mcnemar_exact",
]


@dataclass(frozen=True)
class TaskRuns:
    """One engine's answers to one task: ``correct[i, r]`` is 1 when repeat ``r`` of
    question ``questions[i]`` was answered correctly, else 0."""

    questions: tuple[str, ...]
    correct: torch.Tensor

    def __post_init__(self) -> None:
        if self.correct.dim() != 2 or self.correct.shape[0] != len(self.questions):
            raise ValueError(
                f"correct: expected [{len(self.questions)}, repeats], got "
                f"{tuple(self.correct.shape)}"
            )
        if self.correct.shape[1] < 1:
            raise ValueError("correct: expected at least one repeat")
        if len(set(self.questions)) != len(self.questions):
            raise ValueError("questions: ids repeat")
        if not bool(((self.correct == 0) | (self.correct == 1)).all()):
            raise ValueError("correct: expected only 0 and 1")

    @classmethod
    def from_mapping(cls, runs: Sequence[Mapping[str, bool | int | float]]) -> TaskRuns:
        """From one ``{question: correct}`` per repeat; every repeat must hold the same
        questions."""
        if not runs:
            raise ValueError("runs: expected at least one repeat")
        questions = tuple(sorted(runs[0]))
        for r, run in enumerate(runs):
            if set(run) != set(questions):
                missing = sorted(set(questions) ^ set(run))[:3]
                raise ValueError(f"runs[{r}]: other questions than repeat 0 ({missing} ...)")
        correct = torch.tensor(
            [[float(run[q]) for run in runs] for q in questions], dtype=torch.float64
        ).reshape(len(questions), len(runs))
        return cls(questions, correct)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` and ``c`` discordant pairs:
    ``min(1, 2 P[X <= min(b, c)])`` for X ~ Binomial(b + c, 1/2); 1 when b + c = 0."""
    if b < 0 or c < 0:
        raise ValueError(f"b, c: expected counts >= 0, got {b} and {c}")
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2.0 * float(tail) / float(2**n))


def flips(native: torch.Tensor, recipe: torch.Tensor) -> dict[str, float]:
    """Answer flips between paired outcomes ``[Q, R]``: ``lost`` (native right, recipe
    wrong), ``gained`` (the reverse), ``pairs`` and ``flip_rate`` ((lost + gained) / pairs)."""
    if native.shape != recipe.shape:
        raise ValueError(f"recipe: shape {tuple(recipe.shape)}, native has {tuple(native.shape)}")
    lost = int(((native == 1) & (recipe == 0)).sum())
    gained = int(((native == 0) & (recipe == 1)).sum())
    pairs = native.numel()
    return {
        "lost": lost,
        "gained": gained,
        "pairs": pairs,
        "flip_rate": (lost + gained) / pairs if pairs else math.nan,
    }


def _delta(
    native: torch.Tensor, recipe: torch.Tensor, resamples: int, level: float, seed: int
) -> dict[str, float]:
    """Recipe minus native accuracy, paired bootstrap over questions."""
    diff = recipe.double() - native.double()  # [Q, R]
    groups = torch.arange(diff.shape[0])[:, None].expand_as(diff)
    return bootstrap_mean(diff, groups, resamples=resamples, level=level, seed=seed)


def compare_runs(
    native: TaskRuns,
    recipe: TaskRuns,
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, object]:
    """Accuracy of both with intervals, their paired difference, flips and McNemar
    (module docstring), over the questions both answered the same number of times."""
    if set(native.questions) != set(recipe.questions):
        only = sorted(set(native.questions) ^ set(recipe.questions))[:3]
        raise ValueError(f"recipe: other questions than native ({only} ...)")
    if native.correct.shape[1] != recipe.correct.shape[1]:
        raise ValueError(
            f"recipe: {recipe.correct.shape[1]} repeats, native has {native.correct.shape[1]}"
        )
    order = [recipe.questions.index(q) for q in native.questions]
    a, b = native.correct, recipe.correct[order]
    groups = torch.arange(a.shape[0])[:, None].expand_as(a)
    majority_a, majority_b = a.mean(dim=1) > 0.5, b.mean(dim=1) > 0.5
    only_native = int((majority_a & ~majority_b).sum())
    only_recipe = int((~majority_a & majority_b).sum())
    return {
        "questions": a.shape[0],
        "repeats": a.shape[1],
        "accuracy_native": bootstrap_mean(a, groups, resamples=resamples, level=level, seed=seed),
        "accuracy": bootstrap_mean(b, groups, resamples=resamples, level=level, seed=seed),
        "delta": _delta(a, b, resamples, level, seed),
        "flips": flips(a, b),
        "mcnemar": {
            "b": only_native,
            "c": only_recipe,
            "p_value": mcnemar_exact(only_native, only_recipe),
        },
    }


def load_lm_eval_samples(
    paths: Sequence[str | Path], metric: str, filter_name: str | None = None
) -> TaskRuns:
    """lm-eval ``--log_samples`` files, one per repeat, as a ``TaskRuns``.

    Each line is one question (``doc_id``) under one filter, with the task's metrics as
    keys (``"exact_match": 1.0``); ``metric`` names the one that says correct (0 or 1).
    A task logged under several filters needs ``filter_name``.
    """
    if not paths:
        raise ValueError("paths: expected at least one samples file")
    runs: list[dict[str, float]] = []
    for path in paths:
        file = Path(path)
        try:
            lines = file.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"paths: cannot read {str(file)!r}: {exc.strerror or exc}") from None
        rows = [json.loads(line) for line in lines if line.strip()]
        filters = sorted({str(row.get("filter")) for row in rows})
        chosen = filter_name
        if chosen is None:
            if len(filters) > 1:
                raise ValueError(f"filter_name: {file.name} has filters {filters}; name one")
            chosen = filters[0] if filters else None
        run: dict[str, float] = {}
        for n, row in enumerate(rows, 1):
            if str(row.get("filter")) != chosen:
                continue
            if metric not in row:
                raise ValueError(
                    f"metric: {file.name} line {n} has no {metric!r} (it has {row.get('metrics')})"
                )
            value = float(row[metric])
            if value not in (0.0, 1.0):
                raise ValueError(f"metric: {file.name} line {n}: {metric} = {value}, not 0 or 1")
            run[str(row["doc_id"])] = value
        if not run:
            raise ValueError(f"filter_name: {file.name} holds no sample under {chosen!r}")
        runs.append(run)
    return TaskRuns.from_mapping(runs)
