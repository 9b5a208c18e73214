"""The data of the job's store (store.py) in the serving process, with
c10d's semantics (HashStore's and TCPStore's: counters in ASCII decimal that
wrap in int64, compare-and-set, waits with timeouts)."""

import re
import threading
import time

from hetseq.store.store_wire import (ADD, APPEND, CHECK, COMPARE_SET, DELETE_KEY, GET,
                                           MAX_VALUE, MULTI_GET, MULTI_SET, NUM_KEYS, SET,
                                           WAIT)

POLL_S = 1.0            # how often a waiting server thread looks for its client's departure
# What the whole table may hold: a fixed job keeps a few hundred small keys
# (rank claims, addresses, the status); an elastic leader adds about two a
# member for each generation (gloo's groups, e/<g>/...), none deleted, so
# 64 members meet 8,000 times before the bound. A member writing without
# end is refused with ValueError, which its call raises, rather than
# filling the serving process's memory.
MAX_TABLE_KEYS = 1 << 20
MAX_TABLE_BYTES = 1 << 30


class WaitTimeout(TimeoutError):
    """Keys a caller waited for were not all set within its timeout."""


class Gone(Exception):
    """The client of a waiting request went away."""


_STOLL = re.compile(rb"\s*([+-]?[0-9]+)")


def _counter(value):
    """A counter's value as c10d reads it (std::stoll: leading blanks, a sign,
    digits, anything after ignored); ValueError like HashStore otherwise."""
    match = _STOLL.match(value)
    if match is None or not -2**63 <= int(match.group(1)) < 2**63:
        raise ValueError("stoll")
    return int(match.group(1))


def _wrap64(number):
    """c10d adds in int64_t, which wraps around."""
    return (number + 2**63) % 2**64 - 2**63


class Table:
    """The store's data in the serving process: bytes -> bytes, and a condition
    that wakes waiters whenever a key changes. Waits take seconds (None: no
    limit) and an optional ``gone()`` that ends a wait whose client left."""

    def __init__(self, max_keys=None, max_bytes=None):
        self._data, self._bytes = {}, 0
        self._changed = threading.Condition()
        self.max_keys = MAX_TABLE_KEYS if max_keys is None else max_keys
        self.max_bytes = MAX_TABLE_BYTES if max_bytes is None else max_bytes

    def _put(self, items):
        """Store ``items`` (key, value) if the table stays within its bounds
        (called holding the condition); else ValueError naming the bound."""
        changes = dict(items)
        new = [k for k in changes if k not in self._data]
        grown = sum(len(v) - len(self._data.get(k, b"")) + (len(k) if k in new else 0)
                    for k, v in changes.items())
        if len(self._data) + len(new) > self.max_keys:
            raise ValueError(f"the job's store holds {len(self._data)} keys, its most is "
                             f"{self.max_keys} (a member that writes keys without end?)")
        if self._bytes + grown > self.max_bytes:
            raise ValueError(f"the job's store holds {self._bytes} bytes, its most is "
                             f"{self.max_bytes} (a member that writes without end?)")
        self._data.update(changes)
        self._bytes += grown
        self._changed.notify_all()

    def _wait_for(self, ready, timeout, gone):
        """Wait (holding the condition) until ``ready()``; WaitTimeout after
        ``timeout`` seconds, Gone as soon as ``gone()`` says so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise WaitTimeout(f"wait timeout after {timeout * 1000:.0f}ms")
            if gone is not None:
                if gone():
                    raise Gone()
                left = POLL_S if left is None else min(left, POLL_S)
            self._changed.wait(left)

    def set(self, key, value):
        with self._changed:
            self._put([(key, value)])

    def get(self, key, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: key in self._data, timeout, gone)
            return self._data[key]

    def add(self, key, amount):
        """The counter at ``key`` plus ``amount`` (a missing key counts 0),
        stored as ASCII decimal as TCPStore does."""
        with self._changed:
            value = _wrap64(_counter(self._data.get(key, b"0")) + amount)
            self._put([(key, str(value).encode())])
            return value

    def check(self, keys):
        with self._changed:
            return all(key in self._data for key in keys)

    def wait(self, keys, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: all(key in self._data for key in keys), timeout, gone)

    def compare_set(self, key, expected, desired):
        """c10d's compare-and-set: a missing key is created only when
        ``expected`` is empty; returns the value after the operation (for a
        missing key left alone: ``expected``, as HashStore and TCPStore do)."""
        with self._changed:
            current = self._data.get(key)
            if current is None and expected != b"":
                return expected
            if current is None or current == expected:
                self._put([(key, desired)])
                return desired
            return current

    def delete_key(self, key):
        with self._changed:
            value = self._data.pop(key, None)
            if value is None:
                return False
            self._bytes -= len(key) + len(value)
            return True

    def num_keys(self):
        with self._changed:
            return len(self._data)

    def append(self, key, value):
        with self._changed:
            joined = self._data.get(key, b"") + value
            if len(joined) > MAX_VALUE:
                raise ValueError(f"appending would make a value of {len(joined)} bytes "
                                 f"(at most {MAX_VALUE})")
            self._put([(key, joined)])

    def multi_get(self, keys, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: all(key in self._data for key in keys), timeout, gone)
            return [self._data[key] for key in keys]

    def multi_set(self, keys, values):
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        with self._changed:
            self._put(zip(keys, values))


def execute(table, op, args, gone=None):
    """One request's result against ``table``; WaitTimeout, ValueError."""
    if op in (GET, WAIT, MULTI_GET):
        timeout, keys = args
        return getattr(table, {GET: "get", WAIT: "wait", MULTI_GET: "multi_get"}[op])(
            keys, timeout, gone)
    method = {SET: table.set, ADD: table.add, CHECK: table.check, COMPARE_SET: table.compare_set,
              DELETE_KEY: table.delete_key, NUM_KEYS: table.num_keys, APPEND: table.append,
              MULTI_SET: table.multi_set}[op]
    return method(*args)
