"""The `pytscope` command: re-read any run (report), or run a small faulty job to see what it finds (demo).

Bad input (a missing or junk run directory, bad arguments) exits 2 with one line on stderr, never a
traceback; `--fail-on` exits 1 when a finding is at least that severe.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
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
    data = summary.to_dict()
    if run.problems:
        data.setdefault("scope", {})["read_problems"] = run.problems
    if args.json:
        print(json.dumps(data, indent=1, allow_nan=False))
    else:
        from .render import render_summary

        console = _console()
        console.print(render_summary(summary))
        for problem in run.problems:
            console.print(f"[yellow]note:[/] {problem}")
        if getattr(args, "plots", None):
            from .plots import write_report_plots

            for path in write_report_plots(run, args.plots):
                console.print(f"wrote {path}")
    if args.fail_on is not None and any(f.severity >= args.fail_on for f in summary.findings):
        return EXIT_FINDINGS
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    if args.ranks < 1:
        raise UsageError("pytscope demo: --ranks must be at least 1")
    console = _console()
    console.print(
        f"[bold]pytscope demo[/]: {args.ranks} CPU processes (gloo, DDP), scenario [bold]{args.scenario}[/]"
    )
    path = run_demo(args.scenario, ranks=args.ranks, steps=args.steps, run_dir=args.run_dir)
    if args.scenario == "hang":  # the ranks were ended before they could print the summary
        from .render import render_summary
        from .rundir import load_run
        from .summary import summarize

        run = load_run(path)
        console.print(
            render_summary(summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings)))
        )
    console.print(f"\nre-read it any time: [bold]pytscope report {path}[/]")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"report": cmd_report, "demo": cmd_demo}


def build_parser() -> argparse.ArgumentParser:
    from .demo import SCENARIOS

    parser = _Parser(prog="pytscope", description="Why is my PyTorch training slow or unhealthy?")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("report", help="summarise a run directory")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--fail-on", type=_severity, metavar="SEVERITY", help="exit 1 if a finding is at least this severe"
    )
    p.add_argument("--plots", metavar="DIR", help="also write PNG plots into DIR")

    p = sub.add_parser("demo", help="run a small multi-process CPU job with a fault injected, then report")
    p.add_argument("--scenario", choices=SCENARIOS, default="straggler")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--run-dir", default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(str(exc).splitlines()[0] if str(exc) else "pytscope: bad input", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
