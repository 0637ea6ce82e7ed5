"""A loop that goes on fetching batches without an optimizer step, said while it runs (rank 0).

Steps end where the optimizer steps, and gathers, so live diagnoses, follow steps. A loop that skips every
batch (a guard on a NaN loss under DDP or FSDP, where one rank's own loss cannot end a step: the others' are
finite) or whose accumulation window never closes ends no step, so nothing would be said until the run
ended. The recorder shows rank 0's open, unstepped step to `UntrainedAlert.check` once it holds
`recorder.long_step_marks` marks: a length test at a loop top inside an open step, nothing on a step's usual
path. The alert is a finding an integration would make (`LiveDiagnosis.add`): printed, written to the run,
and in the final summary, where its latest word (the stretch ended, or lasted to the run's end) stands
unless the run's own `CONVERGENCE.SKIPPED_STEPS` replaces it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from .findings import Finding, Severity
from .recorder import StepRecorder
from .timeline import Mark

CODE = "CONVERGENCE.SKIPPED_STEPS"
MIN_BATCHES = 50  # batches without an optimizer step before anything is said...
FACTOR = 4.0  # ...and this many times the forwards of the run's average step
FIRST_CHECK_MARKS = 2 * MIN_BATCHES  # a batch adds at least two marks (its fetch, or its forward's two)
_FORWARD_END, _BACKWARD_END = int(Mark.FORWARD_END), int(Mark.BACKWARD_END)


class UntrainedAlert:
    """Rank 0: says a long stretch of batches without an optimizer step once, then how it ended."""

    def __init__(self, recorder: StepRecorder, say: Callable[[Finding, int], None]) -> None:
        self.recorder = recorder
        self._say = say
        # (steps done, the open step's marks and label, the run's forwards per step, and whether no backward
        # had run) when said
        self._said: tuple[int, list[int], int, float, bool] | None = None
        recorder.long_step_marks = FIRST_CHECK_MARKS
        recorder.on_long_step = self.check

    def remove(self) -> None:
        self.recorder.on_long_step = None
        self.recorder.long_step_marks = sys.maxsize

    def check(self, marks: list[int]) -> None:
        """The training thread, at a loop top of the open step, unstepped, once it holds `long_step_marks`."""
        rec = self.recorder
        if not rec.steps_done:  # the first step: how long the run's steps are is not known yet
            rec.long_step_marks = 2 * len(marks)
            return
        batches, _, backwards = batch_counts(marks)
        usual = rec.micro_batches / rec.steps_done
        need = max(MIN_BATCHES, FACTOR * usual)
        if batches < need:  # look again about where the step would have that many
            rec.long_step_marks = int(len(marks) * need / max(batches, 1)) + 1
            return
        rec.long_step_marks = sys.maxsize  # once per stretch (`ended` looks again)
        label = rec.current_label()
        self._said = (rec.steps_done, marks, label, usual, not backwards)
        self._say(untrained_finding(marks, label, usual, not backwards), label)

    def ended(self, run_ends: bool = False) -> None:
        """At each gather, and as the run ends (before the open step closes): the stretch said, once a step has
        ended it or, `run_ends`, as it stands, is said again with all its batches."""
        if self._said is None:
            return
        steps, marks, label, usual, skipping = self._said
        rec = self.recorder
        if rec.steps_done == steps and not run_ends:
            return
        self._said = None
        rec.long_step_marks = FIRST_CHECK_MARKS
        trained_at = rec.step_label(steps + 1) if rec.steps_done > steps else None
        finding = untrained_finding(marks, label, usual, skipping, trained_at, to_end=run_ends)
        self._say(finding, rec.current_label())


def untrained_finding(
    marks: list[int],
    label: int,
    usual: float,
    skipping: bool,
    trained_at: int | None = None,
    to_end: bool = False,
) -> Finding:
    """What rank 0's open step `marks`, after step `label`, says: its batches ran without an optimizer step
    (so far, until the step `trained_at` ended them, or `to_end` of the run). `usual`: the run's forwards per
    step; `skipping`: no backward had run when the stretch was first said."""
    batches, forwards, backwards = batch_counts(marks)
    cause = (
        "the loop skips each batch after its forward, as a guard on a NaN or Inf loss does"
        if skipping
        else "gradients accumulate and no optimizer step comes"
    )
    counts = f"{batches} batches ({forwards} forwards, {backwards} backwards)"
    usual_text = f"{usual:.3g} forward" + ("" if usual == 1 else "s")
    evidence = {"batches": float(batches), "forwards": float(forwards), "backwards": float(backwards)}
    evidence |= {"after_step": float(label), "usual_forwards": usual}
    if trained_at is not None:
        severity = Severity.MED
        title = f"Step {trained_at} ran {batches} batches before its optimizer stepped"
        detail = (
            f"Rank 0's loop ran {counts} between its optimizer steps at step {label} and step {trained_at}, "
            f"where the run's average step runs {usual_text}: {cause}."
        )
        evidence["trained_at"] = float(trained_at)
    else:
        severity = Severity.HIGH
        title = f"No optimizer step for {batches} batches since step {label}" + (
            ", to the end of the run" if to_end else ""
        )
        detail = (
            f"Rank 0's loop ran {counts} after its optimizer step at step {label}"
            + (" to the end of the run" if to_end else "")
            + f", where the run's average step runs {usual_text}: {cause}. The model is not training"
            + (
                "."
                if to_end
                else "; no step ends, so no other live report comes, until an optimizer step does."
            )
        )
    advice = (
        "Log why the loop skips; a loss that is NaN or Inf on every batch does not recover: restart from a "
        f"checkpoint saved before step {label} with a lower learning rate or gradient clipping"
        if skipping
        else "Check the condition that steps the optimizer (an accumulation count never reached, a guard that "
        "skips the step and keeps the gradients)"
    )
    return Finding(
        code=CODE,
        severity=severity,
        title=title,
        detail=detail,
        recommendation=advice + ".",
        steps=(label,),
        evidence=evidence,
    )


def batch_counts(marks: list[int]) -> tuple[int, int, int]:
    """(batches, forwards, backwards) of a step's `marks`: its loop tops (fetches or, with no loader watched,
    forwards), less a last one that no forward followed (the fetch a loop top has just made, or one that
    ended the epoch)."""
    top = marks[0]
    last = len(marks) - 1 - marks[::-1].index(top)
    batches = marks.count(top) - (_FORWARD_END not in marks[last:])
    return batches, marks.count(_FORWARD_END), marks.count(_BACKWARD_END)
