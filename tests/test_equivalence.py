"""The distributed-equivalence check: the diagnosis on synthetic gradients with a known answer, then real
2-rank gloo runs of correct and broken training steps, then the `pytscope equivalence` command."""

import subprocess
import sys
import time
from pathlib import Path

import equivalence_models as m
import numpy as np
import pytest

from pytscope_core.equivalence import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    EquivalenceError,
    EquivalenceSetupError,
    WorkerError,
    check_equivalence,
    compare_to_reference,
)

TESTS = Path(__file__).parent


def arrays(seed=0, grad_scale=1.0, noise=0.0):
    rng = np.random.default_rng(seed)
    ref, dist = {}, {}
    for name, shape in [("0.weight", (16, 8)), ("0.bias", (16,)), ("2.weight", (4, 16))]:
        g = rng.normal(size=shape).astype(np.float32)
        p = rng.normal(size=shape).astype(np.float32)
        ref[f"grad/{name}"], ref[f"param/{name}"] = g, p - 0.1 * g
        gd = grad_scale * g + noise * rng.normal(size=shape).astype(np.float32)
        dist[f"grad/{name}"], dist[f"param/{name}"] = gd, p - 0.1 * gd
    return ref, dist


def compare(ref, dist, **kw):
    return compare_to_reference(ref, dist, **{"world_size": 2, "steps": 1, "micro_batches": 1, **kw})


def test_identical_runs_pass_with_the_stated_tolerance():
    ref, dist = arrays()
    dist = {k: v * (1 + 1e-6) for k, v in dist.items()}  # float32 summation-order noise
    r = compare(ref, dist)
    assert r.passed and r.cause is None and r.first_difference is None
    assert (r.rtol, r.atol) == (DEFAULT_RTOL, DEFAULT_ATOL) == (1e-4, 1e-6)
    assert "matches" in r.describe() and "1e-06 + 0.0001 * |reference|" in r.describe()
    assert all(0 < p.tolerance_used < 0.1 for p in r.parameters)


@pytest.mark.parametrize(
    "scale, world_size, micro_batches, expected",
    [
        (2.0, 2, 1, "scaled by the world size"),
        (4.0, 2, 4, "does not divide the loss by the number of micro-batches (4)"),
        (8.0, 2, 4, "both a loss scaled by the world size"),
        (0.5, 2, 1, "summed over samples"),
        (3.0, 2, 1, "scaled by a constant"),
    ],
)
def test_a_uniform_gradient_ratio_names_its_cause(scale, world_size, micro_batches, expected):
    ref, dist = arrays(grad_scale=scale)
    r = compare(ref, dist, world_size=world_size, micro_batches=micro_batches)
    assert not r.passed and expected in r.cause
    assert f"every gradient is {scale:g}x the reference" in r.cause
    assert all(p.grad_norm_ratio == pytest.approx(scale, rel=1e-5) for p in r.parameters)
    with pytest.raises(AssertionError):  # EquivalenceError is what a test suite's runner reports
        raise EquivalenceError(r)


def test_a_ratio_that_is_both_the_micro_batches_and_the_world_size_names_both_causes():
    # Two un-normalised micro-batches on two ranks: 2x is the undivided accumulation as much as a loss scaled
    # by the world size, and the step did accumulate. It read as the world size first (and only, where the
    # message was cut short).
    ref, dist = arrays(grad_scale=2.0)
    cause = compare(ref, dist, world_size=2, micro_batches=2).cause
    assert cause.startswith(
        "every gradient is 2x the reference, and 2 is both the number of micro-batches and the world size, so "
        "either of two causes fits: an accumulation loop that does not divide the loss by the number of "
        "micro-batches (2); or the loss is scaled by the world size (2)"
    )


def test_a_scatter_is_blamed_on_batchnorm_only_when_the_model_has_it():
    ref, dist = arrays(noise=0.3)
    assert "BatchNorm without SyncBatchNorm" in compare(ref, dist, batchnorm_layers=["1"]).cause
    generic = compare(ref, dist).cause
    assert "not a uniform ratio" in generic and "BatchNorm" not in generic


def test_matching_gradients_with_differing_parameters_point_at_the_optimizer():
    ref, dist = arrays()
    dist["param/0.bias"] = dist["param/0.bias"] + 1e-2
    r = compare(ref, dist, steps=3)
    assert not r.passed and r.first_difference.name == "0.bias" and r.first_difference.grad_ok
    assert "value after step 3" in r.describe() and "optimizer" in r.cause


