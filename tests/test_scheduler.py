import pytest

from engine.errors import EngineOverloadedError
from engine.scheduler import AdmissionQueue


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_higher_priority_first_then_arrival_order():
    q = AdmissionQueue(10, aging_per_s=0.1, clock=Clock())
    for name, prio in [("a", 0), ("b", 5), ("c", 0), ("d", 5)]:
        q.push(name, prio)
    assert q.drain() == ["b", "d", "a", "c"]


def test_aging_lets_a_long_waiter_overtake():
    clock = Clock()
    q = AdmissionQueue(10, aging_per_s=0.1, clock=clock)
    q.push("old-low", 0)
    clock.now = 20.0  # waited 20 s: effective priority 2.0
    q.push("new-mid", 1.5)
    q.push("new-high", 2.5)
    assert q.drain() == ["new-high", "old-low", "new-mid"]


def test_no_aging_never_overtakes():
    clock = Clock()
    q = AdmissionQueue(10, aging_per_s=0.0, clock=clock)
    q.push("old-low", 0)
    clock.now = 1e6
    q.push("new", 0.001)
    assert q.drain() == ["new", "old-low"]


def test_full_queue_refuses_and_removal_frees_room():
    q = AdmissionQueue(2, aging_per_s=0.1, clock=Clock())
    first = q.push("a", 0)
    q.push("b", 0)
    with pytest.raises(EngineOverloadedError, match="full"):
        q.push("c", 0)
    assert q.remove(first)
    assert not q.remove(first)
    q.push("c", 0)
    assert len(q) == 2
    assert q.drain() == ["b", "c"]


def test_invalid_size():
    with pytest.raises(ValueError, match="max_size"):
        AdmissionQueue(0, aging_per_s=0.1)
