import math

import numpy as np

from pytscope_core.recorder import StepRecorder
from pytscope_core.records import COL
from pytscope_core.timeline import Mark


class FakeClock:
    """An injected clock: each call advances by the next programmed amount (ns)."""

    def __init__(self, step_ns=1_000_000):
        self.t = 0
        self.step_ns = step_ns

    def now(self):
        self.t += self.step_ns
        return self.t

    @staticmethod
    def to_ms(stamps):
        return [s / 1e6 for s in stamps]  # a plain list, as a custom clock may return


def micro_batch(rec, samples=8.0):
    rec.loop_top(Mark.DATA_BEGIN)
    rec.mark(Mark.DATA_END)
    rec.mark(Mark.FORWARD_BEGIN)
    rec.forward_ended(samples)
    rec.mark(Mark.BACKWARD_BEGIN)
    rec.mark(Mark.GRAPH_DONE)
    rec.mark(Mark.BACKWARD_END)
    rec.count_grad_sync()


def test_a_step_closes_at_the_first_loop_top_after_the_optimizer_step():
    clock = FakeClock()
    rec = StepRecorder(clock=clock, memory=lambda: 123.0, host_ns=lambda: 5_000_000_000)
    for _ in range(3):
        for _ in range(4):  # gradient accumulation: four micro-batches, one optimizer step
            micro_batch(rec)
        rec.mark(Mark.OPTIMIZER_BEGIN)
        rec.optimizer_stepped()
        rec.set_loss(2.5)
    assert rec.steps_done == 2  # the third closes at the next loop top (or close())
    assert rec.completed == (3, 12, 12)  # a checkpoint taken now includes the step just taken
    rec.close()
    rows = rec.drain(rank=1, segment=0, epoch_offset_s=0.0)
    assert rows.shape[0] == 3
    assert list(rows[:, COL["step"]]) == [1, 2, 3]
    assert (rows[:, COL["micro_batches"]] == 4).all() and (rows[:, COL["samples"]] == 32).all()
    assert (rows[:, COL["grad_syncs"]] == 4).all()
    assert (rows[:, COL["loss"]] == 2.5).all() and (rows[:, COL["mem_bytes"]] == 123).all()
    phase_sum = rows[:, COL["data_ms"] : COL["other_ms"] + 1].sum(axis=1)
    assert abs(phase_sum - rows[:, COL["wall_ms"]]).max() < 1e-9
    assert rows[0, COL["start_s"]] == 5.0 and rows[0, COL["rank"]] == 1
    assert rec.window == []


def test_an_optimizer_step_no_step_was_open_for_is_counted_so_step_n_stays_the_nth():
    # A model compiled in place after watch(), without a watched loader: its first forward runs inside the
    # compiled code and opens no step. That optimizer step is not timed, but the next one is step 2, not 1.
    rec = StepRecorder(clock=FakeClock())
    rec.mark(Mark.OPTIMIZER_BEGIN)  # (ignored: no step open)
    rec.optimizer_stepped()
    for _ in range(2):
        micro_batch(rec)
        rec.mark(Mark.OPTIMIZER_BEGIN)
        rec.optimizer_stepped()
    rec.close()
    assert rec.drain(rank=0, segment=0, epoch_offset_s=0.0)[:, COL["step"]].tolist() == [2, 3]
    assert rec.steps_done == 3
    rec.stop()
    rec.optimizer_stepped()  # a stopped recorder counts nothing more
    assert rec.steps_done == 3


def test_a_loop_without_optimizer_step_is_dropped_at_close():
    rec = StepRecorder(clock=FakeClock())
    micro_batch(rec)
    rec.close()
    assert rec.drain(0, 0, 0.0).shape[0] == 0


def test_tensor_losses_are_resolved_only_at_drain():
    import torch

    rec = StepRecorder(clock=FakeClock())
    micro_batch(rec)
    rec.optimizer_stepped()
    rec.set_loss(torch.tensor(float("inf")))
    rec.close()
    rows = rec.drain(0, 0, 0.0)
    assert math.isinf(rows[0, COL["loss"]])


