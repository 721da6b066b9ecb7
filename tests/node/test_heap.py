"""What `freeze_loaded_objects` leaves to the collector: only what comes after, and no garbage."""

from __future__ import annotations

import gc
import weakref

import pytest

from orchard.node.heap import freeze_loaded_objects


class _Node:
    pass


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_loaded_objects_leave_the_collectors_passes_and_new_ones_do_not(unfrozen):
    loaded = [_Node() for _ in range(10)]
    frozen = freeze_loaded_objects()
    assert frozen >= len(loaded) and gc.get_freeze_count() > 0  # frozen objects may still be freed since
    tracked = {id(o) for o in gc.get_objects()}  # the three generations, not the frozen objects
    assert not any(id(o) in tracked for o in loaded)
    later = _Node()
    assert id(later) in {id(o) for o in gc.get_objects()}


def test_garbage_is_collected_first_not_frozen_for_good(unfrozen):
    cycle = _Node()
    cycle.me = cycle  # only the collector can free it
    dead = weakref.ref(cycle)
    del cycle
    freeze_loaded_objects()
    assert dead() is None
