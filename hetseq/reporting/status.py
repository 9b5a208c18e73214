"""``hetseq-status tcp://HOST:PORT[/JOB_ID]``: a running job seen from any machine that
reaches its meeting point. Rank 0 writes one JSON value into the store it
serves (``StatusBoard``); the viewer passes the gate as a node would, reads
that one bounded key and draws it. Every network step has a deadline and
Ctrl-C works at any moment (docs/security.md), and any value read gives a
status or one line, because without a secret anyone may write the key."""

import argparse
import datetime
import json
import logging
import math
import os
import socket
import sys
import threading
import time

import torch.distributed as dist

from hetseq.base.errors import UserError
from hetseq.base.flags import Parser
from hetseq.reporting.progress import format_duration
from hetseq.store import channel, job_secret, server as job_store

logger = logging.getLogger(__name__)

KEY = "hetseq/status"
INTERVAL_S = 1.0
CONNECT_S = 10.0
MAX_VALUE = 1 << 20          # bytes of the status value read, at most
MAX_NUMBER = 1e15            # |a number| drawn, at most: shares and times cannot overflow
MAX_STUCK = 4                # workers left waiting on a silent peer before the viewer gives up


class StatusBoard:
    """Rank 0's view of the job in ``store``; ``hosts``: each rank's host;
    ``nodes``: each rank's node (as hetseq-launch names it: ``localhost#2``;
    default: its host); ``generation``: the elastic generation's number
    (None in a fixed job)."""

    def __init__(self, store, hosts, generation=None, nodes=None):
        self.store, self.hosts, self.generation = store, list(hosts), generation
        self.nodes = list(nodes) if nodes is not None else self.hosts
        self.view = {"state": "training", "generation": generation, "checkpoint": None}
        self._last = 0.0

    def due(self):
        """Whether INTERVAL_S passed since the last write (the per-update
        figures are gathered only then: rank 0's update path stays as it was)."""
        return time.monotonic() - self._last >= INTERVAL_S

    def update(self, **figures):
        """Merge ``figures`` into the view and write it."""
        self.view.update(figures)
        self._last = time.monotonic()
        try:
            self.store.set(KEY, json.dumps({**self.view, "time": time.time()}))
        except (RuntimeError, OSError, ValueError) as err:
            # Never the job's problem: a status that cannot be written is stale.
            logger.debug("could not publish the status: %s", err)

    def ranks(self, batch_sizes, samples, seconds, wall_s):
        """Each rank's row: host, node, batch, samples/s of its compute, time waited."""
        return [{"rank": r, "host": self.hosts[r] if r < len(self.hosts) else "?",
                 "node": self.nodes[r] if r < len(self.nodes) else "?",
                 "batch": b, "samples_per_s": n / t if t > 0 else None,
                 "wait_s": max(0.0, wall_s - t) if t > 0 else None}
                for r, (b, n, t) in enumerate(zip(batch_sizes, samples, seconds))]


# ---- the reader: hetseq-status ----

def open_store(url, secret, timeout_s=CONNECT_S):
    """A read connection to the store at ``url`` (tcp://HOST:PORT), through
    the gate with a secret, else c10d's TCPStore client."""
    from hetseq.distributed.meeting_point import url_host_port
    try:
        host, port = url_host_port(url) if url.startswith("tcp://") else (None, None)
    except ValueError:
        host, port = None, None
    if not host or not isinstance(port, int) or not 1 <= port <= 65535:
        raise UserError(f"{url}: expected the job's tcp://HOST:PORT or tcp://HOST:PORT/JOB_ID "
                        "(its --distributed-init-method)")
    job_secret.job_id(url)          # a UserError for what is no job id
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise UserError(f"nothing answers at {url} ({err.strerror or err}): is the job "
                        "running, and is this its --distributed-init-method?") from None
    except ValueError as err:        # UnicodeError: 'a..b' is no host name
        raise UserError(f"{url}: {host!r} is not a host name ({err})") from None
    try:
        if secret is None:
            if channel.asks_for_secret((host, port)):
                raise UserError(f"the job at {url} has a job secret: give it with "
                                "--job-secret-file PATH or HETSEQ_JOB_SECRET")
            return dist.TCPStore(host, port, None, False, timeout)
        channel.check((host, port), secret, url, patience_s=timeout_s)
        return job_store.connect((host, port), secret, timeout)
    except (RuntimeError, OSError, channel.Refused) as err:
        raise UserError(f"could not read the job at {url}: {str(err).splitlines()[0]}") from None


