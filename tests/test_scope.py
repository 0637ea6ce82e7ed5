"""The torch-level Scope in one process: a real model, loader, optimizer; and the demo's scenarios."""

import functools
import json
import math
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pytscope_core import Scope, backward
from pytscope_core.backward import OUTPUT_TRIAL
from pytscope_core.cli import main
from pytscope_core.live import LIVE_STEPS
from pytscope_core.recorder import StepRecorder
from pytscope_core.records import COL, PHASES
from pytscope_core.rundir import load_run, read_events, read_rows
from pytscope_core.scope import disabled_message
from pytscope_core.summary import summarize
from pytscope_core.timeline import Mark


def run_job(tmp_path, script):
    """Run `script` as a training process of its own (hang and signal paths end the process)."""
    (tmp_path / "job.py").write_text(script)
    return subprocess.run(
        [sys.executable, str(tmp_path / "job.py")], capture_output=True, text=True, timeout=60
    )


def train(run_dir, epochs=2, steps_per_epoch=40, accumulate=1, eval_s=0.0, **options):
    torch.manual_seed(0)
    x = torch.randn(steps_per_epoch * accumulate * 16, 8)
    y = x @ torch.randn(8, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    scope = Scope(run_dir, console=False, hang_timeout=None, interval=25, **options)
    scope.watch(model, opt, loader)
    for _ in range(epochs):
        for i, (xb, yb) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(xb), yb) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
                scope.log(loss=loss * accumulate)
        with scope.paused():
            sum(model(xb).sum().item() for xb, _ in loader)  # an evaluation pass between epochs
            time.sleep(eval_s)  # ...as long as the test needs it to be
    return scope, model, loader


def watched_linear(run_dir, state=None, **options):
    """A Linear(8, 1) with SGD under a fresh scope (from a saved `state` if given): (scope, model, opt)."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(run_dir, console=False, hang_timeout=None, **options)
    if state is not None:
        scope.load_state_dict(state)
    scope.watch(model, opt)
    return scope, model, opt


def linear_steps(model, opt, n=1):
    """`n` optimizer steps of `watched_linear`'s model on random batches of 4."""
    for _ in range(n):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_steps_trained_after_a_sigterm_are_written_too_under_the_sigterm(tmp_path):
    # Lightning's SIGTERM handler lets the batch in flight finish, then raises: the scope's own handler has
    # written this rank's rows by then, and the step trained after the signal must not be lost.
    scope, model, opt = watched_linear(tmp_path, interval=50)
    linear_steps(model, opt, 20)
    scope.session._on_sigterm()  # (what the signal runs)
    linear_steps(model, opt)
    scope.session._on_sigterm()  # a second signal, nothing new: nothing written again
    scope.stop("the fit raised SIGTERMException")
    run = load_run(tmp_path)
    assert list(run.arrays.steps) == list(range(1, 22))
    assert dict(run.context.rank_notes)[0].startswith("SIGTERM")
    assert (tmp_path / "ranks" / "rank0.jsonl").read_text().count("\n") == 2


def test_an_exception_after_a_hang_that_cleared_is_the_reason_the_rows_end(tmp_path):
    # on_hang="report": the rank's rows were written under "hang", training went on, then the rank raised.
    scope, model, opt = watched_linear(tmp_path, interval=50)
    linear_steps(model, opt, 10)
    scope.session.own_rows.flush("hang")
    linear_steps(model, opt, 10)
    scope.stop("the process raised RuntimeError: boom")
    run = load_run(tmp_path)
    assert dict(run.context.rank_notes)[0] == "the process raised RuntimeError: boom"
    assert [f.reason for f in run.context.failures] == ["the process raised RuntimeError: boom"]


def test_single_process_run_records_every_step_and_reports(tmp_path):
    scope, model, loader = train(tmp_path, epochs=3)
    summary = scope.finish()
    assert summary is not None and scope.finish() is summary  # a second finish is harmless
    run = load_run(tmp_path)
    assert run.arrays.n_steps == 120 and run.arrays.world_size == 1
    assert (run.arrays.samples == 16).all() and (run.arrays.micro_batches == 1).all()
    data = summarize(run.arrays, run.context).to_dict()
    assert data["convergence"]["trend"] == "improving"
    assert abs(sum(p["share"] for p in data["timing"]["phases"].values()) - 1) < 1e-9
    assert (
        data["timing"]["phases"]["forward"]["share"] > 0 and data["timing"]["phases"]["backward"]["share"] > 0
    )
    # The hooks are gone after finish: the user's objects are as they were.
    assert "forward" not in model.__dict__ and type(loader) is DataLoader
    assert (tmp_path / "summary.json").exists() and "Findings" in (tmp_path / "summary.txt").read_text()


def test_gradient_accumulation_window_is_one_step(tmp_path):
    scope, _, _ = train(tmp_path, epochs=1, steps_per_epoch=10, accumulate=4)
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 10 and (arrays.micro_batches == 4).all() and (arrays.samples == 64).all()


def test_evaluation_between_epochs_is_not_charged_to_a_step(tmp_path):
    # An evaluation of 50 ms or more, against steps of well under a millisecond: a slack of 25 ms holds
    # however busy the cores, and an evaluation charged to the step would still exceed it.
    scope, _, _ = train(tmp_path, epochs=2, steps_per_epoch=30, eval_s=0.05)
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.excluded_ms[30, 0] >= 50  # the first step of epoch 2 carries the paused evaluation
    assert arrays.wall_ms[30, 0] - arrays.excluded_ms[30, 0] < 25


class SkewedClock:
    """The host clock, and seconds that pass where the test says so, at no cost."""

    def __init__(self):
        self.skew_ns = 0

    def now(self):
        return time.perf_counter_ns() + self.skew_ns

    @staticmethod
    def to_ms(stamps):
        return [s / 1e6 for s in stamps]


def test_work_after_a_loop_left_at_its_step_limit_is_not_the_last_steps(tmp_path, one_rank_group):
    # Accelerate's usual ending: `break` at max_train_steps, an evaluation whose metric is gathered, a wait for
    # every rank, a save. No fetch comes to close the last step, and each collective marked into it: closed at
    # its last mark, it ran on to the barrier, a stall on every rank.
    import torch.distributed as dist

    clock = SkewedClock()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(320, 8), torch.randn(320, 1)), batch_size=16)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5).watch(model, opt, loader)
    scope.recorder.use_clock(clock, lambda: 0.0)
    for step, (xb, yb) in enumerate(loader, 1):
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(torch.ones(1))  # a metric logged in every step, the last one's too
        if step == 12:
            break
    clock.skew_ns += 10**10
    model(xb)  # a held-out batch's loss, in training mode and with gradients
    model.eval()
    with torch.no_grad():
        for xb in torch.randn(3, 16, 8):
            clock.skew_ns += 10**10  # ten seconds of evaluation a batch
            dist.all_reduce(model(xb).sum())  # its metric gathered
    clock.skew_ns += 10**10
    dist.barrier()  # before saving
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 12 and arrays.wall_ms.max() < 5_000 and arrays.loop_comm_ms[-1, 0] == 0
    assert (arrays.micro_batches == 1).all()
    assert arrays.loop_comm_ms[:-1, 0].min() > 0  # (the loop's collectives are timed: it is not untested)


def test_resume_from_state_dict_continues_the_run(tmp_path):
    scope, _, _ = train(tmp_path, epochs=1, steps_per_epoch=30)
    state = scope.state_dict()
    assert state["step"] == 30 and json.loads(json.dumps(state)) == state  # plain and small
    scope.finish()
    resumed = Scope(console=False, hang_timeout=None)
    resumed.load_state_dict(state)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    resumed.watch(model, opt)
    linear_steps(model, opt, 20)
    resumed.finish()
    assert resumed.run_dir == tmp_path
    data = summarize(load_run(tmp_path).arrays, load_run(tmp_path).context).to_dict()
    assert data["run"]["steps"] == 50 and data["run"]["restarts"] == 1


@pytest.mark.parametrize("state", [{"step": "20", "grad_syncs": None}, {"run_dir": 3}, ["not", "a", "dict"]])
def test_a_saved_state_that_cannot_be_read_disables_the_scope_never_the_training(tmp_path, state, capsys):
    scope = Scope(tmp_path, console=False, hang_timeout=None)
    scope.load_state_dict(state)  # (a damaged checkpoint, or another version's)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope.watch(model, opt)
    linear_steps(model, opt, 3)
    scope.finish()
    assert not scope.enabled and "a saved pytscope state that cannot be read" in capsys.readouterr().err


