"""RULER's scoring of its synthetic tasks (scripts/eval/synthetic/constants.py there): string_match_all.

A continuation is stripped and its control characters turned into newlines (RULER's
postprocess_pred); a sample scores the share of its answers found in it as substrings, ignoring
case; a task's score is the mean over its samples, in percent. (RULER's string_match_part, the best
single answer, scores only its qa tasks, which are not generated here.)
"""

from __future__ import annotations

import re

CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess(prediction: str) -> str:
    return CONTROL.sub("\n", prediction.strip()).strip()


def match_all(prediction: str, answers: list[str]) -> float:
    """Share of `answers` found in `prediction` (0..1), case-insensitive."""
    pred = postprocess(prediction).lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_all(predictions: list[str], answers: list[list[str]]) -> float:
    """RULER's task score in percent: the mean of match_all over the samples."""
    if len(predictions) != len(answers) or not predictions:
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} samples")
    return 100 * sum(match_all(p, a) for p, a in zip(predictions, answers)) / len(predictions)