def test_bad_setups_are_refused_before_any_process_starts():
    with pytest.raises(EquivalenceSetupError, match="does not split evenly over 3 workers"):
        check_equivalence(m.mlp, m.mse, m.regression_batch(32), world_size=3)
    with pytest.raises(EquivalenceSetupError, match="model_factory cannot be sent"):
        check_equivalence(lambda: m.mlp(), m.mse, m.regression_batch(32))
    with pytest.raises(EquivalenceSetupError, match="pair"):
        check_equivalence(m.mlp, m.mse, m.not_a_pair())


@pytest.mark.multiproc
def test_a_correct_model_passes():
    r = check_equivalence(m.mlp, m.mse, m.regression_batch(), world_size=2, steps=2)
    assert r.passed and r.world_size == 2 and r.steps == 2 and r.micro_batches == 1
    assert [p.name for p in r.parameters] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    # Summation order is the only difference: measured at about 1% of the tolerance.
    assert max(p.tolerance_used for p in r.parameters) < 0.1
    assert all(p.grad_norm_ratio == pytest.approx(1.0, rel=1e-4) for p in r.parameters)


@pytest.mark.multiproc
def test_a_loss_scaled_by_the_world_size_fails_and_says_so():
    with pytest.raises(EquivalenceError) as info:
        check_equivalence(m.mlp, m.mse_times_world_size, m.regression_batch(), world_size=2)
    assert "first at parameter '0.weight', gradient" in str(info.value)
    assert "every gradient is 2x the reference" in str(info.value)
    assert "the loss is scaled by the world size (2)" in str(info.value)
    assert not info.value.result.passed and info.value.result.first_difference.name == "0.weight"


@pytest.mark.multiproc
def test_batchnorm_without_sync_fails_and_names_batchnorm():
    with pytest.raises(
        EquivalenceError, match="BatchNorm without SyncBatchNorm computes statistics per rank"
    ):
        check_equivalence(m.mlp_batchnorm, m.mse, m.regression_batch(), world_size=2)


@pytest.mark.multiproc
def test_sync_batchnorm_matches_where_it_runs():
    try:
        r = check_equivalence(m.mlp_sync_batchnorm, m.mse, m.regression_batch(), world_size=2)
    except WorkerError as exc:
        # torch 2.13's DDP refuses SyncBatchNorm in a CPU module ("SyncBatchNorm layers only work with GPU
        # modules", and SyncBatchNorm.forward itself wants GPU tensors), so the fixed model cannot be shown
        # to pass on gloo/CPU. The attempt still checks that the refusal surfaces as one clean error.
        if "SyncBatchNorm layers only work with GPU modules" in str(exc):
            pytest.skip(
                "SyncBatchNorm needs GPU modules under DDP in this torch; the CPU check cannot run it"
            )
        raise
    assert r.passed


@pytest.mark.multiproc
def test_accumulation_without_dividing_fails_and_with_dividing_passes():
    with pytest.raises(EquivalenceError) as info:
        check_equivalence(m.mlp, m.mse, m.regression_batch(), step_fn=m.accumulate_undivided)
    assert info.value.result.micro_batches == m.MICRO_BATCHES == 4
    assert "every gradient is 4x the reference" in str(info.value)
    assert "accumulation loop that does not divide the loss by the number of micro-batches" in str(info.value)

    r = check_equivalence(m.mlp, m.mse, m.regression_batch(), step_fn=m.accumulate_divided)
    assert r.passed and r.micro_batches == 4


@pytest.mark.multiproc
def test_an_error_in_a_worker_surfaces_in_the_caller_without_a_hang():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed: RuntimeError: rank 1 cannot do this"):
        check_equivalence(m.fails_on_rank_1, m.mse, m.regression_batch())
    assert time.monotonic() - start < 60  # rank 0, stuck in its all-reduce, was ended, not waited for