def test_gathers_come_every_interval_optimizer_steps_when_each_step_syncs_several_times(
    tmp_path, one_rank_group
):
    # Gradient accumulation without no_sync(): four all-reduces per optimizer step. Gathers meet on the
    # all-reduce count (the same on every rank), but `interval` stays a number of optimizer steps.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5).watch(model, opt)
    for _ in range(20):
        for _ in range(4):
            model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    # The first at 5 all-reduces (step 2), where rank 0 learns the 4 syncs per step it tells every rank; then
    # after steps 5, 10 and 15 (the one after step 20 never comes: the run ends there).
    assert scope.coordinator.gathers == 4
    scope.finish()
    assert load_run(tmp_path).arrays.grad_syncs.sum() == 80


def test_ranks_whose_watched_loaders_differ_in_length_are_named_at_the_start(tmp_path, monkeypatch):
    # Rank 1's shard is one batch short (another rank's loader length is faked: one process here).
    from pytscope_core.coordinator import Coordinator

    gathered = []

    def every_rank(self, values):
        gathered.append(values)
        return [values, [values[0] - 1, *values[1:]]]  # (with whether rank 0 set the run up: it did)

    monkeypatch.setattr(Coordinator, "all_gather_ints", every_rank)
    scope, model, loader = train(tmp_path, epochs=1)
    scope.finish()
    assert gathered == [[len(loader), True]]  # once, at the start
    (uneven,) = [f for f in scope.summary.findings if f.code == "DATA.UNEVEN_SHARDS"]
    assert uneven.ranks == (1,) and uneven.severity.name == "HIGH"
    assert "DATA.UNEVEN_SHARDS" in {
        f["code"] for f in json.loads((tmp_path / "summary.json").read_text())["findings"]
    }


def test_a_resumed_launch_diagnoses_live_with_the_runs_warm_up(tmp_path):
    # The final report leaves out meta.json's warm-up (the first launch's) from every segment; the live
    # diagnosis took the resumed launch's own option, and judged other steps than the report.
    scope, model, opt = watched_linear(tmp_path, warmup=5)
    linear_steps(model, opt, 12)
    state = scope.state_dict()
    scope.finish()
    resumed, model, opt = watched_linear(tmp_path, state, warmup=2)
    linear_steps(model, opt, 3)
    assert resumed.session is not None and resumed.session.live.warmup == 5
    resumed.finish()


def test_two_resumes_from_the_same_checkpoint_are_two_segments(tmp_path):
    # Preempted again before the next checkpoint: both launches resume from the step-20 state.
    def launch(state, steps):
        scope, model, opt = watched_linear(tmp_path, state, interval=10)
        saved = None
        for _ in range(steps):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if scope.recorder.steps_done == 19:  # the checkpoint at the end of step 20
                saved = scope.state_dict()
        scope.finish()
        return saved or scope.state_dict()

    state = launch(None, 30)
    assert state["step"] == 20
    launch(state, 15)
    launch(state, 20)
    run = load_run(tmp_path)
    rows = np.vstack([run.arrays.steps, run.arrays.segment[:, 0]]).T.tolist()
    assert rows == [[s, 0] for s in range(1, 21)] + [[s, 2] for s in range(21, 41)]
    assert [s.index for s in run.context.segments] == [0, 1, 2]
    assert summarize(run.arrays, run.context).to_dict()["run"]["restarts"] == 2


def test_an_internal_error_disables_the_scope_and_training_goes_on(tmp_path, capsys):
    scope, model, loader = train(tmp_path, epochs=1, steps_per_epoch=5)
    scope.recorder.mark = None  # the next hook call raises inside the scope
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for xb, _ in loader:
        model(xb).sum().backward()
        opt.step()
    assert not scope.enabled and "scope disabled, training continues" in capsys.readouterr().err
    scope.finish()


