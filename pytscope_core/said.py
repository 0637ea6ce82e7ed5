"""What rank 0's console has said of each finding during the run, so that each diagnosis says only what changed.

A re-diagnosis says a finding that is new or got worse, one whose ranks changed as an update of the one said,
and a HIGH or MED finding said before that it no longer makes as gone; the end-of-run summary, a diagnosis of
the whole run, is held against what still stands the same way (`still_standing`), so that an alarm said live
and not in the summary is said to be gone there too. A finding is the same finding when its code and ranks
agree (`Finding.key`), or, where one finding speaks for its code on each side, whatever its ranks or the count
in its title (`same_findings`): a jitter first on rank 1 and then on no rank in particular, 4 spikes on rank 0
then 5 on every rank, is one finding updated, not one gone and another new. A finding about something that
stopped (a straggler that no longer straggles: `is_past`) is not the same finding as the current one it was:
the current one is said to be gone and the past one said once; a past one the window no longer holds, or that
is current again, is forgotten without a word.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .findings import Finding, Severity

Key = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class Word:
    """What a diagnosis has the console say: `fresh` findings (new or worse), `updated` ones (their ranks
    changed, said again as they are now) and `gone` ones (said at MED or above, no longer made)."""

    fresh: list[Finding]
    updated: list[Finding]
    gone: list[Finding]


def is_past(finding: Finding) -> bool:
    """A finding about something that stopped within the window (a straggler's `until_step`): said as past."""
    return "until_step" in finding.evidence


def same_findings(before: Iterable[Finding], after: Iterable[Finding]) -> dict[Key, Finding]:
    """Each finding of `before` that `after` still makes, by its key, and the finding of `after` it is now:
    the one with its code and ranks, or, where its code has one finding on each side and their ranks differ,
    that one (a rule's single finding whose ranks or count moved). Codes with several findings at once (one per
    rank: DATA.UNEVEN_SHARDS; one per launch: RUN.FAILED) are told apart by their ranks."""
    before, after = list(before), list(after)
    by_key = {f.key: f for f in after}
    same = {f.key: by_key[f.key] for f in before if f.key in by_key and is_past(by_key[f.key]) == is_past(f)}
    count_before = collections.Counter(f.code for f in before)
    count_after = collections.Counter(f.code for f in after)
    for f in before:
        if f.key not in same and count_before[f.code] == 1 and count_after[f.code] == 1:
            now = next(g for g in after if g.code == f.code)
            if is_past(now) == is_past(f):
                same[f.key] = now
    return same


class SaidFindings:
    """The console's word on each finding: the severity it was last said at, and the last diagnosis's findings
    (those it no longer makes are gone). Not thread-safe: `LiveDiagnosis` holds its lock around each call."""

    def __init__(self) -> None:
        self._severity: dict[Key, Severity] = {}
        self._diagnosed: dict[Key, Finding] = {}

    def said(self, finding: Finding) -> None:
        """A finding said outside a diagnosis (an integration's): a diagnosis says it again only if worse."""
        self._severity[finding.key] = finding.severity

    def diagnosed(self, findings: Sequence[Finding], shown: Sequence[Finding]) -> Word:
        """A diagnosis made `findings` (the rules'); `shown` are those with the integration's own findings,
        all of which the console may say. A HIGH or MED finding no longer made is gone and forgotten: said
        again if it comes back. (One said at LOW only stays remembered: a hint near its threshold would be said
        at every other diagnosis.)"""
        same = same_findings(self._diagnosed.values(), findings)
        # (An integration's finding under the same key stands in for it: CONVERGENCE.SKIPPED_STEPS's alert.)
        shown_keys = {f.key for f in shown} - {f.key for f in findings}
        dropped = [
            f
            for key, f in self._diagnosed.items()
            if key not in same and key not in shown_keys and (self._stood(f) or is_past(f))
        ]
        for f in dropped:
            self._severity.pop(f.key, None)
        gone = [f for f in dropped if not is_past(f)]
        moved = []
        for key, now in same.items():
            if now.key != key:  # the same finding, its ranks changed: its word moves to its new key
                was = self._severity.pop(key, None)
                if was is not None:
                    self._severity[now.key] = was
                moved.append(now)
        fresh = [f for f in shown if self._severity.get(f.key, Severity.LOW - 1) < f.severity]
        # An update of a MED or HIGH finding is said as it is now (the ranks said were wrong); a hint's is not.
        fresh_keys = {f.key for f in fresh}
        updated = [f for f in moved if f.key not in fresh_keys and f.severity >= Severity.MED]
        for f in fresh + updated:
            self._severity[f.key] = f.severity
        self._diagnosed = {f.key: f for f in findings}
        return Word(fresh, updated, gone)

    def still_standing(self) -> list[Finding]:
        """The last diagnosis's findings whose HIGH or MED word stands on the console: the end-of-run summary
        says those it does not make are gone (`RunReporter.summary`)."""
        return [f for f in self._diagnosed.values() if self._stood(f) and not is_past(f)]

    def _stood(self, finding: Finding) -> bool:
        """Whether the console's word on `finding` is an alarm: said at MED or above (a finding said at MED
        that has since eased to LOW still stands at MED there: nothing said it eased)."""
        return max(finding.severity, self._severity.get(finding.key, Severity.LOW)) >= Severity.MED
