"""Do the ranks train on different data? Fingerprints of each rank's batch, compared step by step.

Every 8th step each rank fingerprints its first batch (`batches.py`). In a data-parallel job ranks whose
fingerprints agree in a step trained on the same data: their compute that step repeats another rank's. The
share of compute duplicated is, per checked step, (ranks with a fingerprint - distinct fingerprints) / ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..arrays import RunArrays


@dataclass(frozen=True)
class DuplicateShards:
    steps_checked: int  # steps where at least two ranks fingerprinted their batch
    ranks: tuple[int, ...]
    repeat_share: tuple[
        float, ...
    ]  # per rank (as `ranks`): share of checked steps its batch equalled another's
    duplicated_share: float  # mean share of the job's compute spent on data another rank also trained on
    groups: tuple[tuple[int, ...], ...]  # in the last checked step: the ranks that saw identical batches


def duplicate_shards(arrays: RunArrays) -> DuplicateShards:
    fp = np.asarray(arrays.batch_fp, dtype=np.float64)
    present = np.isfinite(fp)
    rows = np.flatnonzero(present.sum(axis=1) >= 2)
    r = fp.shape[1]
    if rows.size == 0:
        return DuplicateShards(0, tuple(int(x) for x in arrays.ranks), tuple(0.0 for _ in range(r)), 0.0, ())
    checked = fp[rows]
    order = np.argsort(checked, axis=1)  # NaN sorts last, and never equals anything
    ordered = np.take_along_axis(checked, order, axis=1)
    same = ordered[:, 1:] == ordered[:, :-1]
    repeated_sorted = np.zeros_like(ordered, dtype=bool)
    repeated_sorted[:, 1:] |= same
    repeated_sorted[:, :-1] |= same
    repeated = np.zeros_like(repeated_sorted)
    np.put_along_axis(repeated, order, repeated_sorted, axis=1)
    n_present = present[rows].sum(axis=1)
    duplicated = same.sum(axis=1)  # ranks with a fingerprint less the distinct ones
    last = checked[-1]
    groups = []
    for value in np.unique(last[np.isfinite(last)]):
        members = np.flatnonzero(last == value)
        if members.size > 1:
            groups.append(tuple(int(arrays.ranks[m]) for m in members))
    return DuplicateShards(
        steps_checked=int(rows.size),
        ranks=tuple(int(x) for x in arrays.ranks),
        repeat_share=tuple(float(x) for x in repeated.mean(axis=0)),
        duplicated_share=float(np.mean(duplicated / n_present)),
        groups=tuple(groups),
    )