def test_the_last_step_ends_at_its_last_mark_not_when_training_is_ended():
    # A loop left with `break`, then evaluation or saving before finish(): that time is not the step's.
    clock = FakeClock()
    rec = StepRecorder(clock=clock)
    for _ in range(2):
        micro_batch(rec)
        rec.optimizer_stepped()
    clock.t += 2_000_000_000  # two seconds after the loop
    rec.close()
    wall = rec.drain(0, 0, 0.0)[:, COL["wall_ms"]]
    assert wall[1] == wall[0] - 1.0  # (the first also holds the stamp of the loop top that closed it)


def slow_mark(clock, mark, which, ms):
    """`mark(which)` stamped `ms` after the mark before it (the clock then goes on a millisecond a mark)."""
    clock.step_ns = int(ms * 1e6)
    mark(which)
    clock.step_ns = 1_000_000


def test_collectives_and_forwards_after_the_last_optimizer_step_are_not_the_steps():
    # A loop that breaks at its step limit: no fetch closes its last step. An evaluation whose metric is
    # gathered (here its forward in training mode, too) and a barrier before saving mark before finish(); the
    # step closed at its last mark ran to the last of them (under Accelerate, a stall of the last step).
    clock = FakeClock()
    rec = StepRecorder(clock=clock)
    for _ in range(2):
        micro_batch(rec)
        rec.mark(Mark.OPTIMIZER_BEGIN)
        rec.optimizer_stepped()
    clock.step_ns = 500_000_000  # each mark after the loop half a second after the one before
    for _ in range(3):
        rec.mark(Mark.FORWARD_BEGIN)
        rec.forward_ended(0.0)  # (a batch's samples count at its first forward: the hooks give 0 after)
        rec.mark(Mark.LOOP_COMM_BEGIN)  # gather_for_metrics
        rec.mark(Mark.LOOP_COMM_END)
    rec.mark(Mark.LOOP_COMM_BEGIN)  # wait_for_everyone()
    rec.mark(Mark.LOOP_COMM_END)
    rec.close()
    rows = rec.drain(0, 0, 0.0)
    assert rows[1, COL["wall_ms"]] == rows[0, COL["wall_ms"]] - 1.0  # (as a step left with nothing after)
    assert rows[1, COL["loop_comm_ms"]] == 0 and rows[1, COL["other_ms"]] == rows[0, COL["other_ms"]] - 1.0
    assert rows[1, COL["micro_batches"]] == 1 and rows[1, COL["samples"]] == 8
    assert rec.micro_batches == 2


def test_the_last_steps_own_slow_work_stays_in_it_when_collectives_follow():
    clock = FakeClock()
    rec = StepRecorder(clock=clock)
    micro_batch(rec)
    rec.mark(Mark.LOOP_COMM_BEGIN)  # a metric's all-reduce before the optimizer step: 400 ms
    slow_mark(clock, rec.mark, Mark.LOOP_COMM_END, 400)
    rec.mark(Mark.OPTIMIZER_BEGIN)
    slow_mark(clock, lambda _: rec.optimizer_stepped(), Mark.OPTIMIZER_END, 400)  # a 400 ms optimizer step
    rec.mark(Mark.PAUSE_BEGIN)  # a checkpoint saved in the step, paused: 300 ms
    slow_mark(clock, rec.mark, Mark.PAUSE_END, 300)
    clock.step_ns = 2_000_000_000
    rec.mark(Mark.LOOP_COMM_BEGIN)  # after the loop, two seconds later: a barrier
    rec.mark(Mark.LOOP_COMM_END)
    rec.close()
    (row,) = rec.drain(0, 0, 0.0)
    assert row[COL["optimizer_ms"]] == 400 and row[COL["loop_comm_ms"]] == 400
    assert row[COL["excluded_ms"]] == 300 and row[COL["wall_ms"]] == 809  # (and 9 intervals of 1 ms)

    # A step whose batch a NaN guard skipped, kept at the run's end: it ends at its forward.
    clock.step_ns = 1_000_000
    rec = StepRecorder(clock=clock)
    rec.loop_top(Mark.DATA_BEGIN)
    rec.mark(Mark.DATA_END)
    rec.mark(Mark.FORWARD_BEGIN)
    rec.forward_ended(8.0)
    rec.set_loss(math.nan)
    clock.step_ns = 1_000_000_000
    rec.mark(Mark.LOOP_COMM_BEGIN)
    rec.mark(Mark.LOOP_COMM_END)
    rec.close(keep_skipped=True)
    (row,) = rec.drain(0, 0, 0.0)
    assert row[COL["wall_ms"]] == 3 and row[COL["forward_ms"]] == 1


