"""Events packed for the coordinator read back as the very events that were packed."""

from __future__ import annotations

import pickle

from orchard.kvcache.events import DISK, EventLog, PackedEvents


def test_packed_events_unpack_to_equal_events_of_every_kind_in_order():
    log = EventLog()
    log.stored(b"h" * 16, None, [1, 2, 3])
    log.stored(b"i" * 16, b"h" * 16, (4, 5, 6), DISK)
    log.removed(b"h" * 16)
    log.state_stored(b"i" * 16)
    events = log.drain()
    packed = PackedEvents.of(events)
    assert isinstance(packed.data, bytes) and packed.unpack() == events
    assert pickle.loads(pickle.dumps(packed)).unpack() == events  # as Ray carries it
