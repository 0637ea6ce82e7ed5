"""Where communication is measured and where it is not: the FSDP marks on the timeline, recognising the wrapper,
and the "not measured" treatment in analysis, JSON, console output and the rendered summary (no processes)."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

from pytscope_core.analysis import analyze, run_rules
from pytscope_core.arrays import RunArrays
from pytscope_core.context import RunContext
from pytscope_core.parallelism import comm_note, detect
from pytscope_core.render import render_summary
from pytscope_core.reporter import RunReporter
from pytscope_core.rundir import load_run
from pytscope_core.summary import summarize
from pytscope_core.timeline import Mark as M
from pytscope_core.timeline import attribute

COMM_CODES = {"DIST.STRAGGLER", "DIST.LOAD_IMBALANCE", "DIST.COMM_BOUND"}


def text_of(renderable) -> str:
    from rich.console import Console

    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


# -- the timeline -------------------------------------------------------------------------------------------


def test_fsdp_waits_inside_forward_and_backward_are_comm_and_the_rest_stays_put():
    # forward 0-10 with an all-gather wait 1-3; backward 11-20 with a pre-backward all-gather 11-12 and a
    # reduce-scatter 15-18; graph done at 20, the last reduce-scatter in FSDP's final callback until 21.
    marks = [
        M.STEP_START, M.FORWARD_BEGIN, M.COMM_BEGIN, M.COMM_END, M.FORWARD_END,
        M.BACKWARD_BEGIN, M.COMM_BEGIN, M.COMM_END, M.COMM_BEGIN, M.COMM_END, M.GRAPH_DONE, M.BACKWARD_END,
        M.OPTIMIZER_BEGIN, M.OPTIMIZER_END, M.STEP_END,
    ]  # fmt: skip
    times = [0, 0, 1, 3, 10, 11, 11, 12, 15, 18, 20, 21, 21, 23, 23]
    phases, _, wall = attribute(marks, times)
    data, forward, backward, comm, optimizer, other = phases
    assert (forward, backward, comm, optimizer) == (8, 5, 2 + 1 + 3 + 1, 2)
    assert other == 1 and sum(phases) == wall == 23


def test_a_wait_before_forward_starts_is_comm_too():
    # The root's all-gather when the loader marks the loop top: between data and forward.
    marks = [M.STEP_START, M.DATA_BEGIN, M.DATA_END, M.COMM_BEGIN, M.COMM_END, M.FORWARD_BEGIN, M.FORWARD_END]
    phases, _, wall = attribute([*marks, M.STEP_END], [0, 0, 2, 2, 5, 5, 9, 9])
    assert phases[:4] == [2, 4, 0, 3] and wall == 9


# -- recognising the wrapper --------------------------------------------------------------------------------


class DeepSpeedEngine(torch.nn.Module):  # what DeepSpeed's engine is called; never imported
    def __init__(self) -> None:
        super().__init__()
        self.module = torch.nn.Linear(2, 2)


def test_wrappers_are_recognised_and_only_ddp_and_fsdp2_count_as_measured():
    plain = torch.nn.Linear(2, 2)
    assert detect(plain, 1).name == "none" and detect(plain, 1).comm_measured
    assert detect(plain, 4).name == "none" and not detect(plain, 4).comm_measured
    engine = detect(DeepSpeedEngine(), 8)
    assert engine.name == "deepspeed" and not engine.comm_measured
    assert "DeepSpeed" in (engine.note or "")
    assert detect(None, 2).name == "none" and not detect(None, 2).comm_measured
    assert comm_note("ddp", True) is None and comm_note("fsdp2", True) is None
    assert "FSDP1" in (comm_note("fsdp1", False) or "") and "not measured" in (
        comm_note("fsdp1", False) or ""
    )


def test_fsdp2_of_torch_before_2_6_is_named_and_said_not_measured(monkeypatch):
    # torch 2.4-2.5 keep FSDP2 in torch.distributed._composable.fsdp only: it was read as tensor parallelism
    # (its DTensor parameters) or as no wrapper at all, with that reason given to the user.
    import torch.distributed._composable.fsdp as early
    import torch.distributed.fsdp as fsdp

    class EarlyFSDPModule:  # what fully_shard mixed into a module's class there
        pass

    class Sharded(torch.nn.Linear, EarlyFSDPModule):
        pass

    monkeypatch.delattr(fsdp, "FSDPModule")
    monkeypatch.setattr(early, "FSDPModule", EarlyFSDPModule)
    seen = detect(torch.nn.Sequential(Sharded(2, 2)), 2)
    assert seen.name == "fsdp2 (torch < 2.6)" and not seen.comm_measured
    assert "torch 2.6" in (seen.note or "")


def test_scope_records_the_parallelism_it_saw():
    from pytscope_core import Scope

    scope = Scope(console=False, hang_timeout=None)
    scope.watch(DeepSpeedEngine())
    try:
        assert scope.parallelism.name == "deepspeed" and not scope.parallelism.comm_measured
    finally:
        scope.finish()  # no step was taken: nothing to report, every hook removed


# -- analysis and reports -----------------------------------------------------------------------------------


def blind_straggler_run(steps: int = 300, ranks: int = 4, slow_rank: int = 3) -> RunArrays:
    """Rank 3 computes 15% more; the others' wait for it hides in their forward (no comm marks at all), as
    under a wrapper whose collectives pytscope does not time."""
    rng = np.random.default_rng(0)
    compute = 10.0 * (1 + 0.03 * rng.standard_normal((steps, ranks)))
    compute[:, slow_rank] *= 1.15
    ph = np.zeros((steps, ranks, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 4], ph[:, :, 5] = 0.4 * compute, 0.6 * compute, 0.5, 0.3
    local = ph.sum(axis=2)
    ph[:, :, 1] += local.max(axis=1, keepdims=True) - local + 0.5  # the wait, inside forward
    return RunArrays.from_arrays(ph, loss=np.linspace(3, 1, steps))


def measured_straggler_run(steps: int = 300, ranks: int = 4, slow_rank: int = 3) -> RunArrays:
    rng = np.random.default_rng(1)
    compute = 10.0 * (1 + 0.03 * rng.standard_normal((steps, ranks)))
    compute[:, slow_rank] *= 1.15
    ph = np.zeros((steps, ranks, 6))
    ph[:, :, 1], ph[:, :, 2], ph[:, :, 4], ph[:, :, 5] = 0.4 * compute, 0.6 * compute, 0.5, 0.3
    local = ph.sum(axis=2)
    ph[:, :, 3] = local.max(axis=1, keepdims=True) - local + 4.0  # a large transfer too
    return RunArrays.from_arrays(ph, loss=np.linspace(3, 1, steps))


BLIND = RunContext(world_size=4, parallelism="fsdp1", comm_measured=False)


def test_unmeasured_comm_turns_the_straggler_analysis_off_and_says_why():
    # Even with a comm column that shows a straggler and heavy transfer, unmeasured means: no verdict from it.
    arrays = measured_straggler_run()
    assert analyze(arrays, RunContext(world_size=4)).distributed.stragglers == (3,)  # the control
    assert COMM_CODES & {f.code for f in run_rules(analyze(arrays, RunContext(world_size=4)))}
    a = analyze(arrays, BLIND)
    d = a.distributed
    assert d.stragglers == () and not d.comm_measured and "FSDP1" in (d.note or "")
    assert all(np.isnan(r.local_ms) and not r.straggler for r in d.per_rank)
    assert not COMM_CODES & {f.code for f in run_rules(a)}


def test_unmeasured_comm_is_not_useful_compute_in_the_budget():
    a = analyze(blind_straggler_run(), BLIND)
    lines = {x.name: x for x in a.efficiency.budget}
    assert "useful compute" not in lines and "compute + unmeasured comm" in lines
    for name in ("exposed transfer", "sync wait (imbalance)"):
        assert not lines[name].measured and np.isnan(lines[name].share) and not lines[name].recoverable
    shares = [x.share for x in a.efficiency.budget if x.measured]
    assert sum(shares) == pytest.approx(1.0)
    assert np.isfinite(a.efficiency.recoverable_share)


def test_summary_json_and_text_say_not_measured_in_every_section():
    s = summarize(blind_straggler_run(), BLIND)
    d = s.to_dict()
    json.dumps(d, allow_nan=False)
    assert d["run"]["parallelism"] == "fsdp1" and d["run"]["comm_measured"] is False
    assert "not measured" in d["run"]["comm_note"]
    assert d["timing"]["phases"]["comm"] == {"share": None, "median_ms": None, "measured": False}
    assert d["distributed"]["stragglers"] == [] and d["distributed"]["comm_measured"] is False
    assert d["distributed"]["per_rank"][0]["local_ms"] is None and d["distributed"]["note"]
    budget = {x["name"]: x for x in d["efficiency"]["budget"]}
    assert budget["exposed transfer"]["measured"] is False and budget["exposed transfer"]["share"] is None
    out = text_of(render_summary(s))
    run_part, rest = out.split("Step-time breakdown")
    timing_part, rest = rest.split("Convergence")
    dist_part = rest.split("Distributed")[1].split("Efficiency budget")[0]
    budget_part = rest.split("Efficiency budget")[1]
    assert "parallelism" in run_part and "not measured" in run_part
    assert "comm" in timing_part and "not measured" in timing_part
    assert "not measured" in dist_part and "straggler analysis is off" in dist_part
    assert "not measured" in budget_part and "useful compute" not in budget_part


def test_measured_runs_read_as_before():
    s = summarize(measured_straggler_run(), RunContext(world_size=4, parallelism="ddp")).to_dict()
    assert s["run"]["comm_measured"] is True and s["run"]["comm_note"] is None
    assert s["distributed"]["stragglers"] == [3] and s["timing"]["phases"]["comm"]["share"] > 0
    assert "useful compute" in {x["name"] for x in s["efficiency"]["budget"]}


def test_run_directory_carries_parallelism_and_older_runs_count_as_measured(tmp_path):
    from runfactory import phases_of, write_run

    old = write_run(tmp_path / "old", phases_of(20, 2, {"forward": 5.0, "comm": 1.0}))
    assert load_run(old).context.comm_measured is True and load_run(old).context.parallelism is None
    new = write_run(tmp_path / "new", phases_of(20, 2, {"forward": 5.0}))
    meta = json.loads((new / "meta.json").read_text())
    (new / "meta.json").write_text(json.dumps({**meta, "parallelism": "deepspeed", "comm_measured": False}))
    ctx = load_run(new).context
    assert ctx.parallelism == "deepspeed" and ctx.comm_measured is False


def test_live_output_says_so_once_when_the_run_starts(tmp_path, capsys):
    RunReporter(
        tmp_path / "a", {"world_size": 2, "parallelism": "tensor_parallel", "comm_measured": False}, True
    )
    RunReporter(tmp_path / "b", {"world_size": 2, "parallelism": "fsdp2", "comm_measured": True}, True)
    out = capsys.readouterr().out
    assert out.count("communication not measured") == 1 and "tensor-parallel" in out