def test_a_steps_loss_is_its_micro_batches_mean_and_a_nan_or_inf_one_is_never_averaged_away():
    import torch

    rec = StepRecorder(clock=FakeClock())
    logged = [
        [torch.tensor(float("inf")), torch.tensor(0.5)],  # a skipped optimizer step merges two iterations
        [float("nan")],  # a NaN loss, which must read differently from "not logged"
        [],  # not logged
        [torch.tensor(2.0), torch.tensor(0.25), 0.75],  # an accumulation window: the mean of its losses
    ]
    for losses in logged:
        micro_batch(rec)
        for loss in losses:
            rec.set_loss(loss)
        rec.optimizer_stepped()
    rec.close()
    loss = rec.drain(0, 0, 0.0)[:, COL["loss"]]
    assert math.isinf(loss[0]) and math.isinf(loss[1]) and math.isnan(loss[2]) and loss[3] == 1.0


def test_the_recorders_own_work_is_inside_the_step_it_serves():
    """Time the recorder spends closing a step (here a slow memory read) must land in that step, not in the
    gap before the next one: step walls then add up to the loop's wall time."""
    clock = FakeClock(step_ns=1_000)

    def slow_memory():
        clock.t += 5_000_000  # a 5 ms read
        return 1.0

    rec = StepRecorder(clock=clock, memory=slow_memory, host_ns=lambda: 0)
    for _ in range(3):
        micro_batch(rec)
        rec.mark(Mark.OPTIMIZER_BEGIN)
        rec.optimizer_stepped()
    rec.close()
    closed = list(rec.window)
    assert len(closed) == 3
    for before, after in zip(closed, closed[1:], strict=False):
        assert after.stamps[0] - before.stamps[-1] < 1_000_000  # no read between a step's end and the next
    first = rec.drain(rank=0, segment=0, epoch_offset_s=0.0)[0]
    assert first[COL["wall_ms"]] >= 5.0  # the first step reads memory (nothing read yet) and pays for it


def test_a_loader_of_numpy_arrays_is_sized_and_fingerprinted():
    """Batches of numpy arrays (a common hand-written loader): the step's samples and the fingerprint taken
    every 8th step come from the first array, and nothing raises (which would disable the scope)."""
    import numpy as np

    from pytscope_core.hooks import TorchHooks

    errors: list[BaseException] = []
    rec = StepRecorder(clock=FakeClock(), memory=lambda: 1.0, host_ns=lambda: 0)
    hooks = TorchHooks(rec, errors.append)
    for step in range(2):
        hooks.data_begin()
        hooks.data_end((np.arange(32.0).reshape(8, 4) + step, np.zeros(8)))
        rec.mark(Mark.FORWARD_BEGIN)
        hooks.forward_done(None, grad_sync=False)
        rec.mark(Mark.OPTIMIZER_BEGIN)
        rec.optimizer_stepped()
    rec.close()
    rows = rec.drain(rank=0, segment=0, epoch_offset_s=0.0)
    assert errors == []
    assert list(rows[:, COL["samples"]]) == [8.0, 8.0]
    assert math.isfinite(rows[0, COL["batch_fp"]]) and math.isnan(rows[1, COL["batch_fp"]])


def test_a_batch_off_numpys_path_is_fingerprinted_without_a_blocking_copy(monkeypatch):
    """The path device tensors take: the sampled positions go to the device once per size, asynchronously (a
    blocking copy would wait for the kernels queued before it every 8th step), and the fingerprint equals
    the one numpy's path takes of the same values."""
    import torch

    import pytscope_core.batches as batches
    from pytscope_core.batches import fingerprint, resolve_fingerprints

    monkeypatch.setattr(batches, "_DEVICE_POSITIONS", {})  # (not made by an earlier test)
    copies: list[bool] = []
    to = torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        copies.append(kwargs.get("non_blocking", False))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    batch = torch.arange(1001.0, requires_grad=True)  # numpy cannot read it: torch's path, as on a GPU
    prints = [fingerprint(batch), fingerprint(batch * 2), fingerprint(batch.detach())]
    assert copies == [True]
    device_path, doubled, numpy_path = resolve_fingerprints(prints)
    assert device_path == numpy_path != doubled