def leader_store(store, url, secret, timeout_s=CONNECT_S):
    """Under --elastic, the store of the generation's leader (every member
    names it in ``e/leader``); otherwise ``store`` itself."""
    from hetseq.distributed.meeting_point import url_host_port
    if secret is None or not store.check(["e/leader"]):
        return store, url
    leader = _json_value(store, "e/leader")
    addr = leader.get("addr") if isinstance(leader, dict) else None
    port = _whole(leader.get("port")) if isinstance(leader, dict) else None
    if not (isinstance(addr, str) and 0 < len(addr) <= 255 and addr.isprintable()
            and " " not in addr and port is not None and 1 <= port <= 65535):
        raise UserError(f"{url}: the member's e/leader is not an address")
    there = f"tcp://{f'[{addr}]' if ':' in addr else addr}:{port}"
    if url_host_port(there) == url_host_port(url):        # (url may end in its job id)
        return store, url
    store.close()
    return open_store(there, secret, timeout_s), there


def look(url, secret, timeout_s=CONNECT_S):
    """(store, its URL) where the job's status is: ``url``'s, or its leader's."""
    return leader_store(open_store(url, secret, timeout_s), url, secret, timeout_s)


_workers: list = []                # bounded()'s threads; one alive is blocked in the network


def bounded(step, url, timeout_s):
    """``step()``'s result, from a daemon thread the main thread waits for in
    0.1-s joins: Ctrl-C interrupts a join (never a C++ recv), and past
    ``timeout_s`` the wait ends with a UserError while the thread is left."""
    _workers[:] = [w for w in _workers if w.is_alive()]
    if len(_workers) >= MAX_STUCK:        # --watch: a peer that keeps going silent
        raise UserError(f"{url} went silent {MAX_STUCK} times (each for --timeout "
                        f"{timeout_s:g} s): is the job stuck or its host overloaded? Try "
                        "again later, or with a longer --timeout")
    box = {}

    def work():
        try:
            box["value"] = step()
        except BaseException as err:       # handed to the main thread as it is
            box["error"] = err
    worker = threading.Thread(target=work, name="hetseq-status-read", daemon=True)
    worker.start()
    _workers.append(worker)
    deadline = time.monotonic() + timeout_s
    while worker.is_alive():
        if time.monotonic() >= deadline:
            raise UserError(
                f"{url} did not answer within {timeout_s:g} s: is it the job's "
                "--distributed-init-method (a service that accepts and stays silent "
                "looks like this)? A busy job may need a longer --timeout")
        worker.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]


class BadValue(UserError):
    """What the store holds, or answers, is no status: --watch shows the
    line and looks again."""


def read(store):
    """The job's status (a dict, ``clean``), or None before rank 0 published one."""
    if not _answer(store.check, [KEY]):
        return None
    view = _json_value(store, KEY)
    if not isinstance(view, dict):
        raise BadValue(f"the job's {KEY} is not a status")
    return clean(view)


def _answer(call, *args):
    """A store call whose answer a hostile service may have made up (c10d's
    client then fails in C++: a length no store sends, MemoryError): one
    line. A lost connection (DistError) stays what it is."""
    try:
        return call(*args)
    except dist.DistError:
        raise
    except (RuntimeError, ValueError, MemoryError, OverflowError) as err:
        raise BadValue(f"the store answered what no HetSeq store sends ({type(err).__name__}: "
                       f"{str(err).splitlines()[0] if str(err) else 'no message'}): is this a "
                       "HetSeq job's --distributed-init-method?") from None