def test_a_disabled_scope_never_calls_the_training_hung(tmp_path):
    # After an internal error the hooks stop marking; the watchdog must stop too, or it would see no
    # progress and end a healthy job as hung.
    script = textwrap.dedent(f"""
        import time, torch
        from pytscope_core import Scope
        model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = Scope({str(tmp_path)!r}, console=False, hang_timeout=1.0)
        scope.watch(model, opt)
        end = time.monotonic() + 4.0
        step = 0
        while time.monotonic() < end:
            step += 1
            if step == 5:
                scope.recorder.forward_ended = None  # the next hook call raises inside the scope
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
            time.sleep(0.01)
        assert not scope.enabled
        scope.finish()
        print("trained", step)
    """)
    proc = run_job(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    assert "trained" in proc.stdout and "scope disabled, training continues" in proc.stderr


def test_stuck_single_process_loop_is_reported_with_its_stack_but_never_ended(tmp_path):
    # One process idle for hang_timeout: no peer waits for it, so no hang can be proven (a long evaluation in
    # the loop looks the same). Said, with its stack, as MED; the process goes on and ends on its own.
    script = textwrap.dedent(f"""
        import time, torch
        from pytscope_core import Scope
        model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = Scope({str(tmp_path)!r}, console=False, hang_timeout=2.0)
        scope.watch(model, opt)
        for step in range(1, 20):
            if step == 8:
                t = time.monotonic()
                while time.monotonic() - t < 6.0:
                    pass  # stuck
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        scope.finish()
    """)
    proc = run_job(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    run = load_run(tmp_path)
    findings = summarize(run.arrays, run.context).findings
    assert run.context.hang_reports[0]["title"].startswith("no rank has progressed")
    (stall,) = [f for f in findings if f.code == "TIMING.STALL"]  # the run went on: a stall, not a hang
    assert stall.severity.name == "MED" and "as a hang at the time (no rank has progressed" in stall.detail
    assert "DIST.HANG" not in {f.code for f in findings}
    assert "stuck" in (tmp_path / "stacks" / "rank0.txt").read_text()


@pytest.mark.multiproc
@pytest.mark.parametrize("scenario, code", [("input", "DATA.INPUT_BOUND"), ("spike", "CONVERGENCE.SPIKE")])
def test_demo_scenarios_find_their_fault(tmp_path, capsys, scenario, code):
    from pytscope_core.rundir import RunWriter

    run = tmp_path / "run"
    if (
        scenario == "spike"
    ):  # --run-dir holds an earlier run: the demo's own goes beside it, and is the one named
        RunWriter(run, {"world_size": 1}).close()
    assert main(["demo", "--scenario", scenario, "--run-dir", str(run)]) == 0
    if scenario == "spike":
        run = tmp_path / "run-2"
        assert f"pytscopereport{run}" in "".join(capsys.readouterr().out.split())  # (rich wraps long lines)
    capsys.readouterr()
    assert main(["report", str(run), "--json"]) == 0
    found = {f["code"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert code in found
    if scenario == "spike":
        from pytscope_core.demo import SPIKE_STEPS

        assert set(SPIKE_STEPS) <= set(found[code]["steps"])  # the injected steps, not only their aftermath


# -- one set of options ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(interval=0), "interval"),
        (dict(hang_timeout=-1), "hang_timeout"),
        (dict(on_hang="exit"), "on_hang"),
        (dict(flops_per_step=0), "flops_per_step"),
        (dict(gather_timeout="soon"), "gather_timeout"),
        (dict(console="no"), "console must be True or False"),
        (dict(run_dir=""), "run_dir must not be empty, not '': it would mean the current folder"),
    ],
)
def test_bad_options_fail_at_construction_with_one_clear_message(options, message):
    with pytest.raises(ValueError, match=message):
        Scope(**options)


def test_an_unknown_option_is_refused():
    with pytest.raises(TypeError, match="intervall"):
        Scope(intervall=5)


# -- MFU ----------------------------------------------------------------------------------------------------


def test_mfu_from_given_flops_and_peak(tmp_path):
    scope, _, _ = train(tmp_path, epochs=1, flops_per_step=2e6, peak_flops=1e9)
    summary = scope.finish()
    step_s = summary.timing.mean_ms / 1e3
    assert summary.efficiency.mfu == pytest.approx(2e6 / step_s / 1e9)
    assert json.loads((tmp_path / "meta.json").read_text())["flops_estimated"] is False


def test_flops_are_estimated_on_a_warm_up_step_when_not_given(tmp_path):
    scope, _, _ = train(tmp_path, epochs=1, peak_flops=1e9, warmup=3)
    summary = scope.finish()
    run = load_run(tmp_path)
    # Linear(8, 32) + Linear(32, 1) on 16 samples: forward 2*16*(8*32 + 32*1); backward: weight gradients of
    # both layers and the input gradient of the second (the first layer's input needs none): 2x forward
    # less the first layer's input gradient.
    forward = 2 * 16 * (8 * 32 + 32 * 1)
    backward = 2 * 16 * (8 * 32) + 2 * 2 * 16 * (32 * 1)
    assert run.meta["flops_estimated"] is True
    assert run.context.flops_per_step == forward + backward
    assert summary.efficiency.mfu is not None and summary.efficiency.mfu > 0


@pytest.mark.parametrize("ends", ["in an evaluation", "at finish"])
def test_the_flop_count_ends_with_its_step_when_training_stops_first(tmp_path, ends):
    # The count runs from step 2's first forward to step 3's. An evaluation after step 2 is not counted (nor
    # run under the counter); a run that ends after step 2 keeps its count.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    scope = Scope(tmp_path, console=False, hang_timeout=None, warmup=3)
    scope.watch(model, opt)
    x = torch.randn(16, 8)
    for step in (1, 2, 3, 4) if ends == "in an evaluation" else (1, 2):
        torch.nn.functional.mse_loss(model(x), x[:, :1]).backward()
        opt.step()
        opt.zero_grad()
        if step == 2 and ends == "in an evaluation":
            with scope.paused():
                model(torch.randn(4096, 8))
    scope.finish()
    forward = 2 * 16 * (8 * 32 + 32 * 1)
    backward = 2 * 16 * (8 * 32) + 2 * 2 * 16 * (32 * 1)  # as in the test above
    assert load_run(tmp_path).context.flops_per_step == forward + backward


def test_no_flops_counted_without_warm_up(tmp_path):
    scope, _, _ = train(tmp_path, epochs=1, peak_flops=1e9, warmup=0)
    assert scope.finish().efficiency.mfu is None  # the counted step would be in the statistics


# -- live and final diagnosis judge the same facts ------------------------------------------------------------


def test_live_memory_pressure_fires_where_the_final_report_has_it(tmp_path):
    from pytscope_core.clocks import HostClock
    from pytscope_core.session import _host_memory

    limit = _host_memory()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=20, warmup=2)
    scope.recorder.use_clock(HostClock(), lambda: 0.95 * limit)  # a process near the limit
    scope.watch(model, opt)
    live_codes = set()
    for _ in range(60):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        live_codes |= {f.code for f in scope.findings}
    final = {f.code for f in scope.finish().findings}
    assert "MEMORY.PRESSURE" in live_codes and "MEMORY.PRESSURE" in final


# -- a disabled scope ---------------------------------------------------------------------------------------


def test_a_disabled_scope_records_nothing_more_on_any_path(tmp_path):
    scope, model, loader = train(tmp_path, epochs=1, steps_per_epoch=5)
    scope.fail(RuntimeError("injected"))
    closed_before = len(scope.recorder.window)  # kept for a last flush, never more
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(200):
        with scope.paused():  # evaluation, checkpointing
            pass
        scope.hooks.data_begin()  # what integrations mark themselves
        scope.hooks.forward_begin()
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
    progress, _ = scope.recorder.progress()
    assert progress[2] == 0 and len(scope.recorder.window) == closed_before and not scope.recorder.in_step
    scope.finish()


# -- the hang path ------------------------------------------------------------------------------------------


def test_pending_rows_leave_the_recorder_as_it_was(tmp_path):
    # What the watchdog thread (hang) or a signal handler (SIGTERM) reads must not change the training
    # thread's state: the same rows go to the next gather.
    scope, _, _ = train(tmp_path, epochs=1, steps_per_epoch=10)
    rec = scope.recorder
    before = list(rec.window)
    rows = rec.pending_rows(0, 0, 0.0)
    assert rows.shape[0] == len(before) > 0 and rec.window == before
    np.testing.assert_array_equal(rec.drain(0, 0, 0.0), rows)  # NaN where nothing was recorded
    scope.finish()


def test_sigterm_leaves_the_ungathered_steps_behind_and_still_ends_the_process(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from pytscope_core import Scope
        model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = Scope({str(tmp_path)!r}, console=False, hang_timeout=None, interval=50)
        scope.watch(model, opt)
        for step in range(1, 100):
            if step == 80:
                os.kill(os.getpid(), signal.SIGTERM)  # a launcher ending the job
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """)
    proc = run_job(tmp_path, script)
    assert proc.returncode == -15, proc.stderr  # SIGTERM still does what it did: the default ends the process
    run = load_run(tmp_path)
    # Gathered up to 50, then 51-79 from its own file: step 79 finished its optimizer step before the signal.
    assert run.arrays.steps.tolist() == list(range(1, 80))
    summary = summarize(run.arrays, run.context).to_dict()
    reason = "SIGTERM while at step 79 in `after the optimizer step`"  # (where it found the rank)
    assert summary["run"]["rank_ends"] == [{"rank": 0, "last_step": 79, "reason": reason}]


@pytest.mark.parametrize("hang_timeout", [600, None])
def test_a_sigterm_says_where_a_stuck_rank_was(tmp_path, hang_timeout):
    # The launcher's SIGTERM (a job timeout) ends a rank stuck in its forward before any hang_timeout: the
    # run says where it was and for how long (without a watchdog, where only).
    (tmp_path / "job.py").write_text(
        textwrap.dedent(f"""
        import sys, time, torch
        from pytscope_core import Scope
        class Stuck(torch.nn.Linear):
            step = 0
            def forward(self, x):
                if self.step == 30:
                    print("stuck", flush=True); time.sleep(600)
                return super().forward(x)
        model = Stuck(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = Scope({str(tmp_path / "run")!r}, console=False, hang_timeout={hang_timeout}, interval=50)
        scope.watch(model, opt)
        for step in range(1, 100):
            model.step = step
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """)
    )
    proc = subprocess.Popen([sys.executable, str(tmp_path / "job.py")], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "stuck"
        time.sleep(3.0)  # a heartbeat (every second) sees it stuck
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -15
    finally:
        proc.kill()
    run = load_run(tmp_path / "run")
    (end,) = summarize(run.arrays, run.context).to_dict()["run"]["rank_ends"]
    where = "SIGTERM while at step 30 in `forward`" + (" for " if hang_timeout else "")
    assert end["last_step"] == 29 and end["reason"].startswith(where), end


def test_a_flush_cut_short_by_a_second_sigterm_is_done_by_the_next_caller(tmp_path):
    # A second SIGTERM arrives while the first one's handler writes this rank's rows, and the previous
    # handler raises in it (Lightning's broadcasts on a dying group): the write is cut short, and the
    # rank's rows must still be written by the next flush (Lightning's on_exception, the scope's stop).
    script = textwrap.dedent(f"""
        import os, signal, torch
        import pytscope_core.rundir as rundir
        from pytscope_core import Scope
        raised = []
        def launcher_handler(signum, frame):
            if not raised:
                raised.append(1)
                raise RuntimeError("broadcast on a dying group")
        signal.signal(signal.SIGTERM, launcher_handler)
        write = rundir.append_rank_rows
        def write_after_a_second_sigterm(*args, **kwargs):
            rundir.append_rank_rows = write
            os.kill(os.getpid(), signal.SIGTERM)  # handled here, inside the first flush
            return write(*args, **kwargs)
        rundir.append_rank_rows = write_after_a_second_sigterm
        model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = Scope({str(tmp_path)!r}, console=False, hang_timeout=None, interval=50)
        scope.watch(model, opt)
        for step in range(1, 31):
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        os.kill(os.getpid(), signal.SIGTERM)
        assert raised and not (rundir.Path({str(tmp_path)!r}) / "ranks" / "rank0.jsonl").exists()
        scope.session.own_rows.flush("the fit raised RuntimeError")
        os._exit(0)  # ends like a killed job: no final gather
    """)
    proc = run_job(tmp_path, script)
    assert proc.returncode == 0, proc.stderr
    run = load_run(tmp_path)
    assert run.arrays.steps.tolist() == list(range(1, 31))  # step 30 had stepped: its rows are written too
    assert summarize(run.arrays, run.context).to_dict()["run"]["rank_ends"][0]["reason"] == (
        "the fit raised RuntimeError"
    )


def test_the_peak_follows_autocast_in_a_plain_loop(tmp_path):
    # fp32 parameters under bf16 autocast train at the bf16 rate: the bf16 peak is the one MFU divides by.
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=10)
    scope.watch(model, opt)
    for _ in range(12):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 8)).float().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    # (The run starts before the first forward, where autocast is seen: the run learns it, as a meta event.)
    run = load_run(tmp_path)
    assert run.meta["peak_precision"] == "bf16" and run.context.precision == "bf16"
    assert scope.flops.precision == "bf16"


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.heads = torch.nn.ModuleList([torch.nn.Linear(16, 1), torch.nn.Linear(16, 1)])

    def forward(self, x, head=None):
        h = self.trunk(x)
        return self.heads[head](h) if head is not None else (self.heads[0](h), self.heads[1](h))


def _timed_backwards(tmp_path, losses):
    """Train TwoHeads through the output pre-hook's trial (head 0), then with each step's loss from `losses`
    (a function of the model and its input): which of those steps' backwards were timed, the parameters
    whose gradient hooks stayed, and whether the pre-hook did."""
    model = TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=1000)
    scope.watch(model, opt)
    for loss in [losses[0]] * OUTPUT_TRIAL + list(losses):
        loss(model, torch.randn(4, 8)).backward()
        opt.step()
        opt.zero_grad()
    scope.recorder.close()
    timed = [int(Mark.BACKWARD_BEGIN) in step.marks for step in scope.recorder.window][OUTPUT_TRIAL:]
    hooked = {id(p) for p, _ in scope.hooks.backward._grad_hooks}
    output_hook = scope.hooks.backward._output_hook
    scope.finish()
    return model, timed, hooked, output_hook


def _head(i, tuple_output=False):
    return lambda model, x: (model(x)[i] if tuple_output else model(x, i)).sum()


HEADS = (0, 0, 1, 0, 1, 1, 0, 1)


def test_where_the_output_pre_hook_is_not_worth_its_cost_parameter_hooks_learn_each_branch(tmp_path):
    # A tiny model: the gradient reaches the first parameter microseconds after the output, so the per-step
    # pre-hook goes after its trial. Heads used in turn: head 1's first use is unseen, then learnt.
    model, timed, hooked, output_hook = _timed_backwards(tmp_path, [_head(i) for i in HEADS])
    assert not output_hook
    assert timed == [True, True, False, True, True, True, True, True]
    assert hooked == {id(p) for p in model.heads.parameters()}  # both heads' first gradients, not the trunk


def test_where_the_output_pre_hook_stays_no_parameter_hook_does(tmp_path, monkeypatch):
    monkeypatch.setattr(backward, "OUTPUT_MIN_GAP_NS", 0)  # as for a large output layer
    _, timed, hooked, output_hook = _timed_backwards(tmp_path, [_head(i) for i in HEADS])
    assert output_hook and all(timed) and hooked == set()


def test_a_backward_from_an_output_the_pre_hook_is_not_on_is_learnt_at_its_next_use(tmp_path, monkeypatch):
    # The model returns both heads' outputs; the pre-hook is on the first. Losses from head 1 alone go unseen
    # the first time, then head 1's first gradients keep their hooks (not the trunk's, not head 0's).
    monkeypatch.setattr(backward, "OUTPUT_MIN_GAP_NS", 0)
    model, timed, hooked, output_hook = _timed_backwards(
        tmp_path, [_head(i, tuple_output=True) for i in HEADS]
    )
    assert output_hook and timed == [True, True, False, True, True, True, True, True]
    assert hooked == {id(p) for p in model.heads[1].parameters()}


def test_a_new_run_into_a_directory_that_holds_a_run_goes_beside_it(tmp_path, capsys):
    # Running the same script twice with run_dir="runs/exp1": the second run is not a resume (no saved state
    # was loaded), so it must not be merged into the first one's records and metadata.
    train(tmp_path / "exp1", epochs=1, steps_per_epoch=30)[0].finish()
    scope, _, _ = train(tmp_path / "exp1", epochs=1, steps_per_epoch=20)
    scope.finish()
    assert scope.run_dir == tmp_path / "exp1-2"
    assert "holds an earlier run" in capsys.readouterr().err
    assert load_run(tmp_path / "exp1").arrays.n_steps == 30
    assert load_run(tmp_path / "exp1-2").arrays.n_steps == 20  # (a resume continues in place: above)


def test_a_new_run_into_the_current_folder_that_holds_a_run_goes_beside_it(tmp_path, monkeypatch, capsys):
    # run_dir="." twice: the second run disabled its scope (an internal error: "." has no name to number).
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    train(".", epochs=1, steps_per_epoch=30)[0].finish()
    scope, _, _ = train(".", epochs=1, steps_per_epoch=20)
    scope.finish()
    assert scope.enabled and scope.run_dir == tmp_path / "work-2"
    assert "internal error" not in capsys.readouterr().err
    assert load_run(work).arrays.n_steps == 30 and load_run(tmp_path / "work-2").arrays.n_steps == 20


def test_each_step_records_how_many_optimizer_steps_it_held(tmp_path):
    # Two optimizer.step() calls before the next forward fall in one step (the loop top closes it): the
    # record says so, which is how an extra step on one rank shows up (DIST.DESYNC, test_analysis).
    scope, model, opt = watched_linear(tmp_path, interval=5)
    for i in range(8):
        model(torch.randn(2, 8)).sum().backward()
        for _ in range(2 if i == 3 else 1):
            opt.step()
        opt.zero_grad()
    scope.finish()
    assert read_rows(tmp_path)[:, COL["optimizer_steps"]].tolist() == [1, 1, 1, 2, 1, 1, 1, 1]


def test_each_scope_error_is_in_the_run_once(tmp_path):
    # One from before the run directory existed (written when it opens), one from after (written at the end).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    scope.watch(model, opt)
    scope.note("before the run", error=True, warn=False)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    scope.note("after the start", error=True, warn=False)
    scope.fail(RuntimeError("injected"))  # written when the scope disables itself, and not again at the end
    scope.finish()
    (disabled,) = [e for e in load_run(tmp_path).context.scope_errors if "injected" in e]
    assert load_run(tmp_path).context.scope_errors == ("before the run", "after the start", disabled)


def test_tensors_and_numpy_numbers_are_logged_as_numbers_one_line_per_step(tmp_path):
    scope, model, opt = watched_linear(tmp_path, interval=4)
    tokens = torch.zeros(())  # a counter the loop updates in place
    for step in range(10):
        for _ in range(2):  # two micro-batches, each logged: the step keeps the latest values
            loss = model(torch.randn(4, 8)).pow(2).mean()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            tokens += 4
            scope.log(
                loss=np.float32(loss.item()), grad_norm=norm, lr=np.float64(0.01), phase="warm", n=step,
                tokens=tokens, per_layer=torch.tensor([1.0, 3.0]), odd={"a": 1},
            )  # fmt: skip
        opt.step()
        opt.zero_grad()
    scope.log(loss="not a number")  # read as no loss at all: not a non-finite one
    scope.finish()
    assert scope.errors == [] and load_run(tmp_path).arrays.n_steps == 10
    assert np.isfinite(load_run(tmp_path).arrays.loss).all()
    lines = [json.loads(line) for line in (tmp_path / "scalars.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 11))
    assert all(line["segment"] == 0 for line in lines)
    assert all(isinstance(line["grad_norm"], float) and line["lr"] == 0.01 for line in lines)
    assert [line["tokens"] for line in lines] == [8.0 * s for s in range(1, 11)]  # as logged, not as now
    assert lines[-1]["phase"] == "warm" and lines[-1]["n"] == 9.0 and lines[-1]["per_layer"] == 2.0
    assert lines[-1]["odd"] is None
    summary = summarize(load_run(tmp_path).arrays, load_run(tmp_path).context)
    assert "CONVERGENCE.NONFINITE" not in {f.code for f in summary.findings}


def test_a_non_finite_loss_is_said_live_at_once_and_keeps_its_step_after_the_window_moves_on(tmp_path):
    scope, model, opt = watched_linear(tmp_path, interval=10)
    for step in range(1, 1101):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(loss=loss * math.nan if step >= 15 else loss)
    assert 1100 - LIVE_STEPS > 15 + 10  # the live window of recent steps no longer holds step 15
    live = scope.session.live
    live.diagnose(scope.step_label())
    nonfinite = [f for f in live.findings if f.code == "CONVERGENCE.NONFINITE"]
    assert [f.steps for f in nonfinite] == [(15,)]
    scope.finish()
    said = [
        json.loads(line)
        for line in (tmp_path / "events.jsonl").read_text().splitlines()
        if "CONVERGENCE.NONFINITE" in line
    ]
    # Said at the first gather after step 15, though the live diagnosis's time budget would have skipped it.
    assert said[0]["step"] == 20 and said[0]["finding"]["steps"] == [15]


@pytest.mark.parametrize("logged", [10, 150])
def test_a_loop_that_stops_logging_its_loss_has_no_nonfinite_loss_live_or_at_the_end(tmp_path, logged):
    # The loss is logged on the first `logged` steps only; every step trains (a backward, an optimizer step).
    # The records hold NaN for a loss not logged: it read "non-finite at step 11 and never recovered", HIGH.
    scope, model, opt = watched_linear(tmp_path, interval=10)
    for step in range(1, 161):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step <= logged:
            scope.log(loss=loss)
    live = scope.session.live
    live.diagnose(scope.step_label())
    assert "CONVERGENCE.NONFINITE" not in {f.code for f in live.findings}
    scope.finish()
    run = load_run(tmp_path)
    assert np.isnan(run.arrays.loss[logged:]).all() and (run.arrays.micro_batches == 1).all()
    summary = summarize(run.arrays, run.context)
    assert "CONVERGENCE.NONFINITE" not in {f.code for f in summary.findings}
    assert summary.convergence.nonfinite_step is None and summary.convergence.trend.trend != "non-finite"


class _KeyedOutput(dict):
    """A dict-like model output (as ModelOutput classes are): attributes read its keys, so a missing one
    raises KeyError, not AttributeError."""

    def __getattr__(self, name):
        return self[name]


class _KeyedRecord:
    """No mapping, no sequence: an object whose every attribute read raises KeyError."""

    def __getattr__(self, name):
        raise KeyError(name)


class _KeyedModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, batch, extra=None):
        # (A numpy array ahead of the logits: it has a shape and a dtype, and no `requires_grad`.)
        return _KeyedOutput(mask=np.ones((4, 1)), record=_KeyedRecord(), logits=self.linear(batch["x"]))


@pytest.mark.parametrize("loader", [True, False])
def test_a_batch_and_a_model_output_whose_attributes_raise_key_error_are_read_as_such(tmp_path, loader):
    # `getattr(obj, "shape", None)` lets any exception but AttributeError through: a dict-like batch or model
    # output disabled the scope ("internal error, scope disabled, training continues: KeyError: 'shape'"), as
    # did an array in the output ahead of its tensor (`requires_grad` read as a tensor's).
    model = _KeyedModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [_KeyedOutput(x=torch.randn(4, 8)) for _ in range(12)]
    data = DataLoader(batches, batch_size=None) if loader else batches
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    scope.watch(model, opt, data if loader else None)
    for i, batch in enumerate(data):
        out = model(batch=batch, extra=_KeyedRecord()) if i % 2 else model(batch, _KeyedRecord())
        out.logits.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        scope.log(loss=out.logits.pow(2).mean(), record=_KeyedRecord())
    scope.log(loss=_KeyedRecord())  # not a number: no loss, and no error either
    scope.finish()
    assert scope.enabled and scope.errors == []
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 12 and (arrays.samples == 4).all()
    assert (arrays.micro_batches == 1).all() and np.isfinite(arrays.loss).all()
    assert np.isfinite(arrays.batch_fp).any()  # (the fingerprint read the batch too)


def test_a_batch_fed_to_two_watched_models_counts_its_samples_once(tmp_path):
    torch.manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(160, 8), torch.randn(160, 1)), batch_size=16)
    student, teacher = torch.nn.Linear(8, 1), torch.nn.Linear(8, 1)
    opt = torch.optim.SGD([*student.parameters(), *teacher.parameters()], lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    scope.watch(student, opt, loader)
    scope.watch(teacher)
    scope.watch(student, opt, loader)  # watched again: nothing is counted twice
    for xb, yb in loader:
        loss = (student(xb) - teacher(xb)).pow(2).mean() + (student(xb) - yb).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 10 and (arrays.samples == 16).all()
    assert (arrays.micro_batches == 3).all()  # forward passes: the student's two and the teacher's


def _stalled_loop(run_dir, stall, batches=200, stall_from=20, stall_to=None):
    """A one-rank loop over a watched loader whose batches from `stall_from` (to `stall_to`) are, by `stall`:
    "skip" (a guard's `continue` after the forward, on a finite loss), "no step" (a backward, and no optimizer
    step: a window that never closes), or "nan skip" (a guard on a NaN loss: each is a step of its own here).
    Returns the findings events the run holds, in order, and its summary's findings."""
    torch.manual_seed(0)
    loader = DataLoader(
        TensorDataset(torch.randn(batches * 16, 8), torch.randn(batches * 16, 1)), batch_size=16
    )
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(run_dir, console=False, hang_timeout=None, interval=10).watch(model, opt, loader)
    for i, (xb, yb) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        stalled = stall_from <= i < (stall_to or batches)
        if stalled and stall == "nan skip":
            loss = loss * math.nan
        scope.log(loss=loss)
        if stalled and stall != "no step":
            continue
        loss.backward()
        if not stalled:
            opt.step()
            opt.zero_grad()
    summary = scope.finish()
    said = [e["finding"] for e in read_events(run_dir)[0] if e["type"] == "finding"]
    return said, [f for f in summary.to_dict()["findings"] if f["code"] == "CONVERGENCE.SKIPPED_STEPS"]


def test_batches_that_run_on_without_an_optimizer_step_are_said_while_they_do_then_how_it_ended(tmp_path):
    # Under DDP a guard's skipped batches end no step (one rank's NaN loss is not the others'), so no gather,
    # and nothing was said until the run ended. Rank 0 now says it once the stretch is 50 batches long, and
    # again when an optimizer step ends it, or at the run's end.
    said, final = _stalled_loop(tmp_path / "skip", "skip", stall_to=120)
    live = [f for f in said if f["code"] == "CONVERGENCE.SKIPPED_STEPS"]
    assert [f["severity"] for f in live] == ["HIGH", "MED"]
    assert re.fullmatch(r"No optimizer step for 5\d batches since step 20", live[0]["title"])
    assert "0 backwards) after its optimizer step at step 20" in live[0]["detail"]
    assert "guard on a NaN or Inf loss" in live[0]["detail"]
    # Batches 20-119 skipped, batch 120 trained: step 21 is 101 batches long.
    assert live[1]["title"] == "Step 21 ran 101 batches before its optimizer stepped"
    assert [f["title"] for f in final] == [live[1]["title"]]  # the latest word stands in the summary

    said, final = _stalled_loop(tmp_path / "to the end", "skip")
    assert [f["severity"] for f in said if f["code"] == "CONVERGENCE.SKIPPED_STEPS"] == ["HIGH", "HIGH"]
    assert [f["title"] for f in final] == [
        "No optimizer step for 180 batches since step 20, to the end of the run"
    ]

    said, final = _stalled_loop(tmp_path / "no step", "no step")
    (f,) = final
    assert f["title"].endswith("to the end of the run") and "180 backwards" in f["detail"]
    assert "gradients accumulate and no optimizer step comes" in f["detail"]


def test_no_word_of_batches_without_an_optimizer_step_where_steps_end(tmp_path):
    # One rank's guard on a NaN loss: each skipped batch is a step of its own (the run's NONFINITE says it).
    said, final = _stalled_loop(tmp_path / "nan", "nan skip", stall_to=120)
    assert final == [] and all(f["code"] != "CONVERGENCE.SKIPPED_STEPS" for f in said)
    # Accumulation over 64 batches per step: long steps, each as long as the run's others.
    loader = DataLoader(TensorDataset(torch.randn(64 * 5 * 4, 8), torch.randn(64 * 5 * 4, 1)), batch_size=4)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path / "acc", console=False, hang_timeout=None, interval=2).watch(model, opt, loader)
    for i, (xb, yb) in enumerate(loader):
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        if (i + 1) % 64 == 0:
            opt.step()
            opt.zero_grad()
    scope.finish()
    said = [e["finding"]["code"] for e in read_events(tmp_path / "acc")[0] if e["type"] == "finding"]
    assert "CONVERGENCE.SKIPPED_STEPS" not in said


def test_watch_after_finish_says_the_scope_has_ended_and_installs_nothing(tmp_path, capsys):
    scope, model, opt = watched_linear(tmp_path)
    scope.finish()
    fresh = torch.nn.Linear(8, 1)
    assert scope.watch(fresh, opt) is scope
    assert "watch() after finish()" in capsys.readouterr().err and "forward" not in fresh.__dict__


def test_a_loader_another_live_scope_watches_is_said_and_left_to_it(tmp_path, capsys):
    # Two scopes alive on one loader: the loader routes its batches to one of them only. The second says so
    # (steps then open at its model's forward), and finishing it leaves the first one's watch in place.
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=16)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = Scope(tmp_path / "a", console=False, hang_timeout=None).watch(model, opt, loader)
    first.watch(loader=loader)  # the same scope again: nothing to say
    assert "already watched" not in capsys.readouterr().err
    second = Scope(tmp_path / "b", console=False, hang_timeout=None).watch(loader=loader)
    assert "already watched by another Scope that has not finished" in capsys.readouterr().err
    second.finish()
    for xb, yb in loader:
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    first.finish()
    run = load_run(tmp_path / "a")
    assert list(run.arrays.steps) == [1, 2, 3, 4] and (run.arrays.phases[:, 0, 0] > 0).all()  # data waits
    assert type(loader) is DataLoader  # put back as it was


@pytest.mark.parametrize("kind", ["list", "generator"])
def test_a_loader_whose_class_cannot_be_swapped_is_said_and_the_forwards_time_the_steps(
    tmp_path, capsys, kind
):
    # A list of batches, or a generator: its class cannot take the subclass that times each fetch. The scope
    # used to disable itself with "__class__ assignment only supported for mutable types".
    batches = [(torch.randn(16, 8), torch.randn(16, 1)) for _ in range(12)]
    loader = batches if kind == "list" else (b for b in batches)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5).watch(model, opt, loader)
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(loss=loss)
    scope.finish()
    assert scope.enabled and type(loader).__name__ == kind
    err = capsys.readouterr().err
    assert f"the loader given to watch() (a {kind}) cannot be timed in place" in err
    assert "internal error" not in err
    run = load_run(tmp_path)
    assert list(run.arrays.steps) == list(range(1, 13)) and (run.arrays.samples == 16).all()
    assert run.context.scope_notes[0].startswith(f"the loader given to watch() (a {kind})")


