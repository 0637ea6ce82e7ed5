import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pytscope_core.analysis import diagnose
from pytscope_core.cli import main
from pytscope_core.findings import Finding, Severity
from pytscope_core.records import COL, COLUMNS, NCOLS
from pytscope_core.rundir import MAX_WORLD, RunWriter, append_rank_rows, fatal_end, load_run
from pytscope_core.summary import summarize


def rows_for(world=2, steps=60, segment=0, first=1, slow_rank=None):
    rng = np.random.default_rng(segment)
    out = []
    for s in range(first, first + steps):
        for r in range(world):
            row = np.full(NCOLS, np.nan)
            row[COL["rank"]], row[COL["segment"]], row[COL["step"]] = r, segment, s
            phases = np.array([0.2, 1.0, 2.0, 0.3, 0.2, 0.1]) * rng.uniform(0.95, 1.05)
            if slow_rank is not None:
                phases[3] = 0.3 if r == slow_rank else 2.3
                phases[1] += 2.0 if r == slow_rank else 0.0
            row[COL["data_ms"] : COL["other_ms"] + 1] = phases
            row[COL["wall_ms"]] = phases.sum()
            row[COL["start_s"]] = 1000 + segment * 100 + s * phases.sum() / 1e3
            row[COL["excluded_ms"]] = 0
            row[COL["loss"]] = 2.0 - s / 100
            row[COL["samples"]] = 32
            row[COL["mem_bytes"]] = 1e8
            row[COL["grad_syncs"]] = row[COL["micro_batches"]] = 1
            out.append(row)
    return np.array(out)


def write_run(path, **kw):
    w = RunWriter(path, {"world_size": 2, "interval": 10, "warmup": 2})
    w.event("segment", index=0, started_s=1000.0, resumed_from_step=0, world_size=2)
    w.append_rows(rows_for(**kw))
    w.event(
        "finding",
        step=10,
        source="integration",
        finding={
            "code": "DATA.UNEVEN_SHARDS",
            "severity": "HIGH",
            "title": "t",
            "detail": "d",
            "recommendation": "r",
            "ranks": [1],
            "steps": [],
            "evidence": {},
        },
    )
    w.close()
    return path


