"""Rank 0's voice: everything the scope writes to the run directory and prints, in one place.

Findings (live or from an integration), the hang report (called from the watchdog thread while training is
blocked), internal errors, the scope's own cost, and the end-of-run summary. The file writes are
thread-safe (`RunWriter` locks); console output is rich.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .findings import Finding, Severity
from .output import show
from .parallelism import comm_note
from .rundir import RunWriter
from .said import same_findings


class RunReporter:
    """Writes the run directory and the console on rank 0."""

    def __init__(self, run_dir: Path, meta: dict[str, Any], console: bool) -> None:
        from rich.console import Console
        from rich.markup import escape

        self.run_dir = run_dir
        self.meta = meta
        self.writer = RunWriter(run_dir, meta)
        self.console: Any = Console(stderr=False) if console else None
        self._written = {"scope_error": 0, "scope_note": 0}  # how many of each the run's events hold
        self._messages_lock = threading.Lock()
        note = comm_note(meta.get("parallelism"), meta.get("comm_measured") is not False)
        if self.console is not None and note is not None:  # once, when the run starts
            self._print(f"[bold]pytscope[/]: {escape(note)}", markup=True, highlight=False)

    def segment(self, **fields: Any) -> None:
        self.writer.event("segment", **fields)

    def learnt(self, **fields: Any) -> None:
        """Settings learnt during the run (e.g. estimated FLOPs per step): the reader merges them into meta."""
        self.meta.update(fields)
        self.writer.event("meta", fields=fields)

    def rows(self, rows: np.ndarray) -> None:
        self.writer.append_rows(rows)

    def findings(
        self, findings: Iterable[Finding], step: int, source: str = "diagnosis", updated: bool = False
    ) -> None:
        """Findings said live; `updated`: findings said before, said again as they are now (their ranks
        changed)."""
        findings = list(findings)
        for f in findings:
            extra = {"updated": True} if updated else {}
            self.writer.event("finding", step=step, source=source, finding=f.to_dict(), **extra)
        if self.console is not None and findings:
            from .render import render_findings

            head = f"[bold]pytscope[/] step {step}" + (", updated:" if updated else ":")
            self._print(head, render_findings(findings))

    def cleared(self, findings: list[Finding], step: int, summary: bool = False) -> None:
        """Findings said live that the latest diagnosis no longer makes (`summary`: the end-of-run one)."""
        extra = {"summary": True} if summary else {}
        self.writer.event("cleared", step=step, findings=[f.key[0] for f in findings], **extra)
        if self.console is not None:
            from rich.markup import escape

            where = f"step {step}" + (", run summary" if summary else "")
            self._print(
                *(
                    f"[bold]pytscope[/] {where}: no longer found: {escape(f.title)} ({f.code})"
                    for f in findings
                )
            )

    def hang(self, finding: Finding, step: int, segment: int = 0) -> None:
        # When, and in which launch: the job was alive, stuck, until then (goodput counts that time).
        self.writer.event("hang", step=step, segment=segment, t=time.time(), finding=finding.to_dict())
        if self.console is not None:
            from .render import render_findings

            hang = finding.severity is Severity.HIGH  # (MED: no rank progresses, and no hang is proven)
            self._print(
                "[bold red]pytscope: hang detected[/]" if hang else "[bold]pytscope: no progress[/]",
                render_findings([finding]),
            )

    def messages(self, errors: list[str], notes: list[str]) -> None:
        """The scope's own errors and its notes on what it could not measure, each written once (as they come:
        `errors` and `notes` only grow). Called from the training thread and, for a disabled scope, a hook's."""
        with self._messages_lock:
            for kind, items in (("scope_error", errors), ("scope_note", notes)):
                for message in items[self._written[kind] :]:
                    self.writer.event(kind, message=message)
                    self._written[kind] += 1

    def cost(self, **fields: Any) -> None:
        self.writer.event("scope_cost", **fields)

    def summary(self, standing: Sequence[Finding] = ()) -> Any:
        """Re-read the whole run (every segment and every rank's file) and write and print its summary.
        `standing`: the live diagnosis's alarms still standing on the console; those the summary no longer
        makes are said to be gone first, as a live diagnosis says them, so that the console's last word on a
        finding is the summary's."""
        from rich.console import Console
        from rich.markup import escape

        from .render import render_summary
        from .rundir import load_run
        from .summary import summarize

        run = load_run(self.run_dir)
        # This is the run's end (the summary is written below): it has ended.
        ended = dataclasses.replace(run.context, ended=True)
        summary = summarize(run.arrays, ended, extra_findings=tuple(run.extra_findings))
        same = same_findings(standing, summary.findings)
        gone = [f for f in standing if f.key not in same]
        if gone:
            self.cleared(gone, summary.run.last_step or 0, summary=True)
        with open(os.devnull, "w") as devnull:
            text = Console(record=True, width=110, file=devnull, color_system=None)
            text.print(render_summary(summary))
            self.writer.write_summary(summary.to_dict(), text.export_text())
        if self.console is not None:
            where = escape(str(self.run_dir))
            self._print(render_summary(summary))
            # Never broken into lines by rich: the command is copied from the terminal as it stands.
            self._print(f"[dim]run directory: {where}  (pytscope report {where})[/]", soft_wrap=True)
        return summary

    def close(self) -> None:
        self.writer.close()

    def _print(self, *items: Any, **options: Any) -> None:
        show(self.console, *items, **options)  # (out of the way of the training's progress bars)
