"""The store of jobs with a secret (hetseq/store/server.py): served only
through the channel's handshake, never on an unauthenticated listener.

Here the tests that start processes or take seconds; the fast in-process
ones are in tests/unit/store/test_store.py."""

import datetime
import json
import os
import secrets
import select
import socket
import struct
import subprocess
import sys

import torch.distributed as dist

from hetseq.store import channel

from machinery.settings import ROOT, require
from unit.store.test_store import SECRET


def test_gloo_job_of_three_processes():
    """Rank 0 serves (store.serve); ranks 1-2 connect (store.connect); gloo
    meets through PrefixStore("pg", store), all-reduces, makes a new group."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    env = dict(os.environ, HETSEQ_JOB_SECRET=SECRET, GLOO_SOCKET_IFNAME="lo",
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    procs = []
    try:
        for rank in range(3):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", RANK, str(rank), str(port), str(listener.fileno())],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                pass_fds=[listener.fileno()] if rank == 0 else []))
        listener.close()
        outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    finally:
        listener.close()
        for proc in procs:
            proc.kill()
            proc.wait()
    results = []
    for rank, (proc, output) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"rank {rank}:\n{output}"
        results.append(json.loads(output.split("RESULT ", 1)[1].splitlines()[0]))
    for result in results:
        assert result["sum"] == 6.0 and result["group_sum"] == 60.0
    assert results[0]["kind"] == "LocalStore" and results[1]["kind"] == "RemoteStore"


RANK = r"""
import datetime, json, os, socket, sys, time
import torch, torch.distributed as dist
from hetseq.store import channel, gate, job_secret
from hetseq.store import server as store, server as store_table
rank, port, fd = map(int, sys.argv[1:4])
secret = job_secret.read_secret(None, os.environ)
timeout = datetime.timedelta(seconds=20)
if rank == 0:
    s = store.serve(socket.socket(fileno=fd), secret, timeout)
else:
    s = store.connect(("127.0.0.1", port), secret, timeout)
dist.init_process_group("gloo", store=dist.PrefixStore("pg", s), rank=rank, world_size=3,
                        timeout=timeout)
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
group = dist.new_group()
group_total = torch.tensor([10.0 * (rank + 1)])
dist.all_reduce(group_total, group=group)
dist.destroy_process_group()
s.add("left", 1)
deadline = time.monotonic() + 20
while rank == 0 and s.add("left", 0) < 3 and time.monotonic() < deadline:
    time.sleep(0.01)      # the server stays until every client is done with it
print("RESULT " + json.dumps({"sum": total.item(), "group_sum": group_total.item(),
                              "kind": type(s).__name__}), flush=True)
"""


def listening(pid):
    """(host, port) of each TCP socket that process ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    found = []
    for table, any_address in (("/proc/net/tcp", "0.0.0.0"), ("/proc/net/tcp6", "::")):
        with open(table) as f:
            for row in (line.split() for line in f.readlines()[1:]):
                if row[3] == "0A" and row[9] in inodes:
                    hex_address, hex_port = row[1].split(":")
                    raw = b"".join(struct.pack("=I", int(hex_address[i:i + 8], 16))
                                   for i in range(0, len(hex_address), 8))
                    address = socket.inet_ntop(socket.AF_INET if len(raw) == 4
                                               else socket.AF_INET6, raw)
                    if address in (any_address, "::ffff:0.0.0.0"):
                        address = "127.0.0.1"
                    found.append((address, int(hex_port, 16)))
    return found


def as_nobody():
    os.setgid(65534)
    os.setuid(65534)


def runnable_as_nobody():
    for exe in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            subprocess.run([exe, "-c", "pass"], preexec_fn=as_nobody, cwd="/", timeout=10,
                           check=True, capture_output=True)
            return exe
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def test_another_uid_cannot_reach_the_store_without_the_handshake():
    """As another uid (nobody), speak TCPStore's protocol to every port the
    serving process listens on: only the gate answers, and it gives nothing
    without the secret. A TCPStore on 127.0.0.1 (the control) does give the
    key to that same probe."""
    require(os.geteuid() == 0, "needs root (to run a probe as another uid)")
    python = runnable_as_nobody()
    require(python is not None, "needs a Python that uid 65534 may run")
    value = secrets.token_hex(8)
    control = dist.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10),
                            wait_for_workers=False)
    control.set("hetseq/claim/0", value)
    listener = socket.create_server(("127.0.0.1", 0))
    served_port = listener.getsockname()[1]
    env = dict(os.environ, HETSEQ_JOB_SECRET=SECRET, PYTHONPATH=str(ROOT))
    server = subprocess.Popen([sys.executable, "-c", SERVE, str(listener.fileno()), value],
                              env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, pass_fds=[listener.fileno()])
    try:
        listener.close()
        ready, _, _ = select.select([server.stdout], [], [], 30)
        assert ready and server.stdout.readline().strip() == "READY"
        ports = listening(server.pid)
        assert ("127.0.0.1", served_port) in ports
        targets = ports + [("127.0.0.1", control.port)]
        probe = subprocess.run([python, "-c", PROBE, json.dumps(targets), "hetseq/claim/0"],
                               preexec_fn=as_nobody, cwd="/", capture_output=True, text=True,
                               timeout=60, env={})
    finally:
        server.kill()
        server.wait()
    report = json.loads(probe.stdout)
    assert report["uid"] == 65534
    assert report["ports"].pop(f"127.0.0.1:{control.port}").get("value") == value
    assert report["ports"] and all("value" not in seen for seen in report["ports"].values()), \
        report
    assert all(bytes.fromhex(seen["greeting"]).startswith(channel.MAGIC)
               for seen in report["ports"].values()), report


SERVE = r"""
import os, socket, sys, time
from hetseq.store import channel, gate, job_secret
from hetseq.store import server as store, server as store_table
s = store.serve(socket.socket(fileno=int(sys.argv[1])), job_secret.read_secret(None, os.environ), 10)
s.set("hetseq/claim/0", sys.argv[2])
print("READY", flush=True)
sys.stdin.read()
"""


PROBE = r"""
import json, os, socket, struct, sys
targets, key = json.loads(sys.argv[1]), sys.argv[2].encode()

def string(data):
    return struct.pack("<Q", len(data)) + data

def exactly(sock, n):
    data = b""
    while len(data) < n:
        got = sock.recv(n - len(data))
        if not got:
            raise ConnectionError("closed")
        data += got
    return data

out = {"uid": os.getuid(), "ports": {}}
for host, port in targets:
    seen = {}
    try:
        sock = socket.create_connection((host, port), timeout=3)
        sock.settimeout(0.3)
        try:
            seen["greeting"] = sock.recv(64).hex()
        except socket.timeout:
            seen["greeting"] = ""
        sock.settimeout(3)
        # TCPStore's protocol: VALIDATE, CHECK [key], GET key.
        sock.sendall(bytes([0]) + struct.pack("<I", 0x3C85F7CE))
        for name in (key, b"/" + key):    # TCPStore's Python API adds the "/"
            sock.sendall(bytes([5]) + struct.pack("<Q", 1) + string(name))
            if exactly(sock, 1) == b"\0":
                sock.sendall(bytes([3]) + string(name))
                seen["value"] = exactly(sock, struct.unpack("<Q", exactly(sock, 8))[0]).decode()
    except Exception as err:
        seen["error"] = f"{type(err).__name__}: {err}"
    out["ports"][f"{host}:{port}"] = seen
print(json.dumps(out))
"""