def test_a_watched_loader_the_loop_never_iterates_is_said_and_the_forwards_time_the_steps(tmp_path, capsys):
    # As under Accelerate with the loader from before accelerator.prepare() watched and the prepared one
    # iterated: the watched loader opens no step, so without the fallback nothing at all was recorded.
    torch.manual_seed(0)
    x = torch.randn(40 * 16, 8)
    y = x @ torch.randn(8, 1)
    watched, iterated = (DataLoader(TensorDataset(x, y), batch_size=16) for _ in range(2))
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=25).watch(model, opt, watched)
    losses = []
    for xb, yb in iterated:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(loss=loss)
        losses.append(loss.item())
    scope.finish()
    err = capsys.readouterr().err
    assert "the loader given to watch() was not iterated before the first optimizer step" in err
    assert "compiled" not in err  # not blamed on torch.compile
    run = load_run(tmp_path)
    # Every step, the first one too (its forward opened it), under the optimizer step's number.
    assert list(run.arrays.steps) == list(range(1, 41)) and (run.arrays.samples == 16).all()
    assert np.allclose(run.arrays.loss[:, 0], losses)
    # The report says it too (its data wait reads 0), once, as it is read back later by `pytscope report`.
    (note,) = run.context.scope_notes
    assert note.startswith("the loader given to watch() was not iterated") and run.context.scope_errors == ()
    assert summarize(run.arrays, run.context).to_dict()["scope"]["notes"] == [note]
    assert main(["report", str(tmp_path)]) == 0
    assert "was not iterated" in " ".join(capsys.readouterr().out.split())  # (rich wraps long lines)


