from pytscope_core.records import PHASES
from pytscope_core.timeline import Mark as M
from pytscope_core.timeline import attribute, attribute_many


def test_phases_sum_to_wall_and_pause_is_excluded():
    marks = [
        M.STEP_START,
        M.DATA_BEGIN,
        M.DATA_END,
        M.FORWARD_BEGIN,
        M.FORWARD_END,
        M.BACKWARD_BEGIN,
        M.GRAPH_DONE,
        M.BACKWARD_END,
        M.OPTIMIZER_BEGIN,
        M.OPTIMIZER_END,
        M.PAUSE_BEGIN,
        M.PAUSE_END,
        M.STEP_END,
    ]
    times = [0, 0, 2, 2.5, 5, 5.5, 9, 11, 11.2, 12, 12.5, 20, 20.3]
    phases, excluded, wall = attribute(marks, times)
    assert excluded == 7.5
    assert abs(wall - (20.3 - 7.5)) < 1e-9
    assert abs(sum(phases) - wall) < 1e-9
    data, forward, backward, comm, optimizer, other = phases
    assert (data, forward, backward, comm) == (2.0, 2.5, 3.5, 2.0)
    assert abs(other - 2.0) < 1e-9  # the gaps between hooks: 0.5 + 0.5 + 0.2 + 0.5 + 0.3


def test_nested_forward_inside_optimizer_closure_goes_to_the_innermost_phase():
    # Closure-style optimizers (LBFGS, Lightning) run forward/backward inside step().
    marks = [M.STEP_START, M.OPTIMIZER_BEGIN, M.FORWARD_BEGIN, M.FORWARD_END, M.OPTIMIZER_END, M.STEP_END]
    phases, _, wall = attribute(marks, [0, 1, 2, 6, 7, 7])
    assert phases[1] == 4 and phases[4] == 2 and phases[5] == 1 and wall == 7


def test_a_close_without_open_is_ignored_and_an_open_phase_runs_to_the_end():
    marks = [M.STEP_START, M.DATA_END, M.FORWARD_BEGIN, M.STEP_END]
    phases, _, wall = attribute(marks, [0, 1, 3, 10])
    assert phases[5] == 3 and phases[1] == 7 and wall == 10


def test_backward_that_begins_inside_a_nested_wait_continues_after_it():
    # FSDP2 with the loss's autograd node inside the model's output: FSDP's own pre-backward hook on the
    # output starts a wait for an all-gather, and the output's pre-hook begins backward inside that wait.
    marks = [
        M.STEP_START,
        M.COMM_BEGIN,
        M.BACKWARD_BEGIN,
        M.COMM_END,
        M.COMM_BEGIN,  # a reduce-scatter's wait in backward
        M.COMM_END,
        M.GRAPH_DONE,
        M.BACKWARD_END,
        M.STEP_END,
    ]
    phases, _, wall = attribute(marks, [0, 1, 2, 3, 5, 6, 9, 10, 11])
    data, forward, backward, comm, optimizer, other = phases
    assert (backward, comm, other) == (6, 3, 2) and wall == 11


def test_gradient_accumulation_micro_batches_add_up():
    one = [
        M.DATA_BEGIN,
        M.DATA_END,
        M.FORWARD_BEGIN,
        M.FORWARD_END,
        M.BACKWARD_BEGIN,
        M.GRAPH_DONE,
        M.BACKWARD_END,
    ]
    marks = [M.STEP_START] + one * 3 + [M.OPTIMIZER_BEGIN, M.OPTIMIZER_END, M.STEP_END]
    times = [0.0]
    for _ in range(3):
        t = times[-1]
        times += [t, t + 1, t + 1, t + 3, t + 3, t + 6, t + 7]
    t = times[-1]
    times += [t, t + 2, t + 2]
    phases, _, wall = attribute(marks, times)
    assert phases[:5] == [3, 6, 9, 3, 2] and wall == 23


def test_attribute_many_matches_attribute_on_random_sequences():
    import random

    import numpy as np

    from pytscope_core.timeline import attribute_many

    rng = random.Random(0)
    middle = [m for m in M if m not in (M.STEP_START, M.STEP_END)]
    marks, times = [], []
    for _ in range(300):
        body = (
            [rng.choice(middle) for _ in range(rng.randint(0, 12))]
            if rng.random() < 0.5
            else [M.DATA_BEGIN, M.DATA_END]
        )
        seq = [M.STEP_START, *body, M.STEP_END]
        t = sorted(rng.uniform(0, 50) for _ in seq)
        marks.append(seq)
        times.append(t)
    many = attribute_many(marks, [t for ts in times for t in ts])
    for row, seq, t in zip(many, marks, times, strict=True):
        phases, excluded, wall = attribute(seq, t)
        assert np.allclose(row[:-1], [*phases, excluded, wall])
        assert -1e-9 <= row[-1] <= phases[PHASES.index("comm")] + 1e-9  # the loop's collectives: part of comm


def test_the_loops_own_collectives_are_comm_and_counted_apart():
    # A logging all-reduce after the optimizer step, and Lightning's SIGTERM broadcast at the loop top: comm
    # (a rank the others wait for there is named), and apart from the gradient all-reduce's comm.
    marks = [
        M.DATA_BEGIN,
        M.DATA_END,
        M.LOOP_COMM_BEGIN,
        M.LOOP_COMM_END,
        M.FORWARD_BEGIN,
        M.FORWARD_END,
        M.BACKWARD_BEGIN,
        M.GRAPH_DONE,
        M.BACKWARD_END,
        M.OPTIMIZER_BEGIN,
        M.OPTIMIZER_END,
        M.LOOP_COMM_BEGIN,
        M.LOOP_COMM_END,
        M.STEP_END,
    ]
    times = [0, 1, 1, 3, 3, 5, 5, 9, 12, 12, 13, 13, 17, 17]
    (row,) = attribute_many([marks], times)
    phases, _, wall = attribute(marks, times)
    assert phases == [1, 2, 4, 3 + 2 + 4, 1, 0] and wall == 17
    assert row[-1] == 2 + 4
