"""Naming the rank that stopped answering: a failed collective does not say
which peer it lost, so every rank bumps a counter in the rendezvous store,
and after a failure the survivors name the ranks whose counters stand still
(with the host and pid they registered). An elastic member's heartbeats are
watchdog.py's, which cuts a silent member off. docs/nodes.md, "The manual
way: one command per node".
"""

import threading
import time

import torch.distributed as dist

from hetseq.base.errors import PeerLost

INTERVAL_S = 1.0


def beat_key(rank):
    return f"hetseq/beat/{rank}"


class Heartbeat:
    def __init__(self, store, rank):
        self.store, self.rank = store, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetseq-heartbeat", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.store.add(beat_key(self.rank), 1)
            except Exception:   # the store is gone: the failure is reported elsewhere
                return
            self._stop.wait(INTERVAL_S)

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=2 * INTERVAL_S)


def within(seconds, query):
    """``query()``, or TimeoutError after ``seconds``: TCPStore.add has no
    deadline of its own, and a store whose host became unreachable (a cut
    link, a frozen rank 0) would block it forever. The abandoned daemon
    thread ends with the process."""
    box = {}

    def run():
        try:
            box["value"] = query()
        except Exception as err:   # handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="hetseq-store-query", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise TimeoutError(f"the rendezvous store did not answer within {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def silent_ranks(store, world_size, watch_s=3 * INTERVAL_S):
    """Ranks whose heartbeat does not advance over ``watch_s``; None when the
    store itself is unreachable (its server, rank 0, is gone)."""
    def counters():
        return [store.add(beat_key(r), 0) for r in range(world_size)]
    try:
        before = within(watch_s, counters)
        time.sleep(watch_s)
        after = within(watch_s, counters)
    except Exception:
        return None
    return [r for r in range(world_size) if after[r] == before[r]]


def is_communication_error(err):
    text = str(err)
    return isinstance(err, dist.DistError) or any(
        word in text for word in ("Gloo", "gloo", "NCCL", "Connection closed", "Connection reset",
                                  "Timed out", "timed out", "timeout", "pair closure"))


def _where(info):
    return f"host {info.get('host', '?')}, {info.get('addr', '?')}, pid {info.get('pid', '?')}"


def peer_lost(err, store, rank, world_size, peers):
    """The PeerLost to raise for a failed collective, naming the lost ranks."""
    silent = silent_ranks(store, world_size) if store is not None else None
    if silent is None:
        lost = [0]
        how = "rank 0 serves the rendezvous store and it is unreachable"
    else:
        lost = [r for r in silent if r != rank]
        how = "its heartbeat stopped" if lost else "no rank's heartbeat stopped"
    names = (", ".join(f"rank {r} ({_where(peers.get(r, {}))})" for r in lost)
             or "no rank identified")
    cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
    return PeerLost(f"lost {names}: {how}. Rank {rank} stops too. Collective error: {cause}")