def _json_value(store, key):
    """The JSON value at ``key``, bounded: whoever holds the secret, or
    reaches a job without one, could have written anything there."""
    raw = _answer(store.get, key)
    if len(raw) > MAX_VALUE:
        raise BadValue(f"the job's {key} is {len(raw)} bytes, more than a status "
                        f"({MAX_VALUE} at most): not HetSeq's, or another version's")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:   # RecursionError: "[[[[..." nested deep
        raise BadValue(f"the job's {key} is not JSON ({type(err).__name__}; another "
                        "HetSeq version?)") from None


MAX_RANKS = 4096
MAX_TEXT = 512


def _number(value):
    """A number within MAX_NUMBER (NaN and the infinities fail the test; a
    huge int is compared, never converted to float, which would overflow)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return value if ok and abs(value) <= MAX_NUMBER else None


def _whole(value):
    return int(value) if _number(value) is not None and value == int(value) else None


def _count(value):
    """A whole number >= 0 (a batch, an update): negatives would make shares lie."""
    whole = _whole(value)
    return whole if whole is not None and whole >= 0 else None


def _text(value):
    """Printable characters only: what the store holds must not drive the terminal.
    Strings and numbers only: str() of a deep list recurses."""
    if _number(value) is not None:
        value = str(value)
    if not isinstance(value, str):
        return None
    return "".join(c for c in value[:MAX_TEXT] if c.isprintable())


def clean(view):
    """The fields this viewer draws, each of its type (else None): whoever
    holds the secret, or reaches a job without one, could have written it."""
    ranks = view.get("ranks") if isinstance(view.get("ranks"), list) else []
    saved = view.get("checkpoint") if isinstance(view.get("checkpoint"), dict) else None
    return {
        "state": _text(view.get("state")) or "?", "generation": _count(view.get("generation")),
        "update": _count(view.get("update")) or 0, "planned": _count(view.get("planned")),
        "left_s": _number(view.get("left_s")), "left": _text(view.get("left")),
        "loss": _number(view.get("loss")),
        "samples_per_s": _number(view.get("samples_per_s")), "time": _number(view.get("time")),
        "ranks": [{"rank": _count(r.get("rank")), "host": _text(r.get("host")) or "?",
                   "node": _text(r.get("node")) or _text(r.get("host")) or "?",
                   "batch": _count(r.get("batch")) or 0,
                   "samples_per_s": _number(r.get("samples_per_s")),
                   "wait_s": _number(r.get("wait_s"))}
                  for r in ranks[:MAX_RANKS] if isinstance(r, dict)],
        "checkpoint": None if saved is None else {
            "path": _text(saved.get("path")) or "?", "update": _count(saved.get("update")),
            "time": _number(saved.get("time"))},
    }


def _cell(value, fmt):
    return "-" if value is None else fmt.format(value)


def _ago(then, now):
    return "?" if then is None else f"{max(0.0, now - then):.0f}"


def render(view, url, now=None):
    """The status (``clean``'s fields) as text lines."""
    if view is None:
        return [f"{url}: the job has not published its status yet (it is starting)"]
    now = time.time() if now is None else now
    planned = view["planned"]
    head = [url, f"update {view['update']}" + (f"/{planned}" if planned else "")]
    if view.get("left"):            # rank 0's words: 'measuring time left', '... + saving'
        head.append(view["left"])
    elif view["left_s"] is not None:
        head.append(f"{format_duration(view['left_s'])} left")
    if view["generation"] is not None:
        head.append(f"generation {view['generation']}")
    ranks = view["ranks"]
    head.append(f"{len({r['node'] for r in ranks})} node(s) on {len({r['host'] for r in ranks})} "
                f"host(s), {len(ranks)} rank(s)")
    head.append(f"{view['state']} as of {_ago(view['time'], now)} s ago")
    lines = [" | ".join(head)]
    if view["loss"] is not None:
        lines.append(f"loss {view['loss']:.4g} | {view['samples_per_s'] or 0:.1f} samples/s")
    total = sum(r["batch"] for r in ranks) or 1
    lines.append(f"{'rank':>4}  {'node':<16} {'batch':>6} {'share':>6} {'samples/s':>10} "
                 f"{'waiting':>8}")
    for r in ranks:
        lines.append(f"{_cell(r['rank'], '{}'):>4}  {r['node'][:16]:<16} {r['batch']:>6} "
                     f"{100 * r['batch'] / total:>5.0f}% "
                     f"{_cell(r['samples_per_s'], '{:.1f}'):>10} "
                     f"{_cell(r['wait_s'], '{:.2f} s'):>8}")
    saved = view["checkpoint"]
    lines.append("last checkpoint: " + ("none yet" if not saved else
                 f"{saved['path']} (update {saved['update']}, {_ago(saved['time'], now)} s ago)"))
    return lines


def seconds(text):
    """--interval's and --timeout's value: 1 to 3600 seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds from 1 to 3600")
    return value


def show(text):
    """Print ``text``; a character the terminal's encoding lacks becomes '?'."""
    encoding = sys.stdout.encoding or "utf-8"
    print(text.encode(encoding, "replace").decode(encoding), flush=True)


def watch(args, secret):
    """Look, then read and draw once, or until Ctrl-C with --watch."""
    store, url = bounded(lambda: look(args.url, secret, args.timeout), args.url,
                         args.timeout)
    view = None
    while True:
        try:
            view = bounded(lambda: read(store), url, args.timeout)
        except BadValue as err:
            if not args.watch:
                raise
            show(f"{url}: {err}")        # it may be published again: look again
            time.sleep(args.interval)
            continue
        except (dist.DistError, UserError):
            if not args.watch:
                raise
            if view is not None and view["state"].startswith("done"):
                print(f"{url}: the job ended ({view['state']})")
                return
            # The member it read from is gone or silent (--elastic: a new
            # leader): ask again.
            time.sleep(args.interval)
            store, url = bounded(lambda: look(args.url, secret, args.timeout), args.url,
                                 args.timeout)
            continue
        text = json.dumps(view) if args.json else "\n".join(render(view, url))
        if args.watch and not args.json and sys.stdout.isatty():
            text = "\x1b[H\x1b[2J" + text        # redraw in place
        show(text)
        if not args.watch:
            return
        time.sleep(args.interval)


def main(argv=None):
    """hetseq-status; ``argv`` None: the command itself, which leaves with
    os._exit when a worker is still blocked in C++ (interpreter shutdown
    could wait on it); called with ``argv``, it raises SystemExit as usual."""
    parser = Parser(
        prog="hetseq-status", description="Show a running HetSeq job: members, shares, "
        "speed, progress, last checkpoint (read-only).")
    parser.add_argument("url", metavar="tcp://HOST:PORT[/JOB_ID]",
                        help="the job's --distributed-init-method, its job id included (as "
                        "hetseq-launch prints it; any member's address, with --elastic)")
    parser.add_argument("--job-secret-file", metavar="PATH",
                        help="the job's secret (or HETSEQ_JOB_SECRET)")
    parser.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    parser.add_argument("--interval", type=seconds, default=2.0, metavar="S",
                        help="seconds between looks with --watch (default: 2; 1 to 3600)")
    parser.add_argument("--timeout", type=seconds, default=CONNECT_S, metavar="S",
                        help="seconds each look may wait for the job to answer "
                        f"(default: {CONNECT_S:g}; 1 to 3600)")
    parser.add_argument("--json", action="store_true", help="print the status as JSON")
    args = parser.parse_args(argv)
    code = 0
    try:
        # Salted once, with the job id of the URL given: a leader it moves
        # to is named by address only, and is the same job.
        watch(args, job_secret.read_secret(args.job_secret_file, url=args.url))
    except KeyboardInterrupt:         # Ctrl-C: the shell's code for an interrupted command
        code = 130
    except BrokenPipeError:           # | head -1: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (UserError, dist.DistError) as err:
        print(f"hetseq-status: error: {err}", file=sys.stderr)
        code = getattr(err, "exit_code", 2)
    if argv is None and any(w.is_alive() for w in _workers):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