def test_a_forward_before_the_loop_is_not_the_first_step_and_no_loader_is_said_unseen(tmp_path):
    # A shape probe (or a lazy module's first call) in train mode before the loop: the watched loader is
    # iterated, so nothing is said, and step 1 is the loop's own first batch (its 16 samples, not 16 + 2).
    x, y = torch.randn(640, 8), torch.randn(640, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=10).watch(model, opt, loader)
    model(torch.randn(2, 8))
    for xb, yb in loader:
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    run = load_run(tmp_path)
    assert run.context.scope_notes == () and list(run.arrays.steps) == list(range(1, 41))
    assert (run.arrays.samples == 16).all()


def test_a_model_called_with_keywords_only_still_counts_its_samples(tmp_path):
    # Hugging Face style, `model(**batch)`, with no loader watched: the batch size is read from the keywords.
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.layer(inputs), labels)

    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=10).watch(model, opt)
    for _ in range(20):
        batch = {"inputs": torch.randn(16, 8), "labels": torch.randn(16, 1)}
        model(**batch).backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    assert (load_run(tmp_path).arrays.samples == 16).all()


def test_backward_starts_where_the_gradient_reaches_the_output_so_a_large_head_is_backward(tmp_path):
    # A vocabulary-sized output layer: most of backward is its two gradient matmuls, done before any
    # parameter's gradient is accumulated. Timed from the parameters' hooks alone, that was `other` (5% of
    # loss.backward() was `backward` in a 32k-vocabulary run).
    torch.manual_seed(0)
    # A wide head: its gradient matmuls (128 x 512 x 8000, twice) far outweigh the cross-entropy's own
    # forward and backward, which stay in `other` (at width 128 the two were level, and a busy machine
    # could swap them).
    vocab, width = 8000, 512
    model = torch.nn.Sequential(
        torch.nn.Embedding(vocab, width), torch.nn.Linear(width, width), torch.nn.Linear(width, vocab)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randint(0, vocab, (128,)), torch.randint(0, vocab, (128,))
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=10, warmup=2).watch(model, opt)
    measured = []
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        t0 = time.perf_counter()
        loss.backward()
        measured.append(1e3 * (time.perf_counter() - t0))
        opt.step()
        opt.zero_grad()
        scope.log(loss=loss)
    assert scope.hooks.backward._output_hook and not scope.hooks.backward._grad_hooks  # the trial kept it
    scope.finish()
    run = load_run(tmp_path)
    phases = summarize(run.arrays, run.context).to_dict()["timing"]["phases"]
    assert phases["backward"]["median_ms"] > 0.6 * float(np.median(measured[2:]))
    assert phases["other"]["median_ms"] < phases["backward"]["median_ms"]


