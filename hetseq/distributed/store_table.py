"""The data of the job's store (store.py) in the serving process, with
c10d's semantics (HashStore's and TCPStore's: counters in ASCII decimal that
wrap in int64, compare-and-set, waits with timeouts)."""

import re
import threading
import time

from hetseq.distributed.store_wire import (ADD, APPEND, CHECK, COMPARE_SET, DELETE_KEY, GET,
                                           MAX_VALUE, MULTI_GET, MULTI_SET, NUM_KEYS, SET,
                                           WAIT)

POLL_S = 1.0            # how often a waiting server thread looks for its client's departure


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

    def __init__(self):
        self._data = {}
        self._changed = threading.Condition()

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
            self._data[key] = value
            self._changed.notify_all()

    def get(self, key, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: key in self._data, timeout, gone)
            return self._data[key]

    def add(self, key, amount):
        """The counter at ``key`` plus ``amount`` (a missing key counts 0),
        stored as ASCII decimal as TCPStore does."""
        with self._changed:
            value = _wrap64(_counter(self._data.get(key, b"0")) + amount)
            self._data[key] = str(value).encode()
            self._changed.notify_all()
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
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return current

    def delete_key(self, key):
        with self._changed:
            return self._data.pop(key, None) is not None

    def num_keys(self):
        with self._changed:
            return len(self._data)

    def append(self, key, value):
        with self._changed:
            joined = self._data.get(key, b"") + value
            if len(joined) > MAX_VALUE:
                raise ValueError(f"appending would make a value of {len(joined)} bytes "
                                 f"(at most {MAX_VALUE})")
            self._data[key] = joined
            self._changed.notify_all()

    def multi_get(self, keys, timeout=None, gone=None):
        with self._changed:
            self._wait_for(lambda: all(key in self._data for key in keys), timeout, gone)
            return [self._data[key] for key in keys]

    def multi_set(self, keys, values):
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        with self._changed:
            self._data.update(zip(keys, values))
            self._changed.notify_all()


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