def test_truncated_at_random_byte_offsets_still_reports(tmp_path, capsys):
    src = tmp_path / "src"
    write_run(src)
    steps = (src / "steps.f64").read_bytes()
    events = (src / "events.jsonl").read_bytes()
    rng = np.random.default_rng(0)
    for i, cut in enumerate(rng.integers(0, len(steps), 12)):
        d = tmp_path / f"cut{i}"
        d.mkdir()
        (d / "meta.json").write_text((src / "meta.json").read_text())
        (d / "steps.f64").write_bytes(steps[:cut])
        (d / "events.jsonl").write_bytes(events[: int(rng.integers(0, len(events)))])
        assert main(["report", str(d)]) == 0
        capsys.readouterr()
        assert main(["report", str(d), "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        full_rows = int(cut) // (NCOLS * 8)  # rank 0 and rank 1 rows alternate, step by step
        assert data["run"]["steps"] == (full_rows + 1) // 2


def test_report_json_has_the_contract_keys_and_integration_findings(tmp_path, capsys):
    write_run(tmp_path / "r", slow_rank=1)
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"]["world_size"] == 2 and data["run"]["steps"] == 60 and data["run"]["restarts"] == 0
    for key in ("median_ms", "p95_ms"):
        assert data["timing"][key] > 0
    assert abs(sum(p["share"] for p in data["timing"]["phases"].values()) - 1) < 1e-6
    ranks = data["distributed"]["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(
        "local_ms" in r and "sync_wait_ms" in r for r in ranks
    )
    assert data["distributed"]["stragglers"] == [1]
    assert data["convergence"]["trend"] in ("improving", "flat", "worsening", "unknown")
    codes = {f["code"] for f in data["findings"]}
    assert "DATA.UNEVEN_SHARDS" in codes and "DIST.STRAGGLER" in codes and "DIST.COMM_BOUND" not in codes
    assert all({"code", "severity", "ranks", "steps"} <= f.keys() for f in data["findings"])


def test_fail_on_exit_codes(tmp_path):
    write_run(tmp_path / "r", slow_rank=1)
    assert main(["report", str(tmp_path / "r"), "--fail-on", "HIGH"]) == 1
    write_run(tmp_path / "ok")
    assert (
        main(["report", str(tmp_path / "ok"), "--fail-on", "MED"]) == 1
    )  # the uneven-shards finding is HIGH
    assert main(["report", str(tmp_path / "ok")]) == 0


def test_resumed_segment_supersedes_replayed_steps(tmp_path, capsys):
    w = RunWriter(tmp_path / "r", {"world_size": 2, "interval": 10, "warmup": 2})
    w.event("segment", index=0, started_s=1000.0, resumed_from_step=0, world_size=2)
    w.append_rows(rows_for(steps=130, segment=0))
    w.event("segment", index=1, started_s=1200.0, resumed_from_step=100, world_size=2)
    w.append_rows(rows_for(steps=100, segment=1, first=101))
    w.close()
    run = load_run(tmp_path / "r")
    assert run.arrays.n_steps == 200 and run.arrays.replayed.shape[0] == 30 * 2
    assert main(["report", str(tmp_path / "r"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["run"]["steps"] == 200 and data["run"]["restarts"] == 1


def test_rows_that_cannot_be_a_step_are_damage_and_rows_written_twice_are_not_a_replay(tmp_path):
    w = RunWriter(tmp_path / "r", {"world_size": 2, "interval": 10, "warmup": 2})
    w.event("segment", index=0, started_s=1000.0, resumed_from_step=0, world_size=2)
    rows = rows_for(steps=60)
    zero, over = rows[:2].copy(), rows[2:4].copy()
    zero[:, COL["wall_ms"] : COL["other_ms"] + 1] = 0.0  # a step that took no time
    over[:, COL["forward_ms"]] += 1000.0  # phases far beyond the step's wall time
    w.append_rows(np.concatenate([rows[4:], rows[4:], zero, over]))  # the file appended twice, then damage
    w.close()
    run = load_run(tmp_path / "r")
    assert run.arrays.n_steps == 58 and run.arrays.replayed.shape[0] == 0  # no resume: nothing replayed
    assert run.problems == [
        "4 corrupt row(s) of step records dropped",
        "116 duplicate row(s) of step records dropped",
    ]
    assert summarize(run.arrays, run.context).to_dict()["run"]["restarts"] == 0


def test_a_world_size_no_job_has_is_damage_not_an_allocation(tmp_path, capsys):
    write_run(tmp_path / "r")
    meta = json.loads((tmp_path / "r" / "meta.json").read_text())
    (tmp_path / "r" / "meta.json").write_text(json.dumps({**meta, "world_size": MAX_WORLD + 1}))
    assert main(["report", str(tmp_path / "r")]) == 0  # (10**12 ranks was a row per rank: out of memory)
    assert f"world_size={MAX_WORLD + 1} is not valid" in capsys.readouterr().out


@pytest.mark.parametrize("make", ["missing", "file", "empty", "junk", "foreign", "deep", "newer"])
def test_bad_run_directory_is_one_line_and_exit_2(tmp_path, make):
    target = tmp_path / "x"
    if make == "file":
        target.write_text("hello")
    elif make == "empty":
        target.mkdir()
    elif make == "junk":
        target.mkdir()
        (target / "meta.json").write_text("{not json")
    elif make == "foreign":  # a folder that merely holds a meta.json of some other tool
        target.mkdir()
        (target / "meta.json").write_text('{"name": "my dataset"}')
    elif make == "newer":
        target.mkdir()
        (target / "meta.json").write_text('{"format": "pytscope-run/2"}')
    elif make == "deep":  # nested past what the JSON decoder recurses into
        target.mkdir()
        (target / "meta.json").write_text("[" * 100_000 + "]" * 100_000)
    proc = subprocess.run(
        [sys.executable, "-m", "pytscope_core.cli", "report", str(target)], capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_bad_arguments_exit_2_without_traceback():
    for argv in (
        ["report"],
        ["nonsense"],
        ["report", ".", "--fail-on", "CRITICAL"],
        ["demo", "--ranks", "0"],
        ["demo", "--scenario", "hang", "--ranks", "1"],
        ["demo", "--run-dir", "/proc/no-run-here"],
        ["demo", "--steps", "0"],
        ["demo", "--steps", "100000000"],  # (its data is made up front)
        ["demo", "--ranks", "100000"],
        ["demo", "--scenario", "hang", "--steps", "20"],  # (the hang comes at step 30)
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "pytscope_core.cli", *argv], capture_output=True, text=True
        )
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, (argv, proc.stderr)


def test_commands_that_cannot_write_or_have_nothing_to_show_exit_2_in_one_line(tmp_path, capsys):
    RunWriter(tmp_path / "early", {"world_size": 2}).close()  # killed before its first gather: no rows
    write_run(tmp_path / "r")
    (tmp_path / "afile").write_text("")
    for argv in (
        ["trace", str(tmp_path / "early"), "-o", str(tmp_path / "t.json")],
        ["report", str(tmp_path / "r"), "--plots", str(tmp_path / "afile")],
        ["report", str(tmp_path / "r"), "--plots", str(tmp_path / "afile" / "sub")],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and out == "", argv  # no report before the error


@pytest.mark.parametrize(
    "damage, note",
    [
        ("meta_type", "run setting world_size='two' is not valid"),
        ("meta_null", "run setting warmup=None is not valid"),
        ("meta_event", "run setting interval='x' is not valid"),
        ("steps_dir", "steps.f64 cannot be read"),
        ("steps_gone", "steps.f64 is missing"),
        ("events_dir", "events.jsonl cannot be read"),
        ("row", "1 corrupt row(s) of step records dropped"),
        ("event_entries", "1 hang event(s) could not be read"),
        ("ranks_file", "ranks/ cannot be read (not a folder)"),
        ("negative_step", "1 corrupt row(s) of step records dropped"),
        ("rank_beyond_world", "1 corrupt row(s) of step records dropped"),
        ("deep_event", "1 unreadable line(s) in events.jsonl skipped"),
        ("replica_per_rank", "1 replica_check event(s) could not be read"),
        ("counts_per_rank", "1 counts_check event(s) could not be read"),
    ],
)
def test_a_damaged_run_directory_still_reports_what_it_can(tmp_path, capsys, damage, note):
    # Hand-edited or damaged files: one line saying what was left out, the rest reported, exit 0.
    path = tmp_path / "r"
    write_run(path)
    meta = json.loads((path / "meta.json").read_text())
    if damage.startswith("meta_"):
        if damage == "meta_type":
            meta["world_size"] = "two"
        elif damage == "meta_null":
            meta["warmup"] = None
        (path / "meta.json").write_text(json.dumps(meta))
        if damage == "meta_event":
            with open(path / "events.jsonl", "a") as f:
                f.write(json.dumps({"type": "meta", "fields": {"interval": "x"}}) + "\n")
    elif damage.endswith("_dir"):
        name = "steps.f64" if damage == "steps_dir" else "events.jsonl"
        (path / name).unlink()
        (path / name).mkdir()
    elif damage == "steps_gone":
        (path / "steps.f64").unlink()
    elif damage == "ranks_file":
        (path / "ranks").write_text("not a folder of rank files")
    elif damage in ("negative_step", "rank_beyond_world"):  # one flipped exponent byte makes rank 1 65536
        rows = np.fromfile(path / "steps.f64", dtype="<f8").reshape(-1, NCOLS)
        rows[7, COL["step" if damage == "negative_step" else "rank"]] = (
            -1 if damage == "negative_step" else 65536
        )
        rows.tofile(path / "steps.f64")
    elif damage in ("deep_event", "replica_per_rank", "counts_per_rank"):
        line = {
            "deep_event": "[" * 100_000 + "]" * 100_000,
            "replica_per_rank": json.dumps(
                {"type": "replica_check", "step": 10, "checksums": [1.0, 2.0, 3.0, 4.0]}
            ),
            "counts_per_rank": json.dumps(
                {
                    "type": "counts_check",
                    "gather": 1,
                    "steps": [10, 10],
                    "grad_syncs": [10],
                    "micro_batches": [10],
                }
            ),
        }[damage]
        with open(path / "events.jsonl", "a") as f:
            f.write(line + "\n")
    elif damage == "row":  # random bytes over one row in the middle
        raw = bytearray((path / "steps.f64").read_bytes())
        row = NCOLS * 8
        raw[20 * row : 21 * row] = np.random.default_rng(3).bytes(row)
        (path / "steps.f64").write_bytes(bytes(raw))
    else:  # entries of the right type with wrong contents
        with open(path / "events.jsonl", "a") as f:
            f.write(
                json.dumps({"type": "counts_check", "gather": 1, "steps": ["a"], "grad_syncs": [[1]]}) + "\n"
            )
            f.write(json.dumps({"type": "hang", "finding": {"code": "DIST.HANG", "severity": "X"}}) + "\n")
    assert main(["report", str(path)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Step-time breakdown" in out
    if note is not None:
        assert f"note: {note}" in " ".join(out.split())
    if damage in ("row", "rank_beyond_world"):
        assert load_run(path).arrays.world_size == 2  # not a third rank made of damaged bytes
    if damage in ("replica_per_rank", "counts_per_rank"):
        assert "DIST." not in out  # a damaged check is no evidence of drift or desync
    assert main(["report", str(path), "--json"]) == 0
    json.loads(capsys.readouterr().out)


def test_a_rank_note_says_why_records_end_only_where_they_end(tmp_path):
    # on_hang="report": both ranks wrote their rows with the reason "hang" at step 30, then the hang cleared
    # and training went on to step 60. That note did not end their records; a SIGTERM note at the end does.
    from pytscope_core.rundir import append_rank_rows

    write_run(tmp_path / "r")  # 60 steps, 2 ranks
    empty = np.empty((0, NCOLS))
    append_rank_rows(tmp_path / "r", 0, rows_for(steps=30)[::2], "hang")
    append_rank_rows(tmp_path / "r", 1, empty, "hang", at_step=30)  # nothing pending: a gather just ran
    run = load_run(tmp_path / "r")
    assert run.context.rank_notes == ()
    append_rank_rows(tmp_path / "r", 1, rows_for(steps=60)[1::2], "SIGTERM")
    assert load_run(tmp_path / "r").context.rank_notes == ((1, "SIGTERM"),)


def findings_of(path):
    run = load_run(path)
    return diagnose(run.arrays, run.context)


def test_the_rank_whose_exception_came_first_is_named_as_the_failure(tmp_path, monkeypatch):
    import pytscope_core.rundir as rundir

    clock = iter([100.0, 99.0])  # rank 1 wrote its rows first, though after rank 0 here
    monkeypatch.setattr(rundir.time, "time", lambda: next(clock))
    write_run(tmp_path / "r", steps=30)
    lost = "the process raised RuntimeError: Connection closed by peer [127.0.0.1]:1234"
    append_rank_rows(tmp_path / "r", 0, np.empty((0, NCOLS)), lost, at_step=30)
    append_rank_rows(
        tmp_path / "r", 1, np.empty((0, NCOLS)), "the fit raised ValueError: bad batch", at_step=30
    )
    (failed,) = [f for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"]
    assert failed.severity is Severity.HIGH and failed.ranks == (1,) and failed.steps == (30,)
    assert failed.title == "rank 1 failed after step 30: ValueError: bad batch" and "Rank 0 raised after" in (
        failed.detail
    )
    # Written by a version that kept no times: a lost connection follows the other failure.
    for line in (tmp_path / "r" / "ranks").glob("*.jsonl"):
        line.write_text(json.dumps({k: v for k, v in json.loads(line.read_text()).items() if k != "t"}))
    assert [f.ranks for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"] == [(1,)]


def test_a_failure_the_job_resumed_past_is_med_and_a_users_interrupt_is_no_failure(tmp_path):
    write_run(tmp_path / "r")  # 60 steps
    append_rank_rows(tmp_path / "r", 1, np.empty((0, NCOLS)), "the process raised OSError: disk", at_step=30)
    (failed,) = [f for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"]
    assert failed.severity is Severity.MED and "resumed past it" in failed.detail
    # One finding per launch: launch 0 failed after step 30 and launch 1 after step 28 (resumed from 20),
    # which ended the run. Only launch 0's is past.
    write_run(tmp_path / "l", steps=28)
    w = RunWriter(tmp_path / "l", {"world_size": 2})
    w.event("segment", index=1, started_s=2000.0, resumed_from_step=20, world_size=2)
    w.append_rows(rows_for(steps=8, first=21, segment=1))
    w.close()
    for segment, step in ((0, 30), (1, 28)):
        reason = f"the process raised RuntimeError: launch {segment}"
        append_rank_rows(tmp_path / "l", 0, np.empty((0, NCOLS)), reason, step, segment)
    found = {f.title: f.severity for f in findings_of(tmp_path / "l") if f.code == "RUN.FAILED"}
    assert found == {
        "rank 0 failed after step 30: RuntimeError: launch 0": Severity.MED,
        "rank 0 failed after step 28: RuntimeError: launch 1": Severity.HIGH,
    }
    write_run(tmp_path / "c", steps=30)
    append_rank_rows(tmp_path / "c", 0, np.empty((0, NCOLS)), "the fit raised KeyboardInterrupt", at_step=30)
    assert "RUN.FAILED" not in {f.code for f in findings_of(tmp_path / "c")}


GLOO_RESET = (
    "the process raised RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
    "[127.0.0.1]:61669: Connection reset by peer. This is typically caused by a rem"
)


NCCL_LOST = (
    "the process raised DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or "
    "there was a network error, NCCL version 2.27.5",
    "the process raised DistBackendError: NCCL communicator was aborted on rank 0. Original reason for failure",
)


def own_rows(rows, rank):
    return rows[rows[:, COL["rank"]] == rank]


def test_a_rank_killed_without_a_word_is_named_not_the_lost_connection_that_followed(tmp_path):
    # Rank 1 was SIGKILLed (the OOM killer) after the gather of step 50 and said nothing. Gloo resets rank 0's
    # connection at once, so rank 0 raised in its next all-reduce before it had waited for rank 1 at all:
    # its lost connection is the only error written, and must not be read as the cause.
    write_run(tmp_path / "r", steps=50)
    append_rank_rows(tmp_path / "r", 0, own_rows(rows_for(steps=19, first=51), 0), GLOO_RESET)
    (failed,) = [f for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"]
    assert failed.severity is Severity.HIGH and failed.ranks == (1,) and failed.steps == (50,)
    assert failed.title.startswith(
        "rank 1 was killed or aborted (no error of its own; records end at step 50)"
    )
    assert "Rank 0 then raised RuntimeError: … Connection reset by peer after step 69" in failed.detail
    assert "rank 1's process died" in failed.recommendation and "dmesg" in failed.recommendation
    assert "aborted (SIGABRT" in failed.detail and "-6 SIGABRT" in failed.recommendation
    assert "Read rank 0" not in failed.recommendation
    # The same under NCCL: its remote error, or the abort of the communicator that followed, is no cause.
    for n, nccl in enumerate(NCCL_LOST):
        write_run(tmp_path / f"n{n}", steps=50)
        append_rank_rows(tmp_path / f"n{n}", 0, own_rows(rows_for(steps=19, first=51), 0), nccl)
        (failed,) = [f for f in findings_of(tmp_path / f"n{n}") if f.code == "RUN.FAILED"]
        assert failed.ranks == (1,) and failed.title.startswith("rank 1 was killed"), failed
    # Mirrored, and before the first gather: rank 0 killed with no record at all, rank 1's connection lost.
    w = RunWriter(tmp_path / "k", {"world_size": 2, "interval": 50, "warmup": 2})
    w.event("segment", index=0, started_s=1000.0, resumed_from_step=0, world_size=2)
    w.close()
    append_rank_rows(tmp_path / "k", 1, own_rows(rows_for(steps=29), 1), GLOO_RESET)
    (failed,) = [f for f in findings_of(tmp_path / "k") if f.code == "RUN.FAILED"]
    assert failed.ranks == (0,) and failed.steps == () and "no records" in failed.title, failed


FATAL_DUMP = """Fatal Python error: Aborted

Thread 0x00007ff5b25fc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/opt/venv/lib/python3.11/site-packages/pytscope_core/watchdog.py", line 575 in run

Thread 0x00007ff5e15e8b80 (most recent call first):
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/opt/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "/home/me/train.py", line 91 in <module>

Extension modules: numpy._core._multiarray_umath, torch._C (total: 2)
"""


def fatal_file(path, rank, dump="", segment=0, earlier=""):
    header = json.dumps(
        {"pytscope": "fatal", "rank": rank, "segment": segment, "main_thread": "0x00007ff5e15e8b80"}
    )
    (path / "ranks").mkdir(parents=True, exist_ok=True)
    (path / "ranks" / f"rank{rank}.fatal").write_text(f"{earlier}{header}\n{dump}")


def test_a_rank_a_fatal_signal_ended_is_named_with_the_signal_and_where_not_as_killed(tmp_path, capsys):
    # gloo aborted rank 1 on a collective mismatch (C++ std::terminate: SIGABRT) after the gather of step 50:
    # no Python ran, and it read "killed (SIGKILL: the out-of-memory killer ...)". faulthandler's dump of its
    # threads says how it died, and where its main thread was.
    write_run(tmp_path / "r", steps=50)
    append_rank_rows(tmp_path / "r", 0, own_rows(rows_for(steps=19, first=51), 0), GLOO_RESET)
    fatal_file(tmp_path / "r", 1, FATAL_DUMP)
    fatal_file(tmp_path / "r", 0)  # rank 0's header alone: SIGTERM ended it, no fatal signal
    run = load_run(tmp_path / "r")
    (failed,) = [f for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"]
    assert failed.ranks == (1,) and failed.steps == (50,) and failed.severity is Severity.HIGH
    assert failed.title == "rank 1 died after step 50: SIGABRT in all_reduce, called from train.py line 91"
    assert "collective mismatch" in failed.detail and "TORCH_DISTRIBUTED_DEBUG" in failed.recommendation
    assert "dmesg" not in failed.recommendation and "killed" not in failed.title
    ends = {e.rank: e.reason for e in summarize(run.arrays, run.context).run.rank_ends}
    assert ends[1] == "the process died of SIGABRT in all_reduce, called from train.py line 91"
    assert main(["report", str(tmp_path / "r")]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "end no end-of-run summary: rank 1 died of SIGABRT (a fatal signal), and the job with it" in said
    # A launch that ended without one (the header alone) after an earlier launch's dump, which a resume
    # went on past: no death in this launch.
    assert fatal_end("") is None
    header_only = json.dumps({"pytscope": "fatal", "rank": 1, "segment": 1, "main_thread": "0x1"})
    earlier = json.dumps({"pytscope": "fatal", "rank": 1, "segment": 0, "main_thread": "0x00007ff5e15e8b80"})
    assert fatal_end(f"{earlier}\n{FATAL_DUMP}{header_only}\n")[:2] == (1, 0)
    segv = FATAL_DUMP.replace("Aborted", "Segmentation fault").replace("distributed_c10d.py", "x.py")
    assert fatal_end(f"{earlier}\n{segv}")[2].startswith("the process died of SIGSEGV in all_reduce")
    # The rank's own word in that launch comes first: an exception, then an abort on its way out.
    write_run(tmp_path / "e", steps=50)
    append_rank_rows(tmp_path / "e", 1, np.empty((0, NCOLS)), "the process raised ValueError: bad", 50)
    fatal_file(tmp_path / "e", 1, FATAL_DUMP)
    (failed,) = [f for f in findings_of(tmp_path / "e") if f.code == "RUN.FAILED"]
    assert failed.title == "rank 1 failed after step 50: ValueError: bad"


def test_a_rank_that_finished_alone_is_named_not_the_lost_connection_that_followed(tmp_path):
    # Rank 1 ran out of batches after step 30 and called finish(), which gave up on rank 0 (still training)
    # and ended the process; rank 0's next all-reduce then found the connection closed.
    write_run(tmp_path / "r", steps=20)
    rest = rows_for(steps=10, first=21)
    append_rank_rows(tmp_path / "r", 1, own_rows(rest, 1), "finish without every rank")
    closed = (
        "the process raised RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:10964. This is typically caused by a remote worker"
    )
    append_rank_rows(tmp_path / "r", 0, own_rows(rest, 0), closed)
    (failed,) = [f for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"]
    assert failed.ranks == (1,) and failed.steps == (30,), failed
    assert failed.title.startswith("rank 1 ended after step 30 without the other ranks")
    assert "fewer batches" in failed.recommendation and "Read rank 0" not in failed.recommendation


def stopped_note(path, reason):
    """Rank 0's scope note when its training ended it before the last gather (`Session.stop`)."""
    w = RunWriter(path, {"world_size": 2})
    w.event("scope_note", message=f"stopped without a final gather: {reason}")
    w.close()


def test_rank_0s_stopped_note_is_headed_by_the_failure_run_failed_names(tmp_path, capsys):
    # A reviewer's 2-rank Accelerate run: rank 1 raised after step 40, and rank 0's next all-reduce lost its
    # connection. Rank 0's note quoted that lost connection ("stopped without a final gather: the process
    # raised RuntimeError: [...pair.cc:553] Connection closed by peer"), under RUN.FAILED naming rank 1.
    closed = (
        "the process raised RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:54966. This is typically caused by a remote worker "
    )
    empty = np.empty((0, NCOLS))
    write_run(tmp_path / "r", steps=40)
    append_rank_rows(tmp_path / "r", 1, empty, "the process raised RuntimeError: injected failure", 40)
    append_rank_rows(tmp_path / "r", 0, empty, closed, 40)
    stopped_note(tmp_path / "r", closed)
    run = load_run(tmp_path / "r")
    (note,) = summarize(run.arrays, run.context).scope_notes
    assert note == (
        "stopped without a final gather: rank 1 failed after step 40: RuntimeError: injected failure "
        "(RUN.FAILED); rank 0's own error followed: RuntimeError: … Connection closed by peer"
    )
    assert main(["report", str(tmp_path / "r")]) == 0
    assert f"note {note}" in " ".join(capsys.readouterr().out.split())
    # Rank 1 killed without a word: the note names it as RUN.FAILED does.
    write_run(tmp_path / "k", steps=40)
    append_rank_rows(tmp_path / "k", 0, own_rows(rows_for(steps=9, first=41), 0), GLOO_RESET)
    stopped_note(tmp_path / "k", GLOO_RESET)
    run = load_run(tmp_path / "k")
    (note,) = summarize(run.arrays, run.context).scope_notes
    assert note.startswith(
        "stopped without a final gather: rank 1 was killed or aborted (no error of its own; records"
    )
    # Rank 0's own failure, the run's first, is the note's cause as it stands.
    write_run(tmp_path / "o", steps=40)
    append_rank_rows(tmp_path / "o", 0, empty, "the process raised ValueError: bad batch", 40)
    append_rank_rows(tmp_path / "o", 1, empty, closed, 40)
    stopped_note(tmp_path / "o", "the process raised ValueError: bad batch")
    run = load_run(tmp_path / "o")
    assert summarize(run.arrays, run.context).scope_notes == (
        "stopped without a final gather: the process raised ValueError: bad batch",
    )


def test_a_single_rank_failure_points_at_no_other_ranks(tmp_path):
    w = RunWriter(tmp_path / "r", {"world_size": 1, "interval": 10, "warmup": 2})
    w.event("segment", index=0, started_s=1000.0, resumed_from_step=0, world_size=1)
    w.append_rows(rows_for(world=1, steps=20))
    w.close()
    append_rank_rows(tmp_path / "r", 0, np.empty((0, NCOLS)), "the process raised ValueError: bad", 20)
    (failed,) = [f for f in findings_of(tmp_path / "r") if f.code == "RUN.FAILED"]
    assert failed.ranks == (0,) and "other ranks" not in failed.recommendation, failed.recommendation


def test_what_cannot_be_read_is_said_and_the_rest_kept(tmp_path, monkeypatch):
    """No permission (as a user other than root sees it): a run directory that cannot be looked into is bad
    input, one rank's unreadable file leaves the other ranks' rows read, with a note naming it."""
    from pathlib import Path

    import pytscope_core.rundir as rundir
    from pytscope_core.rundir import RunDirError

    write_run(tmp_path / "r", steps=30)
    for rank in (0, 1):
        later = rows_for(steps=1, first=31)
        append_rank_rows(tmp_path / "r", rank, later[later[:, COL["rank"]] == rank], "SIGTERM", at_step=31)
    read_rows = rundir.read_rows

    def denied(path, columns=None, name="steps.f64"):
        if name == "rank1.f64":
            raise PermissionError(13, "Permission denied")
        return read_rows(path, columns, name)

    monkeypatch.setattr(rundir, "read_rows", denied)
    run = load_run(tmp_path / "r")
    assert run.problems == ["ranks/rank1.f64 cannot be read (Permission denied); left out"]
    assert run.arrays.n_steps == 31  # rank 0's own row of step 31 is kept

    exists = Path.exists

    def no_look(path):
        if path.name == "meta.json":
            raise PermissionError(13, "Permission denied")
        return exists(path)

    monkeypatch.setattr(Path, "exists", no_look)
    with pytest.raises(RunDirError, match="cannot be read \\(Permission denied\\)"):
        load_run(tmp_path / "r")


def test_without_its_events_a_run_relaunched_on_more_ranks_keeps_every_rank(tmp_path):
    # meta.json has the first launch's 2 ranks; the relaunch on 4 is known from its segment event only.
    from runfactory import write_launches

    run = write_launches(tmp_path / "r", [(2, 30, 10.0), (4, 30, 10.0)])
    assert load_run(run).arrays.world_size == 4 and load_run(run).problems == []
    (run / "events.jsonl").unlink()
    (run / "events.jsonl").mkdir()
    loaded = load_run(run)
    assert loaded.arrays.world_size == 4 and not any("corrupt" in p for p in loaded.problems)


def test_a_folder_named_like_a_rank_file_leaves_the_other_rank_files_read(tmp_path):
    write_run(tmp_path)  # steps 1-60 gathered
    last = rows_for(steps=1, first=61)
    append_rank_rows(tmp_path, 1, last[last[:, COL["rank"]] == 1], "SIGTERM", at_step=61)
    (tmp_path / "ranks" / "rank3.f64").mkdir()
    (tmp_path / "ranks" / "rank3.jsonl").mkdir()
    run = load_run(tmp_path)
    assert run.problems == [] and run.arrays.n_steps == 61


def test_a_job_resumed_on_other_ranks_says_so_and_keeps_where_each_rank_ran(tmp_path, capsys):
    from runfactory import write_launches

    run = write_launches(tmp_path / "r", [(2, 60, 10.0), (1, 60, 10.0)])
    assert load_run(run).meta["hosts"] == ["h1", "h0"]  # rank 1 ran on h0 in the first launch only
    assert main(["report", str(run)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "world size 2 (steps 1-60), then 1 (steps 61-120)" in out
    assert "median over the 60 counted steps all 2 ranks ran (of 120)" in out


def test_a_job_resumed_on_other_ranks_is_not_unstable_for_having_two_step_times(tmp_path):
    # 140 steady steps of 10 ms on 2 ranks, then 60 of 30 ms on 1 rank: pooled, p95 is 3x the median and a
    # third of the wall sits above it; each launch on its own is perfectly steady.
    from runfactory import write_launches

    run = load_run(write_launches(tmp_path / "r", [(2, 140, 10.0), (1, 60, 30.0)]))
    found = diagnose(run.arrays, run.context)
    assert not [f for f in found if f.code in ("TIMING.JITTER", "TIMING.STALL")], found


def test_a_run_begun_with_fewer_columns_is_resumed_in_its_own_layout(tmp_path):
    # A run written before the optimizer_steps column, resumed by this version: its rows keep the run's
    # 18 columns (written wider, every row after the resume was shifted and read as corrupt).
    old = [c for c in COLUMNS if c != "optimizer_steps"]
    (tmp_path / "meta.json").write_text(
        json.dumps({"format": "pytscope-run/1", "columns": old, "world_size": 2})
    )
    (tmp_path / "steps.f64").write_bytes(rows_for(steps=30)[:, [COL[c] for c in old]].astype("<f8").tobytes())
    w = RunWriter(tmp_path, {"world_size": 2})
    w.event("segment", index=1, started_s=1100.0, resumed_from_step=30, world_size=2)
    w.append_rows(rows_for(steps=20, first=31, segment=1))
    w.close()
    append_rank_rows(tmp_path, 1, rows_for(steps=1, first=51, segment=1)[1:], "SIGTERM")
    run = load_run(tmp_path)
    assert run.problems == [] and run.arrays.steps.tolist() == list(range(1, 52))
    assert np.isnan(run.arrays.optimizer_steps).all()  # (a column the run never had)


def test_a_torn_last_row_is_said_and_its_missing_step_is_no_desync(tmp_path):
    # Killed while rank 0 wrote the last row (rank 1's step 60): that record is lost, nothing diverged.
    write_run(tmp_path)
    f = tmp_path / "steps.f64"
    f.write_bytes(f.read_bytes()[:-5])
    append_rank_rows(tmp_path, 1, rows_for(steps=1, first=61)[1:], "SIGTERM")  # rank 1 went on, to step 61
    run = load_run(tmp_path)
    assert any("torn last row" in p for p in run.problems) and run.context.records_lost
    assert "DIST.DESYNC" not in {x.code for x in diagnose(run.arrays, run.context)}


def test_a_run_without_its_end_of_run_summary_says_it_did_not_end(tmp_path, capsys):
    # Killed by SIGKILL or the OOM killer (or still running): the records look like a finished run's.
    write_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert "no end-of-run summary: killed" in " ".join(capsys.readouterr().out.split())
    assert main(["report", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run"]["ended"] is False
    (tmp_path / "summary.json").write_text("{}")  # what the end of the run writes, last
    assert load_run(tmp_path).context.ended


def test_a_run_a_hang_ended_says_so_where_the_summary_is_missing(tmp_path, capsys):
    write_run(tmp_path)
    hang = Finding(
        "DIST.HANG", Severity.HIGH, "Rank 1 is hung", "rank 1 at step 10 in `forward`", "See its stack"
    )
    with open(tmp_path / "events.jsonl", "a") as f:  # as the watchdog writes it, before every rank exits
        f.write(
            json.dumps({"type": "hang", "step": 10, "segment": 0, "t": 1010.0, "finding": hang.to_dict()})
        )
        f.write("\n")
    assert main(["report", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no end-of-run summary: ended by the hang below (on_hang='abort'), killed, or still hung" in out
    assert load_run(tmp_path).context.hang_reports[0]["segment"] == 0  # the launch it came from


@pytest.mark.parametrize("argv", [["--json"], ["--fail-on", "HIGH"]])
def test_a_reader_that_stops_reading_gets_no_traceback_and_the_verdict_holds(tmp_path, argv):
    """`pytscope report RUN | head`: the output's reader is gone before it is written (a closed pipe)."""
    write_run(tmp_path / "r")  # its integration finding is HIGH
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytscope_core.cli", "report", str(tmp_path / "r"), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == (1 if "--fail-on" in argv else 0), err
    assert err == ""


def test_a_missing_meta_a_torn_rank_file_and_an_unreadable_rank_line_are_said(tmp_path):
    write_run(tmp_path / "r", steps=30)
    append_rank_rows(tmp_path / "r", 1, rows_for(steps=2, first=31)[1::2], "SIGTERM")
    with open(tmp_path / "r" / "ranks" / "rank1.f64", "ab") as f:
        f.write(b"\0" * 12)  # killed while writing a row
    with open(tmp_path / "r" / "ranks" / "rank1.jsonl", "a") as f:
        f.write("{not json\n{not json either\n")
        f.write(
            json.dumps({"rank": 0, "reason": "the process raised RuntimeError: x", "last_step": 3}) + "\n"
        )
    (tmp_path / "r" / "meta.json").unlink()
    run = load_run(tmp_path / "r")
    said = " | ".join(run.problems)
    assert "meta.json is missing" in said and "torn last row of ranks/rank1.f64" in said, said
    assert "3 unreadable line(s) of ranks/rank1.jsonl skipped" in said  # once, counted
    assert run.context.failures == ()  # rank 1's file speaks for rank 1 only


def test_damage_no_reader_survived_before(tmp_path, capsys):
    # A number too large for a float, pipes and devices where files should be, forty thousand notes.
    run = write_run(tmp_path / "r")
    with open(run / "events.jsonl", "a") as f:
        f.write('{"type":"segment","index":Infinity,"started_s":1.0}\n')
        f.write('{"type":"meta","fields":{"peak_flops":1' + "0" * 400 + "}}\n")
        f.writelines(json.dumps({"type": "scope_note", "message": f"note {i}"}) + "\n" for i in range(40_000))
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "note 7" in out and "note 8" not in out and "... and 39992 more notes (all of them: --json)" in out
    assert "1 segment event(s) could not be read" in out
    for name in ("meta.json", "events.jsonl", "steps.f64"):
        broken = tmp_path / name
        shutil.copytree(run, broken)
        (broken / name).unlink()
        os.mkfifo(broken / name)  # read as a file, it blocked the report forever
        assert main(["report", str(broken)]) == 0
        out = capsys.readouterr().out
        assert ("meta.json is unreadable" if name == "meta.json" else f"{name} cannot be read") in out
    (tmp_path / "events.jsonl" / "events.jsonl").unlink()
    (tmp_path / "events.jsonl" / "events.jsonl").symlink_to("/dev/zero")  # read whole, it never ended
    assert main(["report", str(tmp_path / "events.jsonl")]) == 0


def test_outputs_never_overwrite_a_runs_own_files_nor_default_to_the_current_folder(tmp_path, capsys):
    run = write_run(tmp_path / "r")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["trace", str(run), "-o", str(run / "steps.f64")]) == 2
    assert main(["scaling", str(run), "--plot", str(run / "meta.json")]) == 2
    assert "it is one of the run's own files" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert main(["trace", str(run), "-o", str(run / "ranks")]) == 2  # (where its ranks will write)
    assert main(["trace", str(run), "-o", str(run / "trace.json")]) == 0  # a file of its own there is fine
    for argv in (
        ["demo", "--run-dir", ""],
        ["report", str(run), "--plots", " "],
        ["trace", str(run), "-o", ""],
        ["report", ""],
    ):
        assert main(argv) == 2
        assert "must not be empty" in capsys.readouterr().err


def test_a_report_on_an_ascii_terminal_replaces_what_it_cannot_draw(tmp_path):
    run = write_run(tmp_path / "r")
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytscope_core.cli", "report", str(run)],
        capture_output=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0 and b"Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert b"Step-time breakdown" in proc.stdout


def test_numpy_booleans_are_written_as_json_booleans():
    # json.dumps refuses numpy's bool; the summary's sanitiser turned it into 1.0.
    import json

    from pytscope_core.rundir import _jsonable
    from pytscope_core.summary import _plain

    value = {"flag": np.bool_(True), "n": [np.int64(3), np.float32(0.5)]}
    assert json.loads(json.dumps(_jsonable(value))) == {"flag": True, "n": [3, 0.5]}
    assert _plain(value) == {"flag": True, "n": [3, 0.5]}


def test_two_new_runs_that_choose_one_run_dir_at_once_take_two(tmp_path, monkeypatch):
    # Two jobs started at once: both chose their run directory before either wrote anything into it. Both
    # took the same one (a meta.json check, the write later) and one job's records were lost; the claim is
    # an exclusive create, so the second takes the next name, for a given run_dir and for the default.
    from pytscope_core.coordinator import run_directory_for

    run = tmp_path / "exp1"
    assert run_directory_for(run, resumed=False) == run
    assert run_directory_for(run, resumed=False) == tmp_path / "exp1-2"
    assert run_directory_for(run, resumed=True) == run  # a resume continues its own run
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("time.strftime", lambda fmt: "20260101-120000")  # the same second, as it often is
    first, second = (run_directory_for(None, resumed=False) for _ in range(2))
    assert (first, second) == (tmp_path / "runs" / "20260101-120000", tmp_path / "runs" / "20260101-120000-2")


def test_a_run_dir_is_taken_once_by_its_claim_or_an_earlier_versions_meta(tmp_path):
    from pytscope_core.rundir import claim_run_dir, hand_over_claim

    made = tmp_path / "made"  # a folder made for the run, still without one: the run takes it
    made.mkdir()
    assert claim_run_dir(made) and not claim_run_dir(made)
    RunWriter(tmp_path / "old", {"world_size": 1}).close()  # a run from before claims: meta.json alone
    assert not claim_run_dir(tmp_path / "old")
    hand_over_claim(made)  # the demo claims its folder, then its job's rank 0 takes it
    assert claim_run_dir(made)


def test_a_run_dir_without_a_name_of_its_own_numbers_the_folder_it_stands_for(tmp_path, monkeypatch):
    # "." holding a run: the next one goes beside the current folder ("<folder>-2"; it was an internal error,
    # PosixPath('.') has an empty name, that disabled the scope); the root's go inside it.
    from pytscope_core.coordinator import run_directory_for

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    RunWriter(".", {"world_size": 1}).close()
    assert run_directory_for(Path("."), resumed=False) == tmp_path / "work-2"
    beside = tmp_path.with_name(f"{tmp_path.name}-2")  # "..": the folder above the current one
    assert run_directory_for(Path(".."), resumed=False, take=lambda p: p == beside) == beside
    assert run_directory_for(Path("/"), resumed=False, take=lambda p: p == Path("/run-3")) == Path("/run-3")
