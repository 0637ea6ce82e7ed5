"""The per-step record: the one row layout shared by the recorder, the gather, the run directory and analysis.

A step record is a row of float64 numbers, one per column below. The recorder fills rows on every rank, the
gather ships them to rank 0 unchanged, the run directory stores them as raw little-endian float64 rows, and
`RunArrays` turns the rows of all ranks into dense (steps x ranks) arrays for analysis.
"""

from __future__ import annotations

PHASES: tuple[str, ...] = ("data", "forward", "backward", "comm", "optimizer", "other")
"""The phases of a step, in this order everywhere. They sum to the step's wall time."""

COLUMNS: tuple[str, ...] = (
    "rank",
    "segment",  # 0 for the first launch, +1 for every resume
    "step",  # optimizer-step index, the same on every rank (1-based)
    "start_s",  # loop top, seconds since the epoch (host clock)
    "wall_ms",  # loop top to next loop top, less excluded time
    "data_ms",
    "forward_ms",
    "backward_ms",
    "comm_ms",  # exposed communication: gradients (graph done -> end of backward), the loop's collectives
    "optimizer_ms",
    "other_ms",
    "excluded_ms",  # validation, checkpointing ... inside the step's span, not charged to any phase
    "loss",  # NaN when not logged; +inf when a loss logged in the step was NaN or infinite
    "samples",  # NaN when the batch size is not visible
    "mem_bytes",  # peak memory in the step (CUDA allocator peak, else process RSS)
    "grad_syncs",  # gradient synchronisations (DDP all-reduce rounds) completed in this step
    "micro_batches",  # forward passes in the step (gradient-accumulation window)
    "batch_fp",  # a 48-bit hash of the step's first batch (batches.py), every 8th step; NaN otherwise
    "optimizer_steps",  # optimizer.step() calls completed in the step (one per optimizer, so 2 for a GAN's)
    # The part of comm_ms spent in collectives the loop calls itself (a barrier, an all-reduce of the loss for
    # logging, Lightning's per-batch SIGTERM flag broadcast), not gradient communication; NaN in older runs
    "loop_comm_ms",
)
COL = {name: i for i, name in enumerate(COLUMNS)}
NCOLS = len(COLUMNS)
PHASE_COLS = tuple(COL[f"{p}_ms"] for p in PHASES)
