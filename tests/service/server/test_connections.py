"""The HTTP server's bounds per address below the app (service/server/connections.py and log_bounds.py), without a
server: the open-files limit raised and the caps below it, the caps per address and in all, the turns in which
requests start, and what a client can make the server log. tests/e2e/test_connections.py checks them on a real
one."""

from __future__ import annotations

import asyncio
import logging
import resource

import pytest

from service.server.connections import ConnectionCaps, RequestTurns, Trusted, connection_limit, raise_open_files
from service.server.log_bounds import AddressLog


def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        before, after = raise_open_files()
        assert before == min(256, hard) and after == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert after == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_connections_stay_below_the_open_files_limit():
    assert connection_limit(1024) == 1024 - 102  # a tenth kept for the rest
    assert connection_limit(256) == 256 - 64  # at least 64
    assert connection_limit(20_000, wanted=500) == 500
    assert connection_limit(1024, wanted=5000) == 922  # never over what the descriptors allow


class Conn:
    def __init__(self, idle=True):
        self._idle, self.closed = idle, False

    def idle(self) -> bool:
        return self._idle

    def close_idle(self) -> None:
        self.closed = True


def caps(limit=4, per_client=2, trusted=()) -> tuple[ConnectionCaps, list[str]]:
    refused: list[str] = []
    return ConnectionCaps(limit, per_client, Trusted(list(trusted)), AddressLog(logging.getLogger("t")),
                          refused.append), refused  # fmt: skip


def test_connections_are_capped_per_address_and_trusted_proxies_only_in_all():
    capped, refused = caps(limit=10, per_client=2, trusted=["10.0.0.0/8"])
    a = [Conn() for _ in range(3)]
    assert capped.admit(a[0], "1.2.3.4") is None and capped.admit(a[1], "1.2.3.4") is None
    assert capped.admit(a[2], "1.2.3.4").detail.startswith("connections: 2 open from your address; the limit is 2")
    assert all(capped.admit(Conn(), "10.1.2.3") is None for _ in range(5))  # a proxy: many clients' one address
    assert refused == ["per_client"] and capped.count == 7
    capped.release(a[0], "1.2.3.4")
    capped.release(a[0], "1.2.3.4")  # once only
    capped.release(a[2], "1.2.3.4")  # refused: never held
    assert capped.count == 6 and len(capped.by_client["1.2.3.4"]) == 1


def test_at_the_limit_the_largest_holder_s_oldest_idle_connection_makes_room():
    capped, refused = caps(limit=4, per_client=3)
    busy, idle_a, idle_b = Conn(idle=False), Conn(), Conn()
    for conn, address in ((busy, "a"), (idle_a, "a"), (Conn(idle=False), "a"), (idle_b, "b")):
        assert capped.admit(conn, address) is None
    assert capped.admit(Conn(idle=False), "c") is None  # "a" holds the most: its oldest idle one goes
    assert idle_a.closed and not idle_b.closed and not busy.closed and capped.count == 4
    assert capped.admit(Conn(idle=False), "d") is None  # "a" has none idle left, nor "c": "b"'s goes
    assert idle_b.closed
    assert capped.admit(Conn(), "e").detail.startswith("connections: the server holds its limit of 4")
    assert refused == ["total"]


def test_a_trusted_proxy_s_request_is_its_client_s():
    trusted = Trusted(["127.0.0.1"])
    headers = [(b"x-forwarded-for", b"203.0.113.7, 127.0.0.1")]
    assert trusted.client("127.0.0.1", headers) == "203.0.113.7"  # the rightmost address not a proxy
    assert trusted.client("127.0.0.2", headers) == "127.0.0.2"  # not a proxy: its own address
    assert Trusted([]).client("127.0.0.1", headers) == "127.0.0.1"


def test_requests_start_in_turns_by_address():
    started: list[str] = []

    async def main():
        turns = RequestTurns(per_round=3)
        for k in range(5):
            turns.start("flood", lambda k=k: started.append(f"flood{k}"))
        turns.start("other", lambda: started.append("other"))
        await asyncio.sleep(0)  # one turn of the loop: one round
        first_round = list(started)
        while len(turns):
            await asyncio.sleep(0)
        return first_round

    first_round = asyncio.run(main())
    assert first_round == ["flood0", "other", "flood1"]  # the other address's request in the first round
    assert started == ["flood0", "other", "flood1", "flood2", "flood3", "flood4"]


def test_what_a_client_makes_the_server_log_is_bounded(caplog):
    log = AddressLog(logging.getLogger("bounded"), every_s=60, per_window=3)
    with caplog.at_level(logging.INFO, logger="bounded"):
        written = [log.info("refused", "a", "refused %s", "a") for _ in range(1000)]
        written += [log.info("refused", f"10.0.0.{k}", "refused %s", k) for k in range(10)]
        written += [log.info("other", "a", "another kind")]
    assert sum(written) == 4 and len(caplog.records) == 4  # a's first, 2 more addresses, then the window is full
    assert caplog.records[1].getMessage() == "refused 0 (and 0 more from this address, 999 from all, not logged " \
        "since the last such line)"  # fmt: skip


def test_the_addresses_the_log_remembers_are_bounded_by_count_and_age(monkeypatch):
    """200,000 addresses held back (the window full) left 199,980 entries (33.7 MB) for good: now at most
    MAX_ADDRESSES at once, and none an hour later once a line is written. (A unit test: 200,000 source addresses
    are more than a real server's test can open here.)"""
    from service.server import log_bounds

    clock = [1000.0]
    monkeypatch.setattr(log_bounds.time, "monotonic", lambda: clock[0])
    log = AddressLog(logging.getLogger("bounded"), every_s=10, per_window=20)
    for k in range(200_000):
        log.info("refused", f"10.{k >> 16}.{(k >> 8) & 255}.{k & 255}", "refused")
    assert len(log._held) <= log_bounds.MAX_ADDRESSES and len(log._last) == 20
    clock[0] += 3600
    assert log.info("refused", "10.9.9.9", "refused")  # an hour later: written, and the rest forgotten on the way
    log.info("refused", "10.9.9.8", "refused")
    for k in range(log_bounds.MAX_ADDRESSES):  # the memory full again: the quiet ones go first
        log.info("other", f"11.0.{k >> 8}.{k & 255}", "x")
    assert len(log._held) <= log_bounds.MAX_ADDRESSES and len(log._last) <= log_bounds.MAX_ADDRESSES
    assert not [key for key in log._held if key[0] == "refused" and key[1].startswith("10.0.")]


@pytest.mark.parametrize("entry", ["*", "proxy.local"])
def test_only_addresses_and_networks_are_trusted(entry):
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError):
        Settings(forwarded_allow_ips=[entry])
