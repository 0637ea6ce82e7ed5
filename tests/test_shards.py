"""DATA.UNEVEN_SHARDS: the pure comparison of every rank's batches per epoch."""

from __future__ import annotations

from pytscope_core.findings import Severity
from pytscope_core.shards import uneven_shards_finding


def test_equal_shards_are_fine() -> None:
    assert uneven_shards_finding([12, 12, 12, 12]) is None
    assert uneven_shards_finding([7]) is None
    assert uneven_shards_finding([]) is None


def test_one_short_rank_is_named_with_counts() -> None:
    f = uneven_shards_finding([13, 13, 12, 13])
    assert f is not None
    assert f.code == "DATA.UNEVEN_SHARDS"
    assert f.severity == Severity.HIGH
    assert f.ranks == (2,)
    assert "12 on rank 2" in f.detail and "13 on ranks 0, 1, 3" in f.detail
    assert f.evidence["min_batches"] == 12 and f.evidence["max_batches"] == 13
    assert "drop_last" in f.recommendation


def test_every_rank_below_the_maximum_is_short() -> None:
    f = uneven_shards_finding([10, 8, 9])
    assert f is not None
    assert f.ranks == (1, 2)
    assert f.evidence["ranks_short"] == 2
    assert "2 batches early" in f.detail


def test_unknown_lengths_are_left_out() -> None:
    assert uneven_shards_finding([-1, 5, 5]) is None
    f = uneven_shards_finding([-1, 5, 6])
    assert f is not None and f.ranks == (1,)
    assert f.evidence["ranks_unknown"] == 1


def test_many_ranks_stay_short() -> None:
    counts = [100 + (r % 20) for r in range(1024)]
    f = uneven_shards_finding(counts)
    assert f is not None
    assert len(f.ranks) == 1024 - 1024 // 20
    assert len(f.detail) < 800
    assert "more counts" in f.detail