def test_a_peer_gone_during_the_scopes_gather_is_not_called_its_internal_error():
    # Another rank raised and its process ended while this one waited in the scope's gather: gloo says the
    # connection closed. The scope stops (it cannot gather any more), but says whose fault it was not.
    gone = disabled_message(
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [::1]:1")
    )
    assert (
        gone.startswith("another rank left the job while this one waited for it") and "scope disabled" in gone
    )
    assert disabled_message(ValueError("x")).startswith("internal error, scope disabled")


@pytest.mark.parametrize("who", ["the rank", "a process it forked", "nobody"])
def test_a_fatal_signal_is_written_where_no_python_runs_and_the_process_dies_as_it_would_have(tmp_path, who):
    # abort() (C++'s std::terminate: gloo on a collective mismatch) ends a process with no Python run: its
    # rank read as killed. faulthandler's dump, into the rank's own file, says how it died and where; the
    # process still dies of SIGABRT. A forked process's crash (a DataLoader worker) is not the rank's, and a
    # run that ends well leaves no file behind.
    script = textwrap.dedent(f"""
        import os, torch
        from pytscope_core import Scope
        model = torch.nn.Linear(4, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scope = Scope({str(tmp_path / "run")!r}, console=False, hang_timeout=None, interval=10)
        scope.watch(model, opt)
        for step in range(1, 31):
            if step == 25 and {who!r} == "a process it forked":
                child = os.fork()
                if child == 0:
                    os.abort()
                os.waitpid(child, 0)
            if step == 25 and {who!r} == "the rank":
                os.abort()
            model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
        scope.finish()
    """)
    proc = run_job(tmp_path, script)
    run = load_run(tmp_path / "run")
    ends = [(e.rank, e.last_step, e.reason) for e in summarize(run.arrays, run.context).run.rank_ends]
    if who == "the rank":
        assert proc.returncode == -signal.SIGABRT, proc.stderr
        assert ends == [(0, 20, "the process died of SIGABRT at job.py line 14")]
    else:
        assert proc.returncode == 0, proc.stderr
        assert ends == [] and not (tmp_path / "run" / "ranks").exists()


def test_a_sigint_is_noted_only_inside_a_worker_that_swallows_it_and_only_over_pythons_own_handler():
    from pytscope_core.signals import SignalChain, swallowing_frame

    spawn = {"__name__": "torch.multiprocessing.spawn"}  # (its worker's wrapper catches KeyboardInterrupt)
    exec("def _wrap(fn):\n    return fn()", spawn)
    assert spawn["_wrap"](swallowing_frame) is not None and swallowing_frame() is None
    seen = []
    chain = SignalChain(lambda: seen.append("noted"), signal.SIGINT, only_over=signal.default_int_handler)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        chain.install()
        with pytest.raises(KeyboardInterrupt):  # what the Ctrl-C did before: unchanged
            signal.raise_signal(signal.SIGINT)
            time.sleep(1)
        chain.restore()
        assert seen == ["noted"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler

        def own(signum, frame):  # a process's own handler (a graceful stop): left alone
            pass

        signal.signal(signal.SIGINT, own)
        chain.install()
        assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_stop_the_training_caused_is_a_note_and_a_limit_is_said_by_rank_0_only(
    tmp_path, capsys, monkeypatch
):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None)
    scope.watch(model, opt)
    for _ in range(3):
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    with monkeypatch.context() as patch:  # as rank 1 says them: a limit is every rank's, an error its own
        patch.setattr(scope.coordinator, "rank", 1)
        scope.note("a limit every rank meets")
        scope.note("an error of this rank's", error=True)
    assert capsys.readouterr().err == "pytscope[rank 1]: an error of this rank's\n"
    summary = scope.stop("the fit raised KeyboardInterrupt")
    assert "stopped without a final gather: the fit raised KeyboardInterrupt" in summary.scope_notes
    assert not any("KeyboardInterrupt" in e for e in summary.scope_errors)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_batch_skipped_after_its_forward_is_no_gradient_sync_and_no_micro_batch(
    tmp_path, one_rank_group, set_to_none
):
    # Out-of-memory recovery: a rank whose forward raised agrees with the others to skip the batch; the
    # others have finished that forward. Counted as a sync on them only, it moved their gathers off the rank
    # that raised: every rank blocked in a different collective.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=1000).watch(model, opt)
    for i in range(12):
        loss = model(torch.randn(4, 8)).sum()
        if i % 4 == 3:  # the batch is skipped on this rank, as on the one that raised
            opt.zero_grad(set_to_none=set_to_none)  # (zeroed in place: a change of the gradients' version)
            continue
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.grad_syncs.sum() == 9 and arrays.micro_batches.sum() == 9


