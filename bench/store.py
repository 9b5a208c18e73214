#!/usr/bin/env python
"""What the job's own store (hetseq/store/server.py, jobs with a secret)
costs against c10d's TCPStore (jobs without one), on 127.0.0.1.

Three measures, each taken on both stores in alternating rounds (so that the
drift of a shared machine hits both alike):
  - a client's round trip: set, get, add and check through a client of the
    store served in this process (the store's gate and handshake for ours);
  - the serving process's own calls (rank 0's, and every elastic member's
    "did a node ask to join?" check, once per update): in-process for ours,
    a loopback round trip for TCPStore;
  - starting a 3-rank gloo process group on the store (rank 0's store in
    this process, ranks 1-2 in processes of their own).
Ratios are ours over TCPStore's time (below 1: ours is faster). Prints JSON.

    python bench/store.py [--ops N] [--rounds N] [--out FILE]
"""

import argparse
import datetime
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from output import emit  # noqa: E402

from hetseq.store import job_secret, server as hstore  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=60)
# Every store and listening socket stays open until the end: a TCPStore
# server keeps polling its descriptor, which a closed socket would hand on.
_KEEP = []


def secret_key(text):
    return job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: text})


def serve(kind, key):
    """(the serving side's store, a function making a client)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    _KEEP.append(listener)
    if kind == "hetseq":
        served = hstore.serve(listener, key, TIMEOUT)
        return served, lambda: hstore.connect(("127.0.0.1", port), key, TIMEOUT), listener
    served = dist.TCPStore("127.0.0.1", port, None, True, TIMEOUT, wait_for_workers=False,
                           master_listen_fd=listener.fileno())
    return served, lambda: dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT), listener


def per_op_us(store, ops):
    """Microseconds per call of set, get, add and check (each ``ops`` times)."""
    times = {}
    for name, call in (("set", lambda i: store.set(f"k{i % 64}", b"v" * 64)),
                       ("get", lambda i: store.get(f"k{i % 64}")),
                       ("add", lambda i: store.add("counter", 1)),
                       ("check", lambda i: store.check(["k1"]))):
        start = time.perf_counter()
        for i in range(ops):
            call(i)
        times[name] = (time.perf_counter() - start) / ops * 1e6
    return times


def _rank(rank, port, kind, text, ready):
    if kind == "hetseq":
        client = hstore.connect(("127.0.0.1", port), secret_key(text), TIMEOUT)
    else:
        client = dist.TCPStore("127.0.0.1", port, None, False, TIMEOUT)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", client), rank=rank,
                            world_size=3, timeout=TIMEOUT)
    dist.barrier()
    dist.destroy_process_group()
    ready.put(rank)


def group_start_s(kind, text):
    """Seconds until a 3-rank gloo group, started on the store, passed a barrier."""
    served, _, listener = serve(kind, secret_key(text))
    port = listener.getsockname()[1]
    context = mp.get_context("spawn")
    ready = context.Queue()
    procs = [context.Process(target=_rank, args=(rank, port, kind, text, ready))
             for rank in (1, 2)]
    for proc in procs:
        proc.start()
    start = time.perf_counter()
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", served), rank=0, world_size=3,
                            timeout=TIMEOUT)
    dist.barrier()
    took = time.perf_counter() - start
    dist.destroy_process_group()
    for proc in procs:
        ready.get(timeout=60)
        proc.join(60)
    _KEEP.append(served)
    return took


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    opts = parser.parse_args()
    text = secrets.token_hex(32)
    client_us = {"hetseq": [], "tcpstore": []}
    local_us = {"hetseq": [], "tcpstore": []}
    start_s = {"hetseq": [], "tcpstore": []}
    for round_ in range(opts.rounds):
        order = ("hetseq", "tcpstore") if round_ % 2 == 0 else ("tcpstore", "hetseq")
        for kind in order:
            served, client, _ = serve(kind, secret_key(text))
            connected = client()
            _KEEP.extend((served, connected))
            client_us[kind].append(per_op_us(connected, opts.ops))
            local_us[kind].append(per_op_us(served, opts.ops))
        for kind in order:
            start_s[kind].append(group_start_s(kind, text))

    def median(samples, op):
        return statistics.median(sample[op] for sample in samples)
    ops = ("set", "get", "add", "check")
    result = {"ops_per_measure": opts.ops, "rounds": opts.rounds,
              "client_round_trip_us": {kind: {op: round(median(s, op), 1) for op in ops}
                                       for kind, s in client_us.items()},
              "serving_process_call_us": {kind: {op: round(median(s, op), 2) for op in ops}
                                          for kind, s in local_us.items()},
              "gloo_group_start_s": {kind: round(statistics.median(s), 3)
                                     for kind, s in start_s.items()}}
    result["ratios_hetseq_over_tcpstore"] = {
        "client_round_trip": {op: round(median(client_us["hetseq"], op) /
                                        median(client_us["tcpstore"], op), 2) for op in ops},
        "serving_process_call": {op: round(median(local_us["hetseq"], op) /
                                           median(local_us["tcpstore"], op), 3) for op in ops},
        "gloo_group_start": round(statistics.median(start_s["hetseq"]) /
                                  statistics.median(start_s["tcpstore"]), 2)}
    emit(result, opts.out)


if __name__ == "__main__":
    main()
