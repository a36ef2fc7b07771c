"""Which `Host` a request may name (RFC 9112 section 3.2, and what DNS rebinding needs).

HTTP/1.1 requires exactly one Host: none (in a 1.1 request) or two of them is a 400, since a proxy and this server
could each take another one as the request's. On a loopback bind the server is meant for this machine alone, yet a
web page can reach it: it makes its own name resolve to 127.0.0.1 (DNS rebinding), and the browser sends its
requests there, same-origin, with `Host: <the page's name>`. So a loopback-bound server answers only the loopback
names (`localhost` and its subdomains, 127.0.0.0/8, [::1]) and those ELMO_ALLOWED_HOSTS adds (a proxy on the same
host that forwards its own name); `*` there, or a bind on another address, accepts any well-formed name."""

from __future__ import annotations

import ipaddress
import re

from service.errors import BadRequest, ServiceError, shown

# RFC 3986's host (a reg-name, an IPv4 literal, or an IP literal in brackets) and an optional port: what is
# compared is the name, lowercased, without the port.
_HOST = re.compile(rb"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~!$&'()*+,;=%-]*)(?::(?P<port>[0-9]*))?")


def is_loopback(bind: str) -> bool:
    """Whether listening on `bind` (ELMO_HOST) serves this machine alone."""
    if bind.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def _loopback_name(name: str) -> bool:
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always resolved to the loopback
        return True
    try:
        return ipaddress.ip_address(name.strip("[]")).is_loopback
    except ValueError:
        return False


class AllowedHosts:
    """The Host rule of one listening address: `bind` (ELMO_HOST) and `allowed` (ELMO_ALLOWED_HOSTS: names, a
    leading dot for a name and its subdomains, or `*`)."""

    def __init__(self, bind: str, allowed: list[str]):
        self.loopback_only = is_loopback(bind) and "*" not in allowed
        self.suffixes = tuple(name.lower() for name in allowed if name.startswith("."))
        self.names = {name.lower().lstrip(".") for name in allowed}  # `.example.com`: example.com too

    def refusal(self, headers: list[tuple[bytes, bytes]], version: str) -> ServiceError | None:
        """Why a request with these header fields (names lowercased) is refused for its Host, if it is."""
        given = [value for name, value in headers if name == b"host"]
        if len(given) > 1:
            return BadRequest(f"{len(given)} Host headers; send one", "host")
        if not given:  # HTTP/1.0 may leave it out (a browser, which DNS rebinding needs, never does)
            return None if version == "1.0" else BadRequest("missing: an HTTP/1.1 request names its Host", "host")
        value = given[0].strip()
        match = _HOST.fullmatch(value)
        if match is None:
            return BadRequest(f"{shown(value.decode('latin-1'))!r} is not a host name with an optional port", "host")
        name = match["name"].decode("ascii").lower().rstrip(".")
        if not self.loopback_only or self._allowed(name):
            return None
        return self._foreign(name)

    def _allowed(self, name: str) -> bool:
        return _loopback_name(name) or name in self.names or (bool(name) and name.endswith(self.suffixes))

    def _foreign(self, name: str) -> ServiceError:
        return BadRequest(
            f"{shown(name)!r} is not a name of this server: bound to a loopback address, it answers localhost, "
            "127.0.0.1 and [::1] (and the names in ELMO_ALLOWED_HOSTS)",
            "host",
        )
