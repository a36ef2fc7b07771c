"""Fairness between client addresses: who goes first, and how much one address may hold. One idea, used wherever
the service serves many addresses from one line: the HTTP server starting requests (service/server/connections.py),
the tokenizing threads (service/tokenizing.py) and the batcher's queue (service/batching/queue.py).

- `Turns`: a first-in, first-out line per address, the addresses in turns (round robin): the next item is the first
  of the address whose turn it is, and that address then goes to the back, after every other address waiting. So
  one address's thousand items delay another's by one item of its own, not by all of them.
- `Held`: what each address holds of a budget (characters, tokens), and whether more fits under a bound per
  address (an address that holds nothing is always let in: one request alone is never refused by its own bound).

Neither knows threads, the event loop or what the items are: the caller holds its own lock and says what an item
weighs. Nothing here imports the rest of the service."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class Held:
    """What each address holds of one budget; `per_address` bounds it (None: unbounded, a count alone)."""

    def __init__(self, per_address: int | None = None):
        self.per_address = per_address
        self.by_address: dict[str, int] = {}  # only the addresses holding some

    def __getitem__(self, address: str) -> int:
        return self.by_address.get(address, 0)

    def __len__(self) -> int:
        return len(self.by_address)

    def fits(self, address: str, amount: int) -> bool:
        """Whether `address` may take `amount` more: within its bound, or it holds nothing yet."""
        mine = self[address]
        return not mine or self.per_address is None or mine + amount <= self.per_address

    def add(self, address: str, amount: int) -> None:
        """`address` holds `amount` more (less, where negative); an address left with nothing is forgotten."""
        left = self[address] + amount
        if left > 0:
            self.by_address[address] = left
        else:
            self.by_address.pop(address, None)


class Turns(Generic[T]):
    """Items in a line per address, the addresses in turns (see the module's docstring). `weight` says what an item
    holds of `held`, the weight each address has waiting (the batcher's tokens); without it, `held` stays empty."""

    def __init__(self, weight: Callable[[T], int] | None = None):
        self._lines: dict[str, deque[T]] = {}  # in turn order: the address whose turn it is first
        self._count = 0
        self._weight = weight
        self.held = Held()

    def __len__(self) -> int:
        """Items waiting, over all addresses."""
        return self._count

    def put(self, address: str, item: T) -> None:
        """`item` at the back of `address`'s line (a new address's turn comes after every address waiting)."""
        self.extend(address, (item,))

    def extend(self, address: str, items: Iterable[T]) -> None:
        items = list(items)
        if not items:
            return
        self._lines.setdefault(address, deque()).extend(items)
        self._count += len(items)
        if self._weight is not None:
            self.held.add(address, sum(map(self._weight, items)))

    def addresses(self) -> list[str]:
        """The addresses with items waiting, in turn order."""
        return list(self._lines)

    def line(self, address: str) -> Sequence[T]:
        """`address`'s items, first to last (read only: change it through the methods below)."""
        return self._lines.get(address, ())

    def heads(self) -> Iterator[T]:
        """The first item of each address, in turn order."""
        return (line[0] for line in self._lines.values())

    def first(self) -> T:
        """The item whose turn it is (not empty)."""
        return self._lines[next(iter(self._lines))][0]

    def take(self) -> T:
        """Take the item whose turn it is (not empty); its address's turn then comes after every other's."""
        address = next(iter(self._lines))
        line = self._lines.pop(address)
        item = line.popleft()
        self._count -= 1
        if self._weight is not None:
            self.held.add(address, -self._weight(item))
        if line:
            self._lines[address] = line  # after every other address waiting
        return item

    def pop(self, address: str) -> T:
        """Take `address`'s first item, its turn unchanged (its line is not empty)."""
        line = self._lines[address]
        item = line.popleft()
        self._count -= 1
        if self._weight is not None:
            self.held.add(address, -self._weight(item))
        if not line:
            del self._lines[address]
        return item

    def turn_over(self, address: str) -> None:
        """`address`'s turn is over: it goes after every other address waiting (if it has items left)."""
        line = self._lines.pop(address, None)
        if line is not None:
            self._lines[address] = line

    def remove(self, address: str, gone: Callable[[T], bool]) -> list[T]:
        """Take every item of `address` that is `gone`, the others keeping their order and the address its turn;
        the items taken."""
        line = self._lines.get(address)
        if not line:
            return []
        kept: deque[T] = deque()
        taken: list[T] = []
        for item in line:
            (taken if gone(item) else kept).append(item)
        if not taken:
            return []
        self._count -= len(taken)
        if self._weight is not None:
            self.held.add(address, -sum(map(self._weight, taken)))
        if kept:
            self._lines[address] = kept
        else:
            del self._lines[address]
        return taken
