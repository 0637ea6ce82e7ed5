"""`DATA.UNEVEN_SHARDS`: ranks that will see different numbers of batches per epoch, checked at fit start.

In data-parallel training every rank must run the same number of backward passes: a rank whose shard runs
out first leaves the others waiting in a gradient all-reduce that never comes (the classic end-of-epoch
hang), or, with Join-style handling, silently trains on fewer samples. Integrations gather each rank's
batches per epoch once at the start and pass them here; this module only compares them.
"""

from __future__ import annotations

from collections import defaultdict

from .findings import Finding, Severity

# Groups of ranks spelled out in the detail; the rest is counted, so a 1,024-rank job stays short.
_LIST_LIMIT = 6


def uneven_shards_finding(batches_per_rank: list[int]) -> Finding | None:
    """A HIGH finding when ranks disagree on their batches per epoch, else None.

    `batches_per_rank[r]` is rank r's number of training batches per epoch; a negative value means unknown
    (e.g. an iterable dataset without a length) and that rank is left out of the comparison.
    """
    known = {rank: int(n) for rank, n in enumerate(batches_per_rank) if n >= 0}
    if len(set(known.values())) < 2:
        return None
    most = max(known.values())
    fewest = min(known.values())
    short = tuple(sorted(rank for rank, n in known.items() if n < most))
    by_count: dict[int, list[int]] = defaultdict(list)
    for rank, n in sorted(known.items()):
        by_count[n].append(rank)
    groups = [f"{n} on rank{'s' if len(rs) > 1 else ''} {_ranks(rs)}" for n, rs in sorted(by_count.items())]
    if len(groups) > _LIST_LIMIT:
        groups = groups[:_LIST_LIMIT] + [f"{len(groups) - _LIST_LIMIT} more counts"]
    return Finding(
        code="DATA.UNEVEN_SHARDS",
        severity=Severity.HIGH,
        title="Ranks will see different numbers of batches per epoch",
        detail=(
            f"Batches per epoch: {'; '.join(groups)}. "
            f"Rank{'s' if len(short) > 1 else ''} {_ranks(short)} run{'' if len(short) > 1 else 's'} out up to "
            f"{most - fewest} batch"
            f"{'es' if most - fewest > 1 else ''} early; the other ranks then wait in a gradient all-reduce "
            "that never comes (a hang at the end of the epoch) or the ranks' epochs end on different steps."
        ),
        recommendation=(
            "Give every rank the same number of batches: DataLoader(drop_last=True), "
            "DistributedSampler(drop_last=True) (in Lightning keep use_distributed_sampler=True), or split the "
            "data into equal shards; if uneven inputs are intended, wrap the loop in torch's Join context."
        ),
        ranks=short,
        evidence={
            "min_batches": float(fewest),
            "max_batches": float(most),
            "ranks_short": float(len(short)),
            "ranks_unknown": float(len(batches_per_rank) - len(known)),
        },
    )


def _ranks(ranks: list[int] | tuple[int, ...], limit: int = 8) -> str:
    text = ", ".join(str(r) for r in ranks[:limit])
    return text + (f" and {len(ranks) - limit} more" if len(ranks) > limit else "")