def test_the_rank_that_failed_first_is_named_not_the_peer_it_took_down():
    # Rank 1 fails; rank 0 then fails in its all-reduce as rank 1's connections close, and when both processes
    # end together torch's join may report rank 0 first. The ranks' own records say who failed first.
    import json

    import torch.distributed as dist
    import torch.multiprocessing as mp

    from pytscope_core.dataparallel import FAILURE_KEY, Workers

    class BothFailed:
        processes = [None, None]

        def join(self, timeout):
            raise mp.ProcessRaisedException("RuntimeError: Connection closed by peer", 0, 1000)

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    echo = dict(t=101.0, error="RuntimeError: Connection closed by peer [127.0.0.1]:4242", traceback="tb 0")
    cause = dict(t=100.0, error="RuntimeError: rank 1 cannot do this", traceback="tb 1")
    for rank, failure in [(0, echo), (1, cause)]:
        store.set(FAILURE_KEY.format(rank=rank), json.dumps(failure))
    with pytest.raises(WorkerError) as info:
        Workers(BothFailed(), store).wait(5)
    assert str(info.value) == "rank 1 failed: RuntimeError: rank 1 cannot do this\ntb 1"

    # A rank may also die by a signal after recording its error (an abort on its way out): the record wins.
    class DiedOnItsWayOut(BothFailed):
        def join(self, timeout):
            raise mp.ProcessExitedException("terminated with signal SIGABRT", 0, 1000, -6, "SIGABRT")

    with pytest.raises(WorkerError, match="rank 1 failed: RuntimeError: rank 1 cannot do this"):
        Workers(DiedOnItsWayOut(), store).wait(5)
    store.delete_key(FAILURE_KEY.format(rank=1))  # a rank that died without a word: the earliest record
    with pytest.raises(WorkerError, match="rank 0 failed: RuntimeError: Connection closed by peer"):
        Workers(BothFailed(), store).wait(5)
    store.delete_key(FAILURE_KEY.format(rank=0))
    with pytest.raises(WorkerError, match="rank 0 died: terminated with signal SIGABRT"):
        Workers(DiedOnItsWayOut(), store).wait(5)


@pytest.mark.multiproc
def test_workers_that_never_finish_are_killed_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(WorkerError, match="did not finish within 6 s"):
        check_equivalence(m.hangs_in_workers, m.mse, m.regression_batch(), timeout_s=6)
    assert time.monotonic() - start < 30


def test_each_rank_gets_the_distributed_sampler_shard():
    import torch

    from pytscope_core.dataparallel import shard

    batch = {"x": torch.arange(12), "pair": (torch.arange(12) * 10, "not a tensor")}
    out = shard(batch, 1, 3)
    assert out["x"].tolist() == [1, 4, 7, 10] and out["pair"][0].tolist() == [10, 40, 70, 100]
    assert out["pair"][1] == "not a tensor"


def pytscope(factory, loss, batch, *extra, console_script=False):
    # The console script must find the user's modules in the working directory, as `python -m` does.
    script = Path(sys.executable).parent / "pytscope"
    command = [str(script)] if console_script else [sys.executable, "-m", "pytscope_core.cli"]
    names = [f"equivalence_models:{n}" if n and ":" not in n else n for n in (factory, loss, batch)]
    return subprocess.run(
        [*command, "equivalence", names[0], "--loss", names[1], "--batch", names[2], *extra],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.multiproc
def test_cli_passes_a_correct_model():
    done = pytscope("mlp", "cross_entropy", "classification_batch", "--world-size", "2", "--steps", "2")
    assert done.returncode == 0, done.stderr
    assert "0.weight" in done.stdout and "grad max abs" in done.stdout
    assert "PASS distributed run (2 workers, 2 steps) matches" in done.stdout


@pytest.mark.multiproc
@pytest.mark.skipif(
    not (Path(sys.executable).parent / "pytscope").exists(), reason="console script not installed"
)
def test_cli_fails_a_world_size_scaled_loss():
    done = pytscope("mlp", "mse_times_world_size", "regression_batch", console_script=True)
    assert done.returncode == 1, done.stderr
    assert "FAIL" in done.stdout and "DIFFERS" in done.stdout
    assert "scaled by the world size" in " ".join(done.stdout.split())  # rich wraps long lines


@pytest.mark.parametrize(
    "args, message",
    [
        (("no_such_module:mlp", "mse", "regression_batch"), "cannot import 'no_such_module'"),
        (("nope", "mse", "regression_batch"), "'equivalence_models' has no 'nope'"),
        (("mlp", "equivalence_models:", "regression_batch"), "--loss must be MODULE:NAME"),
        (("mlp", "mse", "not_a_pair"), "batch must be a pair (inputs, targets)"),
        (("mlp", "mse", "regression_batch", "--world-size", "3"), "does not split evenly over 3 workers"),
        pytest.param(
            ("mlp", "loss_of_model_and_batch", "regression_batch"),
            "the one-process reference run failed: ",
            marks=pytest.mark.multiproc,
        ),
        pytest.param(
            ("fails_on_rank_1", "mse", "regression_batch"),
            "rank 1 failed: RuntimeError: rank 1 cannot do this",
            marks=pytest.mark.multiproc,
        ),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message):
    done = pytscope(*args)
    assert done.returncode == 2, done.stdout
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
