"""Two nodes on one machine: two `torchrun` launchers (c10d rendezvous on 127.0.0.1, `--node_rank` 0 and 1),
two gloo ranks each, every launcher's ranks named as a host of their own through PYTSCOPE_HOST. Which ranks
land on which "node" is the rendezvous's choice, so the tests read it back from the run (meta `hosts`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pytscope_core.demo import free_port
from pytscope_core.records import NCOLS
from pytscope_core.rundir import load_run
from pytscope_core.summary import summarize

pytestmark = pytest.mark.multiproc

JOB = Path(__file__).parent / "scripts" / "node_job.py"
HOSTS = ("node-a", "node-b")
LAUNCH_TIMEOUT_S = 150


def two_nodes(tmp_path: Path, *job_args: str) -> tuple[dict, list[str], list[int]]:
    """Run the job on two launchers; returns (summary dict, host of each rank, local rank of each rank)."""
    port = free_port()
    procs = []
    for node, host in enumerate(HOSTS):
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run"),  # torchrun, from this interpreter
            *("--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node), "--max_restarts", "0"),
            *("--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "nodes"),
            *("--local_addr", "127.0.0.1", str(JOB), "--run-dir", str(tmp_path / "run")),
            *("--out", str(tmp_path), *job_args),
        ]
        env = {**os.environ, "PYTSCOPE_HOST": host, "OMP_NUM_THREADS": "1"}
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    try:
        outputs = [p.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    run = load_run(tmp_path / "run")
    s = summarize(run.arrays, run.context, extra_findings=tuple(run.extra_findings)).to_dict()
    return s, list(run.meta["hosts"]), list(run.meta["local_ranks"])


def traffic(tmp_path: Path, rank: int) -> list[list[int]]:
    return json.loads((tmp_path / f"traffic-rank{rank}.json").read_text())


def test_a_slow_node_is_named_as_a_host_not_as_imbalance(tmp_path):
    s, hosts, local_ranks = two_nodes(tmp_path, "--slow-host", "node-b")
    assert sorted(hosts) == ["node-a", "node-a", "node-b", "node-b"] and sorted(local_ranks) == [0, 0, 1, 1]
    slow_ranks = [r for r, h in enumerate(hosts) if h == "node-b"]
    findings = {f["code"]: f for f in s["findings"]}
    node = findings["DIST.SLOW_NODE"]
    assert node["ranks"] == slow_ranks and node["severity"] in ("HIGH", "MED"), node
    assert "node-b" in node["title"] and "node-a" not in node["detail"]
    # One problem, one finding: the same ranks are not also a load imbalance or a straggler.
    assert not {"DIST.LOAD_IMBALANCE", "DIST.STRAGGLER"} & set(findings), s["findings"]
    assert [(r["rank"], r["host"]) for r in s["distributed"]["per_rank"]] == list(enumerate(hosts))
    # The console report groups ranks by node: host column, sorted by host then rank.
    table = (tmp_path / "run" / "summary.txt").read_text().split("Distributed", 1)[1]
    rows = [line.split()[:2] for line in table.splitlines() if line.startswith("node-")]
    assert rows == sorted([[h, str(r)] for r, h in enumerate(hosts)], key=lambda x: (x[0], int(x[1])))
    # The gather is one-way: every other rank sends its window and gets back two 8-byte numbers.
    assert all(received == 16 for r in (1, 2, 3) for _, received in traffic(tmp_path, r))
    assert {sent for r in (1, 2, 3) for sent, _ in traffic(tmp_path, r)} == {
        (1 + 25) * NCOLS * 8
    }  # header + 25 rows


def test_one_slow_rank_is_a_straggler_named_with_its_host(tmp_path):
    s, hosts, local_ranks = two_nodes(tmp_path, "--slow-host", "node-b", "--slow-local-rank", "1")
    slow = next(r for r in range(4) if hosts[r] == "node-b" and local_ranks[r] == 1)
    findings = {f["code"]: f for f in s["findings"]}
    straggler = findings["DIST.STRAGGLER"]
    assert straggler["ranks"] == [slow] and straggler["severity"] in ("HIGH", "MED"), straggler
    assert f"Rank {slow} on host node-b is a straggler" in straggler["title"]
    assert f"Rank {slow} on host node-b, local rank 1 does" in straggler["detail"]
    assert "DIST.SLOW_NODE" not in findings and "DIST.LOAD_IMBALANCE" not in findings, s["findings"]
