"""Live output shares the console with the training's progress bars (Lightning's tqdm bar, a loop's own
`tqdm(loader)`): what pytscope prints starts on a line of its own, and the bars are drawn again after it."""

from __future__ import annotations

import contextlib
import io
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm  # (a dependency of Lightning's and Accelerate's)

from pytscope_core.findings import Finding, Severity
from pytscope_core.output import progress_bars_cleared, say, say_last, show
from pytscope_core.reporter import RunReporter


def finding() -> Finding:
    return Finding("DIST.STRAGGLER", Severity.HIGH, "Rank 1 is a straggler", "1.2 ms per step", "Balance it")


def line_before(text: str, marker: str) -> str:
    """What stands on the same output line before `marker` (a carriage return starts the line again)."""
    head = text[: text.index(marker)]
    return head[head.rfind("\n") + 1 :].rsplit("\r", 1)[-1]


def drawn_bar() -> tqdm:
    bar = tqdm(total=10, file=sys.stdout, ascii=True, mininterval=0, miniters=1, desc="Epoch 0")
    bar.update(3)
    return bar


def test_a_live_finding_starts_on_its_own_line_and_the_bar_is_drawn_again_after_it(tmp_path, capsys):
    reporter = RunReporter(tmp_path / "run", {"world_size": 2}, console=True)
    bar = drawn_bar()
    try:
        reporter.findings([finding()], step=50)
        text = capsys.readouterr().out
        assert "Epoch 0" in text[: text.index("pytscope step 50")]  # the bar was on screen
        assert line_before(text, "pytscope step 50").strip() == ""  # ...and was cleared first
        assert "3/10" in text[text.index("Balance it") :]  # ...and is drawn again after
    finally:
        bar.close()
        reporter.close()


def test_a_bar_of_a_subclass_that_made_its_own_lock_first_is_cleared_too(tmp_path, capsys, monkeypatch):
    monkeypatch.delattr(tqdm, "_lock", raising=False)  # no tqdm bar yet in this process

    class LightningStyleBar(tqdm):  # (Lightning's bar derives from tqdm.auto's)
        pass

    bar = LightningStyleBar(total=10, file=sys.stdout, ascii=True, mininterval=0, miniters=1, desc="Epoch 0")
    bar.update(3)
    try:
        with progress_bars_cleared(wait_s=0.2):
            print("pytscope step 50:")
        assert line_before(capsys.readouterr().out, "pytscope step 50:").strip() == ""
    finally:
        bar.close()


