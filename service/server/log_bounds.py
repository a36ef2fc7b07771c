"""What clients can make the server log, bounded: a line of each kind at most every `every_s` seconds per client
address, and `per_window` lines of a kind every `every_s` over all addresses; what is held back is counted, and
the next line of its kind says how many. Without a bound, each refused connection or reset slow reader was a line,
and an attacker sets the log's growth (5,000 upgrade requests once wrote 40 MB in 3 s). No line holds request
text: a kind's lines are written by the server, with the address and counts only."""

from __future__ import annotations

import logging
import time

EVERY_S = 10.0
PER_WINDOW = 20  # lines of one kind over all addresses every EVERY_S
# (kind, address) pairs remembered, written and held back each: past it, those not heard from for `every_s` are
# forgotten, and if all were heard from since, the longest quiet (200,000 addresses held back once stayed forever)
MAX_ADDRESSES = 10_000


class AddressLog:
    def __init__(self, logger: logging.Logger, every_s: float = EVERY_S, per_window: int = PER_WINDOW):
        self.logger, self.every_s, self.per_window = logger, every_s, per_window
        self._last: dict[tuple[str, str], float] = {}  # (kind, address): when its last line was written
        # (kind, address): lines held back since its last line, and when the latest was (oldest first)
        self._held: dict[tuple[str, str], tuple[int, float]] = {}
        self._window: dict[str, tuple[float, int, int]] = {}  # kind: (window start, lines written, held back)

    def info(self, kind: str, address: str, message: str, *args) -> bool:
        """Log `message % args` at INFO for `address`, unless its kind's bounds hold it back; whether it was."""
        now = time.monotonic()
        key = (kind, address)
        start, written, held_all = self._window.get(kind, (now, 0, 0))
        if now - start >= self.every_s:
            start, written = now, 0
        if now - self._last.get(key, -self.every_s) < self.every_s or written >= self.per_window:
            count, _ = self._held.pop(key, (0, now))
            self._held[key] = (count + 1, now)  # moved to the end: the dict stays oldest first
            if len(self._held) > MAX_ADDRESSES:
                self._forget(now, self._held)
            self._window[kind] = (start, written, held_all + 1)
            return False
        if len(self._last) >= MAX_ADDRESSES:
            self._forget(now, self._last)
        self._last.pop(key, None)
        self._last[key] = now
        held, _ = self._held.pop(key, (0, now))
        suffix = ""
        if held or held_all:
            suffix = f" (and {held} more from this address, {held_all} from all, not logged since the last such line)"
        self._window[kind] = (start, written + 1, 0)
        self.logger.info(message + suffix, *args)
        return True

    def _forget(self, now: float, full: dict) -> None:
        """Both memories without the pairs quiet for `every_s`; then `full` without its oldest, down to 9/10 of
        MAX_ADDRESSES (their held-back counts are then said only in the kind's count over all addresses). Both are
        oldest first, so only what goes is read, and a tenth goes at once: a scan of all 10,000 for every new
        address cost 0.43 ms of the event loop a refused connection once the memory was full."""
        for memory, when in ((self._last, lambda v: v), (self._held, lambda v: v[1])):
            while memory and now - when(memory[oldest := next(iter(memory))]) >= self.every_s:
                del memory[oldest]
        while len(full) > MAX_ADDRESSES * 9 // 10:
            del full[next(iter(full))]
