"""Named failures of the KV layer; the gateway maps them to HTTP statuses in one place."""


class KVCacheError(Exception):
    """Base of every error raised by kvcache."""


class OutOfBlocks(KVCacheError):
    """The pool cannot supply the blocks asked for; nothing was changed."""


class UnknownSequence(KVCacheError):
    """A sequence id the block manager does not hold."""


class IncompatibleKVPayload(KVCacheError):
    """KV bytes made for another model, geometry, dtype or format version."""


class CorruptKVPayload(KVCacheError):
    """KV bytes that are truncated or fail their checksum."""


class ColdTierError(KVCacheError):
    """The on-disk tier cannot be used (bad file, no space)."""


class QuotaExceeded(KVCacheError):
    """A model asked for more KV memory than its quota of the shared budget."""


class OutOfStateSlots(KVCacheError):
    """Every recurrent-state slot of a hybrid model's state pool is held; nothing was changed."""


class PoolMoved(KVCacheError):
    """The pool's buffers moved while KV was written into them from another thread; nothing was cached."""
