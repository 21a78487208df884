"""The statistician specialist: flags outliers with the median absolute deviation (robust z-score)."""

from __future__ import annotations

import statistics
from typing import Any

from fleet.errors import ErrorCode
from fleet.settings import ServiceSettings
from specialists.kit import Skill, SkillContext, SkillError, serve_specialist

# Iglewicz and Hoaglin's cut-off for the modified z-score.
DEFAULT_THRESHOLD = 3.5
MAD_SCALE = 0.6745


def robust_outliers(values: list[float], threshold: float) -> list[tuple[int, float]]:
    """(index, modified z-score) of every value whose score exceeds ``threshold``."""
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    if mad == 0:
        return []
    scores = [MAD_SCALE * (v - median) / mad for v in values]
    return [(i, score) for i, score in enumerate(scores) if abs(score) > threshold]


def _numbers(records: list[Any], field: str) -> list[float]:
    values: list[float] = []
    for record in records:
        value = record.get(field) if isinstance(record, dict) else None
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise SkillError(ErrorCode.INVALID_REQUEST, f"every record needs a numeric {field!r}")
        values.append(float(value))
    return values


async def outliers(ctx: SkillContext, payload: dict[str, Any]) -> dict[str, Any]:
    records = payload.get("records")
    field = payload.get("field")
    label = payload.get("label")
    threshold = payload.get("threshold", DEFAULT_THRESHOLD)
    if not isinstance(threshold, int | float) or isinstance(threshold, bool) or threshold <= 0:
        raise SkillError(ErrorCode.INVALID_REQUEST, '"threshold" must be a positive number')
    if not isinstance(records, list) or not isinstance(field, str):
        raise SkillError(ErrorCode.INVALID_REQUEST, 'input needs "records" (a list) and "field"')
    values = _numbers(records, field)
    if len(values) < 3:
        raise SkillError(ErrorCode.INVALID_REQUEST, "need at least three records")
    await ctx.progress(f"scoring {len(values)} values of {field!r}")
    flagged = robust_outliers(values, float(threshold))
    return {
        "field": field,
        "count": len(values),
        "median": statistics.median(values),
        "mean": statistics.fmean(values),
        "threshold": float(threshold),
        "outliers": [
            {
                "label": records[i].get(label) if isinstance(label, str) else i,
                "value": values[i],
                "score": round(score, 2),
            }
            for i, score in flagged
        ],
    }


SKILLS = [
    Skill(
        "outliers",
        "Outliers",
        'Flags outliers by modified z-score. Input: {"records": [...], "field": NAME, "label": NAME}.',
        outliers,
        tags=("statistics",),
        idempotent=True,  # no effects: a pure computation
    ),
]


async def main(settings: ServiceSettings) -> None:
    await serve_specialist(
        settings,
        name="Statistician",
        description="Robust statistics over records produced by other agents.",
        version="0.1.0",
        skills=SKILLS,
    )
