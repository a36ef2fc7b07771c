"""The fairness between addresses (service/turns.py), alone: round robin over addresses, each address's items in
the order they came, and what an address holds within its bound. Its users' own tests check it in place: the
server's request turns (tests/service/server/test_connections.py), the batcher's queue
(tests/service/batching/test_batcher.py) and the tokenizing threads (tests/service/test_tokenizing.py)."""

from __future__ import annotations

from service.turns import Held, Turns


def drain(turns: Turns) -> list:
    taken = []
    while turns:
        taken.append(turns.take())
    return taken


def test_addresses_take_turns_an_item_each_in_the_order_they_came():
    turns: Turns[str] = Turns()
    turns.extend("flood", [f"f{k}" for k in range(4)])
    turns.put("b", "b0")
    turns.put("c", "c0")
    turns.put("b", "b1")
    assert len(turns) == 7 and turns.addresses() == ["flood", "b", "c"]
    assert turns.first() == "f0" and len(turns) == 7  # looking takes nothing
    assert drain(turns) == ["f0", "b0", "c0", "f1", "b1", "f2", "f3"]
    assert len(turns) == 0 and not turns and turns.addresses() == []


def test_a_newcomer_waits_behind_one_item_of_each_address_not_behind_a_flood():
    turns: Turns[str] = Turns()
    turns.extend("flood", [f"f{k}" for k in range(1000)])
    assert [turns.take() for _ in range(3)] == ["f0", "f1", "f2"]  # an address alone takes every turn
    turns.put("late", "l0")
    assert [turns.take() for _ in range(2)] == ["f3", "l0"]


def test_pop_keeps_the_turn_and_turn_over_passes_it():
    turns: Turns[str] = Turns()
    turns.extend("a", ["a0", "a1"])
    turns.put("b", "b0")
    assert turns.pop("a") == "a0" and turns.addresses() == ["a", "b"]  # still a's turn
    turns.turn_over("a")
    assert turns.addresses() == ["b", "a"]
    turns.turn_over("nobody")  # an address with nothing waiting: no-op
    assert turns.pop("a") == "a1" and turns.addresses() == ["b"]  # an emptied line leaves the turns


def test_remove_takes_what_is_gone_and_keeps_the_rest_in_order_and_in_turn():
    turns: Turns[tuple[str, int]] = Turns()
    turns.extend("a", [("x", 0), ("y", 1), ("x", 2), ("z", 3)])
    turns.put("b", ("b", 0))
    assert turns.remove("a", lambda item: item[0] == "x") == [("x", 0), ("x", 2)]
    assert len(turns) == 3 and list(turns.line("a")) == [("y", 1), ("z", 3)]
    assert turns.addresses() == ["a", "b"]  # a keeps its turn
    assert turns.remove("a", lambda item: True) == [("y", 1), ("z", 3)] and turns.addresses() == ["b"]
    assert turns.remove("a", lambda item: True) == [] and turns.remove("b", lambda item: False) == []
    assert len(turns) == 1


def test_weights_are_held_per_address_while_they_wait():
    turns: Turns[str] = Turns(weight=len)
    turns.extend("a", ["aaa", "a"])
    turns.put("b", "bb")
    assert turns.held.by_address == {"a": 4, "b": 2}
    assert turns.take() == "aaa" and turns.held["a"] == 1
    turns.remove("a", lambda item: True)
    assert turns.held.by_address == {"b": 2}  # an address holding nothing is forgotten
    assert list(turns.heads()) == ["bb"] and turns.take() == "bb" and len(turns.held) == 0
    assert Turns().held.by_address == {}  # no weight: nothing held
    unweighted: Turns[str] = Turns()
    unweighted.put("a", "aaa")
    assert unweighted.held.by_address == {}


def test_heads_are_each_addresses_first_in_turn_order():
    turns: Turns[int] = Turns()
    turns.extend("a", [1, 2])
    turns.extend("b", [3])
    turns.extend("c", [])  # nothing: no line
    assert list(turns.heads()) == [1, 3] and turns.addresses() == ["a", "b"] and turns.line("c") == ()


def test_held_bounds_an_address_but_never_refuses_its_first():
    held = Held(per_address=100)
    assert held.fits("a", 1_000)  # it holds nothing: one request alone is always taken
    held.add("a", 1_000)
    assert not held.fits("a", 1) and held.fits("b", 100) and held["a"] == 1_000
    held.add("a", -1_000)
    assert held["a"] == 0 and len(held) == 0 and held.fits("a", 60)
    held.add("a", 60)
    assert held.fits("a", 40) and not held.fits("a", 41)
    unbounded = Held()
    unbounded.add("a", 10**12)
    assert unbounded.fits("a", 10**12)