@contextlib.contextmanager
def held_elsewhere(lock: Any) -> Iterator[None]:
    """`lock` held by another thread for the block: a bar stuck writing (its reader stopped reading)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        held.wait(5)
        yield
    finally:
        release.set()
        holder.join()


def test_a_stuck_bar_of_a_subclass_delays_a_print_by_the_wait_and_no_lock_is_made(monkeypatch):
    monkeypatch.delattr(tqdm, "_lock", raising=False)  # only the subclass has made its lock

    class LightningStyleBar(tqdm):
        pass

    bar = LightningStyleBar(total=10, file=sys.stdout, ascii=True, mininterval=0, miniters=1)
    try:
        with held_elsewhere(LightningStyleBar.get_lock()):
            t0 = time.monotonic()
            with progress_bars_cleared(wait_s=0.2):
                print("pytscope: said anyway")
            assert time.monotonic() - t0 < 5 and "_lock" not in vars(tqdm)  # (tqdm's own state left alone)
    finally:
        bar.close()


def test_a_closed_stderr_never_stops_what_comes_after_a_line(monkeypatch):
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    say(1, "a warning")  # (no exception: a hang's abort exits right after its last line)
    say_last(0, "hang detected")


def test_a_warning_on_stderr_clears_a_bar_on_stdout_too(capsys):
    bar = drawn_bar()
    try:
        capsys.readouterr()
        say(1, "a warning")
        out, err = capsys.readouterr()
        assert err == "pytscope[rank 1]: a warning\n"
        assert out.startswith("\r") and "3/10" in out  # the bar cleared, and drawn again after
    finally:
        bar.close()


def test_a_bar_holding_its_lock_delays_a_print_by_the_wait_at_most(capsys):
    bar = drawn_bar()
    try:
        with held_elsewhere(tqdm.get_lock()):
            t0 = time.monotonic()
            with progress_bars_cleared(wait_s=0.2):
                print("pytscope: said anyway")
            assert time.monotonic() - t0 < 5
            assert "pytscope: said anyway" in capsys.readouterr().out
        with progress_bars_cleared(wait_s=0.2):  # the locks were given back: this print clears the bar again
            print("pytscope: next")
        assert line_before(capsys.readouterr().out, "pytscope: next").strip() == ""
    finally:
        bar.close()


def test_without_a_bar_the_output_is_exactly_what_was_printed(capsys):
    with progress_bars_cleared():
        print("pytscope: plain")
    assert capsys.readouterr().out == "pytscope: plain\n"


def test_a_live_finding_goes_above_a_rich_progress_display_through_its_console(monkeypatch):
    import rich
    from rich.console import Console
    from rich.progress import Progress

    terminal = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(rich, "_console", terminal)  # the global console, as Lightning's RichProgressBar uses
    ours = Console(file=io.StringIO(), width=80)
    progress = Progress(console=rich.get_console(), auto_refresh=False)
    progress.start()
    try:
        progress.add_task("Epoch 0", total=10, completed=3)
        progress.refresh()
        show(ours, "pytscope step 50:", "[LOW] a finding")
        progress.refresh()
    finally:
        progress.stop()
    text = terminal.file.getvalue()
    assert ours.file.getvalue() == ""  # not written past the display, straight into the terminal
    assert "Epoch 0" in text[: text.index("pytscope step 50:")]
    assert line_before(text, "pytscope step 50:") == "\x1b[2K"  # the display's line was erased first
    assert text.index("[LOW] a finding") < text.rindex("Epoch 0")  # ...and it is drawn again below


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_another_ranks_line_starts_a_line_of_its_own_in_a_terminal_shared_with_rank_0s_bar(monkeypatch):
    for stream, rank, expected in (
        (Terminal(), 1, "\npytscope[rank 1]: hi\n"),
        (Terminal(), 0, "pytscope[rank 0]: hi\n"),  # (rank 0 clears its own bars)
        (io.StringIO(), 1, "pytscope[rank 1]: hi\n"),  # a log file: no empty lines
    ):
        monkeypatch.setattr(sys, "stderr", stream)
        say(rank, "hi")
        assert stream.getvalue() == expected


def test_the_last_line_before_a_hang_abort_leaves_the_bars_cleared(capsys):
    bar = drawn_bar()
    try:
        capsys.readouterr()
        say_last(0, "hang detected: every rank exits with code 86 (on_hang='abort')")
        out, err = capsys.readouterr()
        assert err.startswith("pytscope[rank 0]: hang detected")
        assert out.startswith("\r") and "3/10" not in out  # cleared, and not drawn again before the exit
    finally:
        bar.close()


def test_a_rank_with_nothing_to_say_at_a_hang_abort_still_leaves_the_bars_cleared(capsys):
    bar = drawn_bar()
    try:
        capsys.readouterr()
        say_last(1, None)
        out, err = capsys.readouterr()
        assert err == "" and out.startswith("\r") and "3/10" not in out
    finally:
        bar.close()


def test_the_last_line_before_a_hang_abort_shows_the_cursor_a_rich_display_hid(monkeypatch):
    import rich
    from rich.console import Console
    from rich.progress import Progress

    terminal = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(rich, "_console", terminal)
    progress = Progress(console=rich.get_console(), auto_refresh=False)
    progress.start()  # hides the cursor
    try:
        progress.add_task("Epoch 0", total=10, completed=3)
        progress.refresh()
        say_last(0, "hang detected")
        text = terminal.file.getvalue()
        assert text.rindex("\x1b[?25h") > text.rindex("\x1b[?25l") and text.endswith("\n")
    finally:
        progress.stop()


def test_the_run_directory_line_is_never_broken_inside_the_command(tmp_path, capsys):
    import numpy as np

    from pytscope_core.records import COL, NCOLS

    run_dir = tmp_path / (
        "a-long-run-directory-name-" * 3
    )  # longer than the 80 columns of a stand-in console
    reporter = RunReporter(run_dir, {"world_size": 1, "warmup": 0}, console=True)
    rows = np.full((3, NCOLS), 1.0)
    rows[:, COL["rank"]], rows[:, COL["segment"]], rows[:, COL["step"]] = 0, 0, [1, 2, 3]
    reporter.rows(rows)
    reporter.summary()
    reporter.close()
    assert f"(pytscope report {run_dir})" in capsys.readouterr().out
