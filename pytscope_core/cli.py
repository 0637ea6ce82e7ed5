"""The `pytscope` command: re-read any run (report), compare runs, scale, trace, run a faulty demo job, or
check that a data-parallel step computes what one process does (equivalence).

Bad input (a missing or junk run directory, bad arguments) exits 2 with one line on stderr, never a
traceback; `--fail-on` exits 1 when a finding is at least that severe.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

EXIT_OK, EXIT_FINDINGS, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(Exception):
    """Bad input: reported as one line on stderr with exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def _severity(text: str) -> Any:
    from .findings import Severity

    try:
        return Severity.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _path(text: str) -> str:
    """A path argument: never empty (an empty one would mean the current folder, or nothing at all)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _not_a_run_file(output: str, run_dirs: Sequence[str], what: str) -> None:
    """An output path must not be one of an input run's own files (a report of it would then read the plot or
    trace as damaged records)."""
    from .rundir import is_run_file

    if any(is_run_file(Path(d), Path(output)) for d in run_dirs):
        raise UsageError(f"{what}: it is one of the run's own files (write it elsewhere)")


def _cannot_write(what: str, exc: OSError) -> UsageError:
    """The one-line error for an output path (`what`: "pytscope trace: cannot write X"); a file in the way of
    a folder to make reads 'File exists' from the OS, said plainly here."""
    if isinstance(exc, FileExistsError | NotADirectoryError):
        return UsageError(f"{what}: a file is in the way where a folder is needed")
    return UsageError(f"{what}: {exc.strerror or exc}")


def _console() -> Any:
    from rich.console import Console

    return Console()


def cmd_report(args: argparse.Namespace) -> int:
    from .rundir import RunDirError, load_run
    from .summary import summarize

    try:
        run = load_run(args.run_dir)
    except RunDirError as exc:
        raise UsageError(str(exc)) from None
    summary = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings))
    plots = getattr(args, "plots", None)
    cannot_write_plots = f"pytscope report: cannot write plots into {plots}"
    if plots:  # a folder that cannot be made fails before the report is printed
        try:
            Path(plots).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _cannot_write(cannot_write_plots, exc) from None
    data = summary.to_dict()
    if run.problems:
        data.setdefault("scope", {})["read_problems"] = run.problems
    if args.json:
        print(json.dumps(data, indent=1, allow_nan=False))
    else:
        from rich.markup import escape

        from .render import MAX_NOTES, render_summary

        console = _console()
        console.print(render_summary(summary))
        for problem in run.problems[:MAX_NOTES]:
            console.print(f"[yellow]note:[/] {escape(problem)}")
        if len(run.problems) > MAX_NOTES:
            console.print(
                f"[yellow]note:[/] ... and {len(run.problems) - MAX_NOTES} more (all of them: --json)"
            )
    if plots:
        from .plots import write_report_plots

        try:
            written = write_report_plots(run, plots)
        except OSError as exc:
            raise _cannot_write(cannot_write_plots, exc) from None
        for path in written:  # (beside JSON, on stderr: stdout stays one JSON document)
            print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    if args.fail_on is not None and any(f.severity >= args.fail_on for f in summary.findings):
        return EXIT_FINDINGS
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from rich.markup import escape

    from .demo import check_demo, demo_run_dir, run_demo

    try:
        check_demo(args.scenario, args.ranks, args.steps)
    except ValueError as exc:
        raise UsageError(f"pytscope demo: {exc}") from None
    try:
        path = demo_run_dir(args.scenario, args.run_dir)
    except OSError as exc:
        where = exc.filename or args.run_dir or "runs"
        raise _cannot_write(f"pytscope demo: cannot make the run directory {where}", exc) from None
    console = _console()
    console.print(
        f"[bold]pytscope demo[/]: {args.ranks} CPU processes (gloo, DDP), scenario [bold]{args.scenario}[/]"
    )
    path = run_demo(args.scenario, ranks=args.ranks, steps=args.steps, run_dir=path, placed=True)
    if args.scenario == "hang":  # the ranks were ended before they could print the summary
        from .render import render_summary
        from .rundir import load_run
        from .summary import summarize

        run = load_run(path)
        console.print(
            render_summary(summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings)))
        )
    console.print(f"\nre-read it any time: [bold]pytscope report {escape(str(path))}[/]")
    return EXIT_OK


def _load(path: str) -> Any:
    from .rundir import RunDirError, load_run

    try:
        return load_run(path)
    except RunDirError as exc:
        raise UsageError(str(exc)) from None


def _nonnegative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0: {text!r}")
    return value


def cmd_compare(args: argparse.Namespace) -> int:
    from .compare import compare_runs, render_comparison

    runs = [_load(args.run_a), _load(args.run_b)]
    for run in runs:  # (a gate would pass on a run that recorded nothing: nothing is slower)
        if run.arrays.n_steps == 0:
            raise UsageError(f"pytscope compare: {run.path} holds no step records yet (nothing to compare)")
    comparison = compare_runs(*runs)
    if args.json:
        print(json.dumps(comparison.to_dict(), indent=1, allow_nan=False))
    else:
        _console().print(render_comparison(comparison))
    threshold = args.fail_on_regression
    if threshold is not None and comparison.regressed(threshold):
        print(
            f"pytscope compare: {comparison.slowdown[0]} {comparison.slowdown[1]:+.1f}% "
            f"(more than {threshold:g}% slower)",
            file=sys.stderr,
        )
        return EXIT_FINDINGS
    return EXIT_OK


def cmd_scaling(args: argparse.Namespace) -> int:
    from .scaling import NothingToScale, render_scaling, scaling_points, write_scaling_plot

    if args.target_loss is not None and not math.isfinite(args.target_loss):
        raise UsageError("pytscope scaling: --target-loss must be a finite number")
    try:
        result = scaling_points(
            [_load(p) for p in args.run_dirs], target_loss=args.target_loss, weak=args.weak
        )
    except NothingToScale as exc:
        raise UsageError(f"pytscope scaling: {exc}: nothing to scale") from None
    cannot_write_plot = f"pytscope scaling: cannot write {args.plot}"
    if args.plot:  # a path that cannot be written fails before the table is printed
        _not_a_run_file(args.plot, args.run_dirs, cannot_write_plot)
        if Path(args.plot).is_dir():
            raise UsageError(f"{cannot_write_plot}: it is a folder (give a file name, e.g. scaling.png)")
        try:
            Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise _cannot_write(cannot_write_plot, exc) from None
        if not os.access(Path(args.plot).parent, os.W_OK):
            raise UsageError(f"{cannot_write_plot}: its folder is not writable")
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, allow_nan=False))
    else:
        _console().print(render_scaling(result))
    if args.plot:
        try:
            path = write_scaling_plot(result, args.plot)
        except OSError as exc:
            raise _cannot_write(cannot_write_plot, exc) from None
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def cmd_trace(args: argparse.Namespace) -> int:
    from .summary import summarize
    from .trace import write_chrome_trace

    if args.max_steps < 1:
        raise UsageError("pytscope trace: --max-steps must be at least 1")
    _not_a_run_file(args.output, [args.run_dir], f"pytscope trace: cannot write {args.output}")
    run = _load(args.run_dir)
    if run.arrays.n_steps == 0:
        raise UsageError(f"pytscope trace: {args.run_dir} holds no step records yet (nothing to trace)")
    summary = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings))
    try:
        info = write_chrome_trace(run.arrays, args.output, summary.findings, args.max_steps, str(run.path))
    except OSError as exc:
        raise _cannot_write(f"pytscope trace: cannot write {args.output}", exc) from None
    kept = (
        f"all {info.steps_total} steps"
        if info.steps_written == info.steps_total
        else f"the latest {info.steps_written} of {info.steps_total} steps (from step {info.first_step})"
    )
    print(
        f"wrote {info.path}: {info.events} events, {info.ranks} ranks, {kept}; open it in https://ui.perfetto.dev"
    )
    return EXIT_OK


def _import_object(spec: str, what: str) -> Any:
    import importlib
    import os

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"pytscope equivalence: {what} must be MODULE:NAME, got {spec!r}")
    if os.getcwd() not in sys.path:  # as `python -m` would: the user's modules sit in the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module may fail in any way while importing; one line, exit 2
        raise UsageError(f"pytscope equivalence: cannot import {module_name!r}: {exc}") from None
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise UsageError(f"pytscope equivalence: {module_name!r} has no {attribute!r}") from None


def cmd_equivalence(args: argparse.Namespace) -> int:
    from .equivalence import (
        EquivalenceError,
        EquivalenceSetupError,
        WorkerError,
        check_equivalence,
        render_equivalence,
    )

    model_factory = _import_object(args.factory, "the model factory")
    loss_fn = _import_object(args.loss, "--loss")
    make_batch = _import_object(args.batch, "--batch")
    try:
        batch = make_batch()
    except Exception as exc:  # the user's function, run for its return value only
        raise UsageError(f"pytscope equivalence: {args.batch} raised {type(exc).__name__}: {exc}") from None
    try:
        result = check_equivalence(
            model_factory,
            loss_fn,
            batch,
            world_size=args.world_size,
            steps=args.steps,
            rtol=args.rtol,
            atol=args.atol,
        )
    except EquivalenceError as exc:
        result = exc.result
    except (EquivalenceSetupError, WorkerError) as exc:
        raise UsageError(f"pytscope equivalence: {exc}") from None
    _console().print(render_equivalence(result))
    return EXIT_OK if result.passed else EXIT_FINDINGS


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "report": cmd_report,
    "demo": cmd_demo,
    "compare": cmd_compare,
    "scaling": cmd_scaling,
    "trace": cmd_trace,
    "equivalence": cmd_equivalence,
}


def build_parser() -> argparse.ArgumentParser:
    from .demo import SCENARIOS
    from .equivalence import DEFAULT_ATOL, DEFAULT_RTOL

    parser = _Parser(prog="pytscope", description="Why is my PyTorch training slow or unhealthy?")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("report", help="summarise a run directory")
    p.add_argument("run_dir", type=_path)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--fail-on", type=_severity, metavar="SEVERITY", help="exit 1 if a finding is at least this severe"
    )
    p.add_argument("--plots", type=_path, metavar="DIR", help="also write PNG plots into DIR")

    p = sub.add_parser("demo", help="run a small multi-process CPU job with a fault injected, then report")
    p.add_argument("--scenario", choices=SCENARIOS, default="straggler")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--run-dir", type=_path, default=None)

    p = sub.add_parser("compare", help="what changed between two runs (timing, phases, findings)")
    p.add_argument("run_a", type=_path)
    p.add_argument("run_b", type=_path)
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument(
        "--fail-on-regression",
        type=_nonnegative,
        metavar="PCT",
        help="exit 1 if B is more than PCT percent slower than A: in time per sample when both runs recorded "
        "their batch sizes, else in mean step time",
    )

    p = sub.add_parser("scaling", help="throughput, speedup and efficiency over runs at 1, 2, 4 ... workers")
    p.add_argument("run_dirs", nargs="+", type=_path, metavar="RUN_DIR")
    p.add_argument("--json", action="store_true", help="print the points as JSON")
    p.add_argument(
        "--plot", type=_path, metavar="FILE.png", help="write throughput and efficiency against workers"
    )
    p.add_argument(
        "--target-loss", type=float, metavar="X", help="also time and worker-seconds to reach loss X"
    )
    p.add_argument(
        "--weak",
        action="store_true",
        help="the per-rank batch is held on purpose (check it instead of the global batch)",
    )

    p = sub.add_parser("trace", help="per-rank timeline of phases in Chrome trace format (Perfetto)")
    p.add_argument("run_dir", type=_path)
    p.add_argument("-o", "--output", type=_path, required=True, metavar="FILE.json")
    p.add_argument(
        "--max-steps", type=int, default=20_000, help="keep only the latest N steps (default 20000)"
    )

    p = sub.add_parser(
        "equivalence", help="check that W DDP workers compute what one process does on the same batch"
    )
    p.add_argument("factory", metavar="MODULE:FACTORY", help="builds the model")
    p.add_argument("--loss", required=True, metavar="MODULE:FN", help="loss_fn(output, targets)")
    p.add_argument(
        "--batch", required=True, metavar="MODULE:FN", help="returns the global batch (inputs, targets)"
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--rtol", type=_nonnegative, default=DEFAULT_RTOL, help=f"default {DEFAULT_RTOL:g}")
    p.add_argument("--atol", type=_nonnegative, default=DEFAULT_ATOL, help=f"default {DEFAULT_ATOL:g}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .output import PipeSafeStdout

    stdout = sys.stdout
    if stdout is not None:  # (None: started with its standard output closed)
        with contextlib.suppress(AttributeError, ValueError):  # (not a text stream that can be reconfigured)
            stdout.reconfigure(errors="replace")  # type: ignore[union-attr]  # bars on an ASCII terminal: "?"
        sys.stdout = PipeSafeStdout(stdout)
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(str(exc).splitlines()[0] if str(exc) else "pytscope: bad input", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    finally:
        if stdout is not None:
            sys.stdout.flush()
            sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
