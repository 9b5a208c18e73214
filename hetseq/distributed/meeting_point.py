"""The meeting point: the key-value store at --distributed-init-method
(tcp://, env:// or file://), served by rank 0 (or an elastic member) and
reached by the others, with messages a user can act on (an unreachable or
busy master, a taken port, a host name that resolves to loopback).

Where a store listens: only on the job's address, never on every address of
the host; with a job secret, behind the gate (hetseq/store/gate.py) and nowhere else. A
second node of one job on one host takes another port; a port held by
anything else, a relay to a member included, is an error that names it.
"""

import dataclasses
import datetime
import errno
import ipaddress
import logging
import os
import socket
import urllib.parse

import torch.distributed as dist

from hetseq.distributed import interfaces, network
from hetseq.base.errors import UserError
from hetseq.store import channel, server as store
from hetseq.store.job_secret import JobSecret, job_id

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Access:
    """Who may reach the store this node serves or joins. ``secret``: the job
    secret (None: no secret), salted with the job id of the URL this node
    was given (rendezvous.py; elastic/agent.py); ``interface``: --distributed-interface;
    ``spans_hosts``: ranks of this job run on other hosts."""
    secret: JobSecret | None = None
    interface: str | None = None
    spans_hosts: bool = True


# Sockets handed to TCPStore as master_listen_fd must stay open while it serves.
_LISTENERS: list = []


def _tcp_store(url, host, port, rank, world_size, timeout, hosted, access):
    # Rank 0 serves the store unless the launcher process already does
    # (single-node runs, torchrun's agent store).
    if rank == 0 and not hosted:
        return _serve(url, host, port, world_size, timeout, access)
    if not hosted:
        host = _client_address(host, access)
    network.wait_until_reachable(host, port, timeout.total_seconds(), lambda reason: (
        f"rank {rank} could not reach the master at {_named(host)}:{port} ({url}) within "
        f"{timeout.total_seconds():.0f} s: {reason}. Check that rank 0 runs, that HOST:PORT "
        "is its address as seen from this host, and that no firewall blocks the port"))
    return _client(url, host, port, world_size, timeout, access.secret)


def _client_address(host, access):
    """HOST as a rank on rank 0's own host must reach it (``_own_address``)."""
    try:
        own = _own_address(host, interfaces.resolve(host), access)
    except OSError:
        return host       # does not resolve: wait_until_reachable says so
    return host if own is None else own


def _client(url, host, port, world_size, timeout, secret):
    """A store client of HOST:PORT (reachable): with a secret, the job's own
    store through the gate (hetseq/store/server.py: a handshake, then authenticated
    requests); without, c10d's TCPStore."""
    if secret is None and channel.asks_for_secret((host, port)):
        raise UserError(f"the job at {url} has a job secret and this node none: set "
                        "HETSEQ_JOB_SECRET or --job-secret-file as on the other nodes")
    try:
        if secret is not None:
            channel.check((host, port), secret, url)    # a wrong secret: one clear message
            return store.connect((host, port), secret, timeout)
        return dist.TCPStore(host, port, world_size, False, timeout)
    except (RuntimeError, ValueError, OSError, channel.Refused) as err:
        raise UserError(f"could not reach {url} within {timeout.total_seconds():.0f} s: "
                        f"{str(err).splitlines()[0]}. Check that its node runs, that HOST:PORT "
                        "is its address and that no firewall blocks the port") from None


def serve_meeting_point(url, address, port, secret, timeout_s):
    """An elastic member's store (elastic/membership.py) on ``address``: at ``port``, or,
    when another node of this same job on this host holds that port (its
    gate proves the job's secret), at a port the OS picks. A port held by
    anything else (another job, a job with another secret) is an error: the
    nodes of this job would connect there. Returns (store, port)."""
    listener = _member_listener(url, address, port, secret)
    _LISTENERS.append(listener)
    served = store.serve(listener, secret, datetime.timedelta(seconds=timeout_s))
    return served, listener.getsockname()[1]


def _member_listener(url, address, port, secret):
    try:
        return _bind(address, port)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise UserError(f"could not serve {url} on {address}:{port}: "
                            f"{err.strerror or err}; give this host's address") from None
    holder = _holder(address, port, secret)
    if holder is None:
        raise UserError(_in_use(address, port))
    if not _same_place(holder, (address, port)):
        raise UserError(f"port {port} on {address} is held by a relay to a node of this job "
                        f"that listens on {holder[0]}:{holder[1]} (a forwarder squatting on the "
                        "meeting point can drop joiners): stop the process holding it (ss -ltnp "
                        f"'sport = :{port}'), or pick a free port in --distributed-init-method")
    logger.info("another node of this job serves %s:%d on this host: this node's meeting "
                "point takes a port the OS picks", address, port)
    return _listen(url, address, 0)


