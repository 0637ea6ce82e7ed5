"""Findings: what the diagnosis tells a person, with the numbers behind it and what to do."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Severity(enum.IntEnum):
    LOW = 1
    MED = 2
    HIGH = 3

    @classmethod
    def parse(cls, text: str) -> Severity:
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"unknown severity {text!r} (expected HIGH, MED or LOW)") from None


@dataclass(frozen=True)
class Finding:
    code: str
    severity: Severity
    title: str
    detail: str
    recommendation: str
    ranks: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    evidence: dict[str, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """Identity of a finding across re-diagnoses (live reporting prints new or worse ones)."""
        return (self.code, self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "severity": self.severity.name,
            "title": self.title,
            "detail": self.detail,
            "recommendation": self.recommendation,
            "ranks": list(self.ranks),
            "steps": list(self.steps),
            "evidence": {k: _plain(v) for k, v in self.evidence.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        return cls(
            code=str(d["code"]),
            severity=Severity.parse(str(d["severity"])),
            title=str(d.get("title", "")),
            detail=str(d.get("detail", "")),
            recommendation=str(d.get("recommendation", "")),
            ranks=tuple(int(r) for r in d.get("ranks", ())),
            steps=tuple(int(s) for s in d.get("steps", ())),
            evidence={str(k): float(v) for k, v in dict(d.get("evidence", {})).items() if v is not None},
        )


def with_predicted(measured: list[Finding], predicted: Iterable[Finding]) -> list[Finding]:
    """The rules' findings and those an integration made before the run (`predicted`), less any predicted one
    that measured findings of the same code replace: the same one, or ones for all of its ranks between them
    (DATA.UNEVEN_SHARDS: predicted at start from the loaders' lengths, measured for each rank that ran out of
    batches inside a join)."""
    keys, ranks = {f.key for f in measured}, dict[str, set[int]]()
    for f in measured:
        ranks.setdefault(f.code, set()).update(f.ranks)
    return measured + [
        f
        for f in predicted
        if f.key not in keys and not (f.ranks and set(f.ranks) <= ranks.get(f.code, set()))
    ]


def format_ranks(ranks: Iterable[int], limit: int = 8) -> str:
    """ "0, 1, 2" for a few ranks, "0, 1, ... and 56 more" for many: findings stay one line at any scale."""
    rs = list(ranks)
    text = ", ".join(str(r) for r in rs[:limit])
    return text + (f" and {len(rs) - limit} more" if len(rs) > limit else "")


def severity_at(value: float, med: float, high: float) -> Severity:
    """The severity ladder of most rules: HIGH at or above `high`, MED at or above `med`, else LOW."""
    if value >= high:
        return Severity.HIGH
    return Severity.MED if value >= med else Severity.LOW


def _plain(v: Any) -> Any:
    f = float(v)
    return f if f == f and f not in (float("inf"), float("-inf")) else None
