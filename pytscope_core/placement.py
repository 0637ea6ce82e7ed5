"""Where each rank runs: its host and its local rank, so findings can name the node and not only the rank.

Every rank reports `local_place()` once at the start (one small gather to rank 0); rank 0 writes the hosts and
local ranks into the run (a `meta` event), and analysis reads them back as a `Placement`. The host is
`socket.gethostname()` unless `PYTSCOPE_HOST` overrides it: for containers whose host names mean nothing,
and for tests that play several nodes on one machine. The local rank is `LOCAL_RANK` (set by torchrun,
Lightning and Accelerate) when present, else the rank's position among the ranks on its host.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HOST_ENV = "PYTSCOPE_HOST"
"""Overrides the host name a rank reports (containers, tests that simulate several nodes on one machine)."""


def local_place() -> tuple[str, int]:
    """This process's (host, local rank); the local rank is -1 when the environment does not say."""
    host = os.environ.get(HOST_ENV) or socket.gethostname()
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", "-1"))
    except ValueError:
        local_rank = -1
    return host, local_rank


@dataclass(frozen=True)
class Placement:
    """The host and local rank of every rank, indexed by rank; empty when unknown (older runs)."""

    hosts: tuple[str, ...] = ()
    local_ranks: tuple[int, ...] = ()

    @classmethod
    def of(cls, places: Sequence[tuple[str, int]]) -> Placement:
        """From each rank's `local_place()`, in rank order; unknown local ranks (-1) become the rank's position
        among the ranks on its host (rank % local world size, for the usual block placement)."""
        seen: dict[str, int] = {}
        hosts, local = [], []
        for host, local_rank in places:
            position = seen.get(host, 0)
            seen[host] = position + 1
            hosts.append(host)
            local.append(local_rank if local_rank >= 0 else position)
        return cls(tuple(hosts), tuple(local))

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Placement:
        hosts, local = meta.get("hosts"), meta.get("local_ranks")
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            return cls()
        if not isinstance(local, list) or len(local) != len(hosts):
            return cls.of([(h, -1) for h in hosts])
        try:
            return cls(tuple(hosts), tuple(int(r) for r in local))
        except (TypeError, ValueError, OverflowError):
            return cls.of([(h, -1) for h in hosts])

    def to_meta(self) -> dict[str, Any]:
        return {"hosts": list(self.hosts), "local_ranks": list(self.local_ranks)}

    @property
    def known(self) -> bool:
        return bool(self.hosts)

    def host(self, rank: int) -> str | None:
        return self.hosts[rank] if 0 <= rank < len(self.hosts) else None

    def local_rank(self, rank: int) -> int | None:
        return self.local_ranks[rank] if 0 <= rank < len(self.local_ranks) else None

    def describe(self, rank: int) -> str:
        """ "rank 13 on host h07, local rank 5", or "rank 13" where the placement is unknown."""
        host = self.host(rank)
        if host is None:
            return f"rank {rank}"
        return f"rank {rank} on host {host}, local rank {self.local_rank(rank)}"

    @functools.cached_property
    def ranks_by_host(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, list[int]] = {}
        for rank, host in enumerate(self.hosts):
            out.setdefault(host, []).append(rank)
        return {h: tuple(r) for h, r in out.items()}

    def whole_hosts(self, ranks: Iterable[int], min_ranks: int = 2) -> tuple[str, ...]:
        """The hosts that `ranks` make up exactly (every rank of each, no rank elsewhere), when each of them
        has at least `min_ranks` ranks and some host is left out; else ()."""
        wanted = set(ranks)
        if not wanted or not self.known:
            return ()
        hosts = {self.host(r) for r in wanted}
        if None in hosts or len(hosts) >= len(self.ranks_by_host):
            return ()
        by_host = self.ranks_by_host
        covered = {r for h in hosts for r in by_host[h]}  # type: ignore[index]
        if covered != wanted or any(len(by_host[h]) < min_ranks for h in hosts):  # type: ignore[index]
            return ()
        return tuple(sorted(h for h in hosts if h is not None))

    def by_host(self, ranks: Iterable[int], limit: int = 4) -> str:
        """ "host h01 (ranks 3), host h02 (ranks 9, 12)": ranks grouped by host, at most `limit` hosts."""
        from .findings import format_ranks

        groups: dict[str, list[int]] = {}
        for r in ranks:
            groups.setdefault(self.host(r) or "?", []).append(r)
        parts = [
            f"host {h} (rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)})" for h, rs in groups.items()
        ]
        more = len(parts) - limit
        return ", ".join(parts[:limit]) + (f" and {more} more hosts" if more > 0 else "")