# A gate in a process busy training on a loaded host may greet later than
# channel.GREETING_S, or drop a handshake that outlived its HANDSHAKE_S (a
# reset): asked this many times before its port counts as taken.
HOLDER_TRIES = 3


def _holder(address, port, secret):
    """Where the gate at address:port says it listens, under its proof of
    ``secret`` (a relay forwards the proof, not its own address); None when
    no gate of this job holds the port. One that does not greet in time, or
    resets a handshake that took too long, is asked again rather than taken
    for another job's."""
    for _ in range(HOLDER_TRIES):
        try:
            sock, _, _, stated = channel.connect_as_client((address, port), secret)
        except ConnectionRefusedError:
            return None                 # gone: nobody holds it now
        except (TimeoutError, ConnectionError):
            continue                    # too slow for the handshake's deadlines: again
        except (OSError, channel.Refused):
            return None
        sock.close()
        return stated
    return None


def _same_place(stated, address):
    """Whether the gate's stated (host, port) is ``address`` itself."""
    if stated[1] != address[1]:
        return False
    try:
        return ipaddress.ip_address(stated[0]) == ipaddress.ip_address(address[0])
    except ValueError:
        return stated[0] == address[0]


def _in_use(address, port):
    return (f"port {port} on {address} is in use (by another job?): pick a free port in "
            "--distributed-init-method, or stop the process holding it "
            f"(ss -ltnp 'sport = :{port}')")


def join_meeting_point(address, secret, timeout_s):
    """A client of another elastic member's store."""
    host, port = address
    return _client(f"tcp://{_bracketed(host)}:{port}", host, port, None,
                   datetime.timedelta(seconds=timeout_s), secret)


def _bracketed(host):
    return f"[{host}]" if ":" in host else host


def _serve(url, host, port, world_size, timeout, access):
    """Rank 0's store, listening only on the job's address (TCPStore alone
    would listen on every address of the host). With a secret it is the
    job's own store behind the gate (hetseq/store/server.py), and nothing listens on
    loopback for another user of this host to reach."""
    listener = _listen(url, _listen_address(url, host, access), port)
    if access.secret is None:
        return _store_on(listener, world_size, timeout)
    _LISTENERS.append(listener)
    return store.serve(listener, access.secret, timeout)


def loopback_store(world_size, timeout, secret=None, listener=None):
    """A store served on 127.0.0.1 only, on a port the OS picks (``.port``);
    with a secret, behind the gate as on the job's address, salted with the
    job id of tcp://127.0.0.1:PORT, the URL its ranks are given.
    ``listener``: a ``loopback_listener()`` made earlier (its port known, and
    clients queued on it, before any thread serves it)."""
    listener = listener or loopback_listener()
    if secret is None:
        return _store_on(listener, world_size, timeout)
    _LISTENERS.append(listener)
    port = listener.getsockname()[1]
    served = store.serve(listener, secret.for_url(f"tcp://127.0.0.1:{port}"), timeout)
    served.port = port
    return served


def loopback_listener():
    """A socket listening on 127.0.0.1, on a port the OS picks."""
    return _listen("tcp://127.0.0.1:0", "127.0.0.1", 0)


def _store_on(listener, world_size, timeout):
    _LISTENERS.append(listener)
    address, port = listener.getsockname()[:2]
    return dist.TCPStore(address, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.fileno())


def _listen_address(url, host, access):
    """The address rank 0's store listens on: HOST of the URL as it resolves
    here, or ``_own_address`` when that cannot be what other hosts reach.
    Never every address of the host: without a secret that would hand the
    store to anyone who reaches any of them."""
    try:
        address = interfaces.resolve(host)
    except OSError as err:
        raise UserError(f"rank 0 could not serve {url}: {host} does not resolve here "
                        f"({err.strerror}); give this host's address") from None
    own = _own_address(host, address, access)
    if own is None:
        return address    # what every rank resolves HOST to (localhost: one host)
    logger.warning("%s resolves to %s on this host, which other hosts cannot reach: the store "
                   "listens on %s instead (%s), and this host's ranks meet there too", host,
                   address, own, f"--distributed-interface {access.interface}" if
                   access.interface else "this host's primary address; --distributed-interface "
                   "chooses another")
    return own