def test_a_backward_that_raised_leaves_later_forwards_and_backwards_timed(tmp_path):
    fail = [False]

    class Fragile(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            if fail[0]:
                raise RuntimeError("out of memory")
            return grad

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(Fragile.apply(self.a(x)))  # backward has begun when it raises

    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt)
    for i in range(30):
        loss = model(torch.randn(4, 8)).sum()
        fail[0] = i == 10
        try:
            loss.backward()
        except RuntimeError:
            opt.zero_grad()
            continue
        opt.step()
        opt.zero_grad()
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 29  # (the skipped batch is part of the next step)
    forward, backward = (
        arrays.phases[arrays.steps > 12, 0, PHASES.index(p)] for p in ("forward", "backward")
    )
    assert (forward > 0).all() and (backward > 0).all()


def test_gradients_taken_with_autograd_grad_keep_backward_timed_after_the_trial(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt)
    params = list(model.parameters())
    for _ in range(3 * OUTPUT_TRIAL):
        grads = torch.autograd.grad(model(torch.randn(16, 8)).pow(2).mean(), params)  # no .grad accumulated
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
        opt.zero_grad()
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert (arrays.phases[arrays.steps > OUTPUT_TRIAL + 1, 0, PHASES.index("backward")] > 0).all()


def test_steps_the_optimizer_skipped_are_steps_and_a_loss_gone_nan_for_good_is_seen(tmp_path):
    # GradScaler skips optimizer.step() while the gradients hold inf or NaN. Merged into the next step, the
    # skipped ones never closed once the loss went NaN for good: the NaN was never reported.
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt)
    for i in range(40):
        x = torch.randn(4, 8) * (math.nan if i >= 30 else 1.0)
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scope.log(loss=loss)
    scope.finish()
    run = load_run(tmp_path)
    assert run.arrays.n_steps == 40
    assert run.arrays.optimizer_steps[:, 0].tolist() == [1.0] * 30 + [0.0] * 10
    summary = summarize(run.arrays, run.context)
    assert "CONVERGENCE.NONFINITE" in {f.code for f in summary.findings}


@pytest.mark.parametrize("watched", ["model, loader", "model", "loader"])
def test_with_no_optimizer_watched_each_iteration_is_a_step_and_the_report_says_so(tmp_path, watched):
    # Steps end where an optimizer steps: with none watched, none ended and the run held no step at all (its
    # report said "no loss was logged"). An iteration is a step once it did work (a forward, a logged loss):
    # the fetch that ends an epoch is none. The loop steps its optimizer on every 2nd batch: not seen.
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(80, 8), torch.randn(80, 1)), batch_size=4)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=8)
    scope.watch(model if "model" in watched else None, None, loader if "loader" in watched else None)
    if "loader" in watched:  # (with no loader watched, each forward is a loop top: this one would be a step)
        model(torch.randn(2, 8))  # a forward before the loop (a shape check) is no step
    for epoch in range(2):
        for i, (x, y) in enumerate(loader):
            if epoch == 0 and i == 10:
                assert scope.state_dict()["step"] == 10  # (a checkpoint here: 10 iterations done, not 11)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if i % 2:
                opt.step()
                opt.zero_grad()
            scope.log(loss=loss)
            if epoch == 1 and i == 14:
                break  # (after the iteration's work: it is a step)
    scope.finish()
    run = load_run(tmp_path)
    assert run.arrays.n_steps == 35 and np.isfinite(run.arrays.loss).all()
    assert (run.arrays.optimizer_steps == 0).all()
    assert (run.arrays.micro_batches[:, 0] == (1 if "model" in watched else 0)).all()
    summary = summarize(run.arrays, run.context)
    notes = " ".join(summary.scope_notes)
    assert notes.count("no optimizer watched: each iteration of the loop is a step") == 1


def test_a_scaler_that_skips_every_step_on_nan_gradients_under_a_finite_loss_is_reported(tmp_path, capsys):
    # From batch 30 the loss gains a term whose value is 0 and whose gradient is NaN (sqrt at 0): the loss
    # stays finite, the GradScaler skips every step, the weights never change again. No loss finding can say
    # so: the loss is finite and flat.
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    loader = DataLoader(TensorDataset(torch.randn(240, 8), torch.randn(240, 1)), batch_size=4)
    scope = Scope(tmp_path, hang_timeout=None, interval=10, warmup=0)
    scope.watch(model, opt, loader)
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        out = model(x)
        loss = torch.nn.functional.mse_loss(out, y)
        if i >= 30:
            loss = loss + torch.sqrt(0.0 * out.sum())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scope.log(loss=loss)
    scope.finish()
    console = " ".join(capsys.readouterr().out.split())  # (rich wraps long lines)
    run = load_run(tmp_path)
    assert run.arrays.optimizer_steps[:, 0].tolist() == [1.0] * 30 + [0.0] * 30
    assert np.isfinite(run.arrays.loss).all()
    first_skipped = int(run.arrays.steps[30])
    found = {f.code: f for f in summarize(run.arrays, run.context).findings}
    skipped = found["CONVERGENCE.SKIPPED_STEPS"]
    assert skipped.severity.name == "HIGH" and skipped.steps == (first_skipped,)
    assert "CONVERGENCE.NONFINITE" not in found
    # Said live (from the report at step 50: ten in a row by then) and in the summary's convergence section.
    title = f"No optimizer step has trained the model since step {first_skipped}"
    assert title not in console[: console.index("pytscope step 50:")]  # (at step 40: nine in a row)
    assert console.index("pytscope step 50:") < console.index(title) < console.index("Run summary")
    assert f"none trained from step {first_skipped} to the end" in console


@pytest.mark.parametrize("model_watched", [True, False])
def test_a_step_the_scaler_skipped_is_one_in_the_order_of_the_amp_recipe(tmp_path, model_watched):
    # PyTorch's AMP recipe clears gradients first thing in each iteration: after the watched loader's fetch,
    # the loop top, too late for zero_grad to end the step the scaler skipped. 24 batches merged into 18 steps.
    # The scaler's step ends it whether or not the model (whose backward zero_grad looks for) is watched.
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    torchs = torch.amp.GradScaler.__dict__["step"]
    loader = DataLoader(TensorDataset(torch.randn(96, 8), torch.randn(96, 1)), batch_size=4)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=8)
    scope.watch(model if model_watched else None, opt, loader)
    for i, (x, y) in enumerate(loader):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y) * (math.inf if i % 4 == 3 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.optimizer_steps[:, 0].tolist() == [0.0 if i % 4 == 3 else 1.0 for i in range(24)]
    assert (arrays.micro_batches[:, 0] == (1 if model_watched else 0)).all()
    assert torch.amp.GradScaler.__dict__["step"] is torchs  # torch's own again


def test_another_tools_wrapper_over_the_scalers_step_outlives_the_scope(tmp_path):
    # Our wrapper was known by an attribute, which functools.wraps copies: at finish the other tool's wrapper
    # was taken for ours and removed (ours put back for good); a mock's `__wrapped__` raised out of finish(),
    # leaving the optimizer's zero_grad wrapped.
    from unittest import mock

    torchs, called = torch.amp.GradScaler.__dict__["step"], []
    scope, model, opt = watched_linear(tmp_path)
    theirs = torch.amp.GradScaler.step

    @functools.wraps(theirs)
    def traced(*args, **kwargs):
        called.append(1)
        return theirs(*args, **kwargs)

    torch.amp.GradScaler.step = traced
    try:
        scope.finish()
        assert torch.amp.GradScaler.__dict__["step"] is traced  # theirs stays, ours idle inside it
        scaler = torch.amp.GradScaler("cpu")
        scaler.scale(model(torch.randn(2, 8)).sum()).backward()
        scaler.step(opt)
        assert called == [1]
        second, model, opt = watched_linear(tmp_path / "second")
        assert torch.amp.GradScaler.__dict__["step"] is traced  # ours is in its chain: not wrapped again
        second.finish()
    finally:
        torch.amp.GradScaler.step = theirs
    with mock.patch.object(torch.amp.GradScaler, "step"):
        third, model, opt = watched_linear(tmp_path / "third")
        third.finish()  # (the mock is no wrapper of ours: it stays)
        assert "zero_grad" not in vars(opt) and third.errors == []
    scope, model, opt = watched_linear(tmp_path / "fourth")
    scope.finish()
    assert torch.amp.GradScaler.__dict__["step"] is torchs


@pytest.mark.parametrize("clears", [False, True])
def test_a_loss_gone_nan_for_good_behind_a_nan_guard_is_reported(tmp_path, clears):
    # The loop skips every batch whose loss is not finite (`continue` before the backward): from batch 31 on
    # the optimizer never stepped again, so the step never closed and was dropped at the end, its NaN losses
    # with it: 30 steps, no CONVERGENCE.NONFINITE. Then one step of 10 batches; each is a step of its own.
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(160, 8), torch.randn(160, 1)), batch_size=4)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=8).watch(model, opt, loader)
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x * (math.nan if i >= 30 else 1.0)), y)
        scope.log(loss=loss)
        if not torch.isfinite(loss):
            if clears:
                opt.zero_grad()
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    run = load_run(tmp_path)
    assert run.arrays.optimizer_steps[:, 0].tolist() == [1.0] * 30 + [0.0] * 10
    assert run.arrays.micro_batches[:, 0].tolist() == [1.0] * 30 + [0.0] * 10  # none trained
    summary = summarize(run.arrays, run.context)
    (found,) = [f for f in summary.findings if f.code == "CONVERGENCE.NONFINITE"]
    assert found.title == "The loss became non-finite at step 31 and never recovered", found.title
    assert summary.timing.steps_counted == 30 - 5  # a forward alone is not a step's work: not in statistics
    warmup_s = run.arrays.wall_ms[:5, 0].sum() / 1e3  # (nor warm-up)
    assert summary.efficiency.goodput.warmup_s == pytest.approx(warmup_s)


