"""The user's options, in one place: `Scope`, `ScopeCallback` and `AccelerateScope` all take these keywords.

`ScopeOptions` validates once, at construction (so a bad value fails in the user's process, before any
worker starts), and documents each option once: the README's options table is `ScopeOptions.markdown_table()`
and a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ON_HANG = ("abort", "report")


def _doc(text: str, shown_default: str | None = None) -> Any:
    return {"doc": text, "default": shown_default}


@dataclass(frozen=True)
class ScopeOptions:
    run_dir: str | os.PathLike[str] | None = field(
        default=None,
        metadata=_doc(
            "where rank 0 writes the run; chosen by rank 0 and shared with every rank",
            "`runs/<timestamp>`",
        ),
    )
    interval: int = field(
        default=50, metadata=_doc("optimizer steps between cross-rank gathers (and live diagnoses)")
    )
    warmup: int = field(
        default=5,
        metadata=_doc(
            "steps left out of statistics at the start of each segment (launch or resume; a resumed run keeps "
            "its first launch's); a run still in warm-up when it ends is summarised over all its steps, with a "
            "note that they are few"
        ),
    )
    hang_timeout: float | str | None = field(
        default="auto",
        metadata=_doc(
            'seconds without progress on every rank before `DIST.HANG`; `"auto"`: after warm-up, the larger '
            "of 120 s and 20x the slowest step; during warm-up, 300 s inside a collective that some rank never "
            "reached (see *Hangs*); `None`: no hang detection"
        ),
    )
    on_hang: str = field(
        default="abort",
        metadata=_doc('`"abort"`: every rank exits with code 86 after the report; `"report"`: report only'),
    )
    console: bool = field(
        default=True,
        metadata=_doc(
            "live findings and the summary on rank 0's console (live findings above a progress bar: Lightning's "
            "rich or tqdm bar, a loop's own `tqdm`, drawn again below; the summary below Lightning's finished bar)"
        ),
    )
    flops_per_step: float | None = field(
        default=None,
        metadata=_doc(
            "model FLOPs of one optimizer step on one rank, for MFU; when not given, estimated once with "
            "torch's FLOP counter during warm-up (Lightning: read from `flops_per_batch` if the module has it)"
        ),
    )
    peak_flops: float | None = field(
        default=None,
        metadata=_doc("the device's peak FLOP/s, for MFU; when not given, the table of known GPUs (dense)"),
    )
    gather_timeout: float = field(
        default=300.0,
        metadata=_doc(
            "seconds a gather may wait for the other ranks before the scope disables itself (training goes "
            "on); a rank paused longer than this (e.g. evaluation on rank 0 only) is waited for at the gather"
        ),
    )

    def __post_init__(self) -> None:
        # Path("") is the current folder: a run_dir left empty by mistake would write the run into it.
        if self.run_dir is not None and not os.fspath(self.run_dir).strip():
            raise ValueError(
                f"run_dir must not be empty, not {self.run_dir!r}: it would mean the current folder (name a "
                'folder, "." for the current one, or None for runs/<timestamp>)'
            )
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"interval must be an integer >= 1, not {self.interval!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, not {self.warmup!r}")
        t = self.hang_timeout
        if not (t is None or t == "auto" or (_is_number(t) and float(t) > 0)):  # type: ignore[arg-type]
            raise ValueError(f'hang_timeout must be a number of seconds > 0, "auto" or None, not {t!r}')
        if not isinstance(self.console, bool):
            raise ValueError(f"console must be True or False, not {self.console!r}")
        if self.on_hang not in ON_HANG:
            raise ValueError(f'on_hang must be "abort" or "report", not {self.on_hang!r}')
        for name in ("flops_per_step", "peak_flops"):
            value = getattr(self, name)
            if value is not None and not (_is_number(value) and float(value) > 0):
                raise ValueError(f"{name} must be a positive number or None, not {value!r}")
        if not (_is_number(self.gather_timeout) and float(self.gather_timeout) > 0):
            raise ValueError(f"gather_timeout must be a number of seconds > 0, not {self.gather_timeout!r}")

    @property
    def run_path(self) -> Path | None:
        return Path(self.run_dir) if self.run_dir is not None else None

    def replace(self, **changes: Any) -> ScopeOptions:
        return dataclasses.replace(self, **changes)

    @classmethod
    def resolve(
        cls, options: ScopeOptions | None, run_dir: str | os.PathLike[str] | None, **values: Any
    ) -> ScopeOptions:
        """`options` (or the defaults) with `run_dir` and any keyword values over it."""
        if options is None:
            return cls(run_dir=run_dir, **values)
        return options.replace(**({"run_dir": run_dir} if run_dir is not None else {}), **values)

    @classmethod
    def markdown_table(cls) -> str:
        """The README's options table, generated from the fields above."""
        lines = ["| option | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(cls):
            shown = f.metadata.get("default") or f"`{f.default!r}`".replace("'", '"')
            lines.append(f"| `{f.name}` | {shown} | {f.metadata['doc']} |")
        return "\n".join(lines)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
