"""What one client address may take of the HTTP server below the app: its connections, and its turns at starting
requests. The address is the connection's peer, or for a reverse proxy named in ELMO_FORWARDED_ALLOW_IPS the one
its X-Forwarded-For names (the proxy is many clients' one address, so its connections count only in all).

- Connections: at most `limit` in all, below the open-files limit (raised at start to its hard limit), and
  `per_client` from one address. A connection past either is answered 503 and closed at once, with a line in the
  log (bounded per address: service/server/log_bounds.py). At the limit in all, the address holding the most connections
  first loses its oldest idle one (connected and sending nothing, or idle between requests) to the newcomer. Without
  the caps, 1,100 connections that sent nothing took a server whose limit was 1024 out of descriptors: accept()
  failed, and 127 of 150 requests from other addresses were reset, with nothing logged.
- Turns: a request is started (its ASGI task created) in its address's turn, each round one request of every
  address that has one waiting, at most `per_round` a round, one round per turn of the event loop; so one address's
  thousand connections add at most its share of a round to the loop's turn, and another's request or the liveness
  probe never waits behind all of them (a flood of 1,000 connections held /health/live for 3.4 s)."""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from service.errors import Overloaded
from service.server.log_bounds import AddressLog
from service.server.uvicorn_compat import TrustedProxies
from service.turns import Turns

log = logging.getLogger("elmo.service")
# Descriptors kept for what is not a connection (the listening socket, the event loop's, log files, /proc reads
# by the metrics, the model's files while loading): this many, or a tenth of the limit if that is more.
RESERVE = 64


def raise_open_files() -> tuple[int, int]:
    """The soft open-files limit raised to the hard one (the kernel's ceiling where the hard one is unlimited);
    (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = hard
    if hard == resource.RLIM_INFINITY:
        try:
            ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            ceiling = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, ceiling
    return soft, soft


def connection_limit(open_files: int, wanted: int = 0) -> int:
    """The connections a process with `open_files` descriptors may hold, leaving RESERVE (or a tenth) for the rest:
    `wanted`, or all it can where `wanted` is 0 or more than that."""
    most = max(1, open_files - max(RESERVE, open_files // 10))
    return most if wanted <= 0 else min(wanted, most)


class Trusted:
    """The reverse proxies whose forwarded headers count (ELMO_FORWARDED_ALLOW_IPS: addresses and networks), and the
    client address of a request they forward, as uvicorn's own middleware reads it for the app (the rightmost
    address of X-Forwarded-For that is not one of them)."""

    def __init__(self, proxies: list[str]):
        self.proxies = TrustedProxies(proxies)

    def __contains__(self, address: str) -> bool:
        return address in self.proxies

    def client(self, peer: str, headers: list[tuple[bytes, bytes]]) -> str:
        """Whose request this is: the peer, or for a trusted proxy the client its X-Forwarded-For names."""
        if peer not in self.proxies:
            return peer
        forwarded = [value for name, value in headers if name == b"x-forwarded-for"]
        if not forwarded:
            return peer
        return self.proxies.client(b", ".join(forwarded).decode("latin-1")) or peer


class Connection(Protocol):
    """What the caps need of a connection (service/server/protocol.py's BoundedHttpProtocol)."""

    def idle(self) -> bool: ...
    def close_idle(self) -> None: ...


class ConnectionCaps:
    """The connections held, in all and per address (see the module's docstring)."""

    def __init__(
        self,
        limit: int,
        per_client: int,
        trusted: Trusted,
        address_log: AddressLog,
        refused: Callable[[str], None] = lambda reason: None,
    ):
        self.limit, self.per_client, self.trusted = limit, per_client, trusted
        self.address_log, self.refused = address_log, refused
        self.count = 0
        self.by_client: dict[str, dict[Connection, None]] = {}  # each address's connections, oldest first

    def admit(self, connection: Connection, address: str) -> Overloaded | None:
        """Hold `connection` from `address`; or why not (its 503, with Retry-After: 1)."""
        mine = self.by_client.get(address, {})
        if len(mine) >= self.per_client and address not in self.trusted:
            self._refuse("per_client", address, "it has %d open, the limit per address", len(mine))
            return Overloaded(
                f"{len(mine)} open from your address; the limit is {self.per_client} per address: close some, or "
                "retry later",
                "connections",
                retry_after=1,
            )
        if self.count >= self.limit and not self._evict_idle():
            self._refuse("total", address, "the server holds %d, its limit", self.count)
            return Overloaded(f"the server holds its limit of {self.limit}; retry later", "connections", retry_after=1)
        self.by_client.setdefault(address, {})[connection] = None
        self.count += 1
        return None

    def release(self, connection: Connection, address: str) -> None:
        mine = self.by_client.get(address)
        if mine is None or connection not in mine:
            return  # refused, or evicted already
        del mine[connection]
        self.count -= 1
        if not mine:
            del self.by_client[address]

    def _evict_idle(self) -> bool:
        """Close the oldest idle connection of the address holding the most; whether there was one."""
        for address in sorted(self.by_client, key=lambda a: len(self.by_client[a]), reverse=True)[:4]:
            for connection in self.by_client[address]:
                if connection.idle():
                    self.release(connection, address)
                    connection.close_idle()
                    return True
        return False

    def _refuse(self, reason: str, address: str, why: str, count: int) -> None:
        self.refused(reason)
        limit = self.per_client if reason == "per_client" else self.limit
        setting = "ELMO_MAX_CONNECTIONS_PER_CLIENT" if reason == "per_client" else "ELMO_MAX_CONNECTIONS"
        self.address_log.info(
            "connections", address, f"refused a connection from %s: {why} of %d (%s)", address, count, limit, setting
        )


Start = Callable[[], None]


class RequestTurns:
    """Requests started in turns by address (see the module's docstring; the turns are service/turns.py's).
    `start(address, go)` calls `go` (which creates the request's task) in `address`'s turn: in the next round, on a
    later turn of the event loop."""

    def __init__(self, per_round: int = 16):
        self.per_round = per_round
        self._waiting: Turns[Start] = Turns()
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, address: str, go: Start) -> None:
        self._waiting.put(address, go)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._round)

    def _round(self) -> None:
        started = 0
        while self._waiting and started < self.per_round:
            self._waiting.take()()  # its address's next turn after every other address's
            started += 1
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._round)  # the tasks just created run first
        else:
            self._scheduled = False