def test_every_scope_of_a_job_has_keys_of_its_own_in_the_store(one_rank_group):
    # A second run in one process group (another fit(), a sweep) read the first one's meeting at finish.
    from pytscope_core.coordinator import next_run_number, store_prefix

    first, second = next_run_number(), next_run_number()
    assert second > first and store_prefix(0, first) != store_prefix(0, second)


def test_batches_a_nan_guard_skips_under_ddp_are_steps_that_neither_sync_nor_train(tmp_path, one_rank_group):
    # Batches 6-9 skipped on a NaN loss, then training goes on. Each skipped batch ends at the next fetch, and
    # the gradient sync its forward prepared and never ran is not counted on the step after it.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=4)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=4).watch(model, opt, loader)
    for i, (x, y) in enumerate(loader):
        loss = torch.nn.functional.mse_loss(model(x * (math.nan if 6 <= i < 10 else 1.0)), y)
        scope.log(loss=loss)
        if not torch.isfinite(loss):
            continue
        loss.backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    arrays = load_run(tmp_path).arrays
    trained = [1.0] * 6 + [0.0] * 4 + [1.0] * 6
    assert arrays.optimizer_steps[:, 0].tolist() == trained
    assert arrays.grad_syncs[:, 0].tolist() == trained
    assert arrays.micro_batches[:, 0].tolist() == trained
    assert np.isinf(arrays.loss[6:10, 0]).all() and np.isfinite(arrays.loss[10:, 0]).all()
    assert "DIST.DESYNC" not in {f.code for f in summarize(arrays, load_run(tmp_path).context).findings}


def test_a_model_set_up_by_lightning_fabric_trains_and_is_timed_inside_its_wrapper(tmp_path):
    # Fabric's wrapper passes attributes set on it to the module inside: the forward wrapper set on it called
    # the wrapper, which called it, until RecursionError, at the first step of the user's training.
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model = fabric.setup_module(torch.nn.Linear(8, 1))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.01))
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt)
    for _ in range(6):
        fabric.backward(model(torch.randn(4, 8)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    scope.finish()
    model(torch.randn(4, 8))  # put back as it was
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 6 and (arrays.phases[:, 0, PHASES.index("forward")] > 0).all()


def test_a_logger_that_raises_on_the_live_metrics_turns_them_off_not_the_scope(tmp_path):
    def broken_logger(metrics, step):
        raise ConnectionError("tracking server unreachable")

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5, warmup=1).watch(model, opt)
    scope.set_metrics_sink(broken_logger)
    linear_steps(model, opt, 30)
    assert scope.enabled
    scope.finish()
    assert load_run(tmp_path).arrays.n_steps == 30
    assert any("a logger raised ConnectionError" in e for e in scope.errors), scope.errors


def test_the_auto_hang_timeout_follows_step_times_not_a_pause_between_steps(
    tmp_path, one_rank_group, monkeypatch
):
    from pytscope_core import watchdog

    monkeypatch.setattr(watchdog, "BEAT_S", 0.005)  # a heartbeat that sees every step close
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout="auto", interval=5, warmup=2).watch(model, opt)
    for i in range(20):
        if i == 7:
            with scope.paused():  # a validation between two steps
                time.sleep(1.0)
        linear_steps(model, opt)
        time.sleep(0.02)
    dog = scope.session._watchdog
    assert dog is not None and dog.slowest_step_s < 0.5, dog.slowest_step_s
    scope.finish()


def test_a_scope_the_other_ranks_never_start_says_so_not_internal_error(
    tmp_path, one_rank_group, monkeypatch
):
    # A scope made on the main process only: its first collective times out after gather_timeout. That read
    # "internal error ... DistStoreError: wait timeout".
    import torch.distributed as dist

    from pytscope_core import coordinator, gather

    def never_met(*args, **kwargs):
        raise dist.DistStoreError("wait timeout after 10000ms, keys: /default_pg/0//1//cpu//0/1")

    monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(gather, "Gatherer", never_met)
    with pytest.raises(coordinator.RanksNotMet) as raised:
        coordinator.Coordinator(StepRecorder(), 50, 10.0).start(tmp_path)
    message = disabled_message(raised.value)
    assert message.startswith("scope disabled") and "gather_timeout (10 s)" in message, message


def test_zero_grad_inside_the_optimizers_own_step_does_not_end_the_step(tmp_path):
    # L-BFGS calls its closure (zero_grad, forward, backward) several times inside one step(): a zero_grad
    # there is no skipped step, and each optimizer step is one step.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5, history_size=5)
    x, y = torch.randn(64, 8), torch.randn(64, 1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    scope = Scope(tmp_path, console=False, hang_timeout=None, warmup=0).watch(model, opt)
    for _ in range(4):
        opt.step(closure)
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.n_steps == 4 and (arrays.micro_batches[:, 0] > 1).all(), arrays.micro_batches[:, 0]


def test_a_backward_through_a_branch_no_hook_saw_still_counts_its_sync(tmp_path, one_rank_group):
    # Two heads, the first parameter in head A: steps through head B leave its gradient as it was (DDP
    # writes no gradient that no rank used), but their backward ran and synced.
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.trunk, self.b = (
                torch.nn.Linear(16, 1),
                torch.nn.Linear(8, 16),
                torch.nn.Linear(16, 1),
            )

        def forward(self, x, head):
            return (self.a if head == "a" else self.b)(self.trunk(x))

    model = torch.nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, warmup=0).watch(model, opt)
    for i in range(18):
        model(torch.randn(4, 8), "a" if i < 12 else "b").sum().backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    arrays = load_run(tmp_path).arrays
    assert arrays.grad_syncs.sum() == 18 and arrays.micro_batches.sum() == 18


def test_a_batch_fetched_and_skipped_adds_no_samples_to_the_next_step(tmp_path):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(64, 8)), batch_size=8)
    scope = Scope(tmp_path, console=False, hang_timeout=None).watch(model, opt, loader)
    for i, (x,) in enumerate(loader):
        if i == 3:
            continue  # (a batch the loop decides not to train on)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    scope.finish()
    assert load_run(tmp_path).arrays.samples[:, 0].tolist() == [8.0] * 7


def test_an_exception_that_a_spawn_worker_catches_is_read_from_the_file_it_leaves_for_the_parent(tmp_path):
    # torch.multiprocessing.spawn's _wrap catches the work's exception, pickles its traceback into
    # `error_file` for the parent and exits 1: the interpreter exits with no exception, and each rank read
    # "finish without every rank", no RUN.FAILED, the failing rank unnamed.
    import pickle

    from pytscope_core.signals import ProcessEnds

    spawn = {"__name__": "torch.multiprocessing.spawn"}
    exec("def _wrap(fn, error_file):\n    return fn()", spawn)
    error_file = tmp_path / "error"
    ends = ProcessEnds(tmp_path / "run", 1, 0)
    try:
        spawn["_wrap"](ends.install, str(error_file))
        assert ends.swallowed_error() is None  # (no exception: no file)
        trace = (
            'Traceback (most recent call last):\n  File "job.py", line 13\nValueError: bad batch at step 25\n'
        )
        error_file.write_bytes(pickle.dumps(trace))
        assert ends.swallowed_error() == "ValueError: bad batch at step 25"
    finally:
        ends.restore()
    outside = ProcessEnds(tmp_path / "run", 1, 0)  # (not inside such a worker: nothing to read)
    outside.install()
    outside.restore()
    assert outside.error_file is None and outside.swallowed_error() is None