def test_logged_values_are_read_as_numbers_or_not_at_all():
    import torch

    from pytscope_core.recorder import step_losses
    from pytscope_core.values import to_floats

    values = [
        None, 1, np.float32(2.5), np.array([1.0, 3.0]), torch.tensor(4.0), torch.tensor([1.0, 3.0]),
        torch.tensor(3.0, dtype=torch.bfloat16), torch.tensor(float("nan")), "1.5", {"a": 1}, 10**400,
        torch.tensor(1 + 2j), torch.tensor([]), torch.tensor(5.0, device="meta"),
    ]  # fmt: skip
    read = to_floats(values)
    assert read[:7] == [None, 1.0, 2.5, 2.0, 4.0, 2.0, 3.0] and math.isnan(read[7])
    assert read[8:] == [None] * 6  # text, containers, overflow, complex, empty, unreadable: not numbers
    # A step whose only loss is not a number has no loss; a NaN loss is non-finite.
    assert math.isnan(step_losses([["abc"]])[0]) and step_losses([[torch.tensor(float("nan"))]]) == [math.inf]


def test_a_batch_in_a_mapping_is_read_by_its_batch_size_not_by_whatever_comes_first():
    from collections import UserDict

    import torch

    from pytscope_core.batches import batch_tensor

    class Encoding(UserDict):  # as transformers' BatchEncoding: a Mapping, not a dict
        pass

    ids = torch.arange(6 * 16).reshape(6, 16)
    assert batch_tensor(Encoding(input_ids=ids, labels=torch.zeros(6))) is ids
    # A mask listed first whose leading dimension is the sequence: passed over for the tensors most share.
    batch = {"feature_mask": torch.ones(16), "input_ids": ids, "attention_mask": torch.ones(6, 16)}
    assert batch_tensor(batch) is ids and batch_tensor([[torch.ones(3)]]).shape == (3,)
    assert batch_tensor({"text": ["a", "b"]}) is None


def test_the_pass_a_rank_is_in_tells_a_forwards_collective_from_a_backwards():
    # Under FSDP2 both are COMM_BEGIN marks at the same step and sync counts: the watchdog tells them apart by
    # the pass (and the forwards begun in the step) that a heartbeat carries.
    rec = StepRecorder(clock=FakeClock())
    assert rec.pass_now() == (0, "")
    rec.loop_top(Mark.DATA_BEGIN)
    rec.mark(Mark.DATA_END)
    assert rec.pass_now() == (0, "")
    rec.mark(Mark.FORWARD_BEGIN)
    rec.mark(Mark.COMM_BEGIN)  # the root unit's all-gather
    assert rec.pass_now() == (1, "forward")
    rec.mark(Mark.COMM_END)
    rec.forward_ended(8.0)
    rec.mark(Mark.COMM_BEGIN)  # a pre-backward all-gather may come before the backward's own mark
    assert rec.pass_now() == (1, "backward")
    rec.mark(Mark.COMM_END)
    rec.mark(Mark.BACKWARD_BEGIN)
    rec.mark(Mark.COMM_BEGIN)  # a reduce-scatter
    assert rec.pass_now() == (1, "backward")
    # A rank that skipped that backward (no optimizer step: the step stays open) is in its next forward.
    skipper = StepRecorder(clock=FakeClock())
    skipper.loop_top(Mark.DATA_BEGIN)
    skipper.mark(Mark.FORWARD_BEGIN)
    skipper.forward_ended(8.0)
    skipper.loop_top(Mark.DATA_BEGIN)
    skipper.mark(Mark.FORWARD_BEGIN)
    skipper.mark(Mark.COMM_BEGIN)
    assert skipper.pass_now() == (2, "forward") and skipper.steps_done == rec.steps_done == 0