def _own_address(host, address, access):
    """Where this host's store is when HOST is this host's own name and
    resolves to loopback here (Debian maps it to 127.0.1.1) while other
    hosts take part: the address of --distributed-interface, else this
    host's primary address (its default route's). None otherwise. Rank 0
    listens there and the other ranks of its host connect there, so both
    sides choose the same."""
    if not access.spans_hosts or not interfaces.is_loopback(address) or \
            not interfaces.names_this_host(host):
        return None
    if access.interface:
        chosen = interfaces.address_of(access.interface)
        if chosen is None:
            raise UserError(f"--distributed-interface {access.interface}: no such interface "
                            "with an address on this host")
        return chosen
    return interfaces.primary_address()


def _listen(url, address, port):
    try:
        return _bind(address, port)
    except OSError as err:
        if err.errno == errno.EADDRINUSE:
            raise UserError(f"rank 0 could not serve {url}: {_in_use(address, port)}") from None
        raise UserError(f"rank 0 could not serve {url} on {address}: {err.strerror or err}; "
                        "give an address of this machine as HOST") from None


def _bind(address, port):
    """A listening socket on address:port, of the address's family ("::":
    every address, IPv6 and IPv4)."""
    if address == "::":
        return socket.create_server((address, port), family=socket.AF_INET6,
                                    dualstack_ipv6=True, backlog=128)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return socket.create_server((address, port), family=family, backlog=128)


def _named(host):
    """'hostA (10.0.0.1)': the name and the address it resolves to here."""
    try:
        address = interfaces.resolve(host)
    except OSError:
        return host
    return host if address == host else f"{host} ({address})"


def url_host_port(url):
    """HOST and PORT of tcp://HOST:PORT as written (urlparse lowercases names)."""
    netloc = urllib.parse.urlparse(url).netloc.rpartition("@")[2]
    host, _, port = netloc.rpartition(":")
    # (ASCII digits only: str.isdigit also takes "²" and other scripts' digits)
    number = int(port) if port.isascii() and port.isdigit() and len(port) <= 5 else None
    return host.strip("[]"), number if number and number <= 65535 else None


def _open_tcp(url, rank, world_size, timeout, hosted, access):
    host, port = url_host_port(url)
    if not host or not port:
        raise UserError(f"--distributed-init-method {url}: expected tcp://HOST:PORT "
                        "or tcp://HOST:PORT/JOB_ID")
    job_id(url)         # what follows the port is a job id, secret or not
    return _tcp_store(url, host, port, rank, world_size, timeout, hosted, access)


def _open_env(url, rank, world_size, timeout, hosted, access):
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not port.isdigit():
        raise UserError("env:// needs MASTER_ADDR and MASTER_PORT (an integer) in the environment, "
                        f"got MASTER_ADDR={addr!r} MASTER_PORT={port!r}")
    # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT.
    hosted = hosted or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if hosted and access.secret is not None:
        raise UserError("a job secret needs HetSeq's rank 0 to serve the meeting point, but "
                        "torchrun's agent serves it here, with no authentication: start the "
                        "nodes with --distributed-init-method tcp://HOST:PORT (or drop the secret)")
    store = _tcp_store(f"env:// ({addr}:{port})", addr, int(port), rank, world_size, timeout,
                       hosted, access)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is not None:
        # torchrun's store outlives its workers: after a restart (--max-restarts)
        # the previous round's rank claims would still be there.
        store = dist.PrefixStore(f"hetseq-restart-{restart}", store)
    return store


def _open_file(url, rank, world_size, timeout, hosted, access):
    if access.secret is not None:
        raise UserError(f"--distributed-init-method {url}: a job secret needs a tcp:// meeting "
                        "point (a file:// store is guarded by the file's permissions, not by a "
                        "handshake): use tcp://HOST:PORT, or drop HETSEQ_JOB_SECRET and "
                        "--job-secret-file")
    path = file_path(url)
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise UserError(f"--distributed-init-method {url}: folder {folder} does not exist; "
                        "create it on a filesystem every node shares")
    if not os.access(folder, os.W_OK):
        raise UserError(f"--distributed-init-method {url}: folder {folder} is not writable")
    return dist.FileStore(path, world_size)


STORE_OPENERS = {"tcp": _open_tcp, "env": _open_env, "file": _open_file}


def file_path(url):
    return urllib.parse.unquote(url[len("file://"):])


def open_store(url, rank, world_size, timeout, hosted=False, access=Access()):
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in STORE_OPENERS:
        raise UserError(f"--distributed-init-method {url}: expected tcp://HOST:PORT, "
                        "file:///shared/path or env://")
    return STORE_OPENERS[scheme](url, rank, world_size, timeout, hosted, access)


def master_host(url):
    """The host every rank routes to: tcp://HOST:PORT or MASTER_ADDR; None for file://."""
    if url.startswith("tcp://"):
        return url_host_port(url)[0]
    if url.startswith("env://"):
        return os.environ.get("MASTER_ADDR")
    return None
