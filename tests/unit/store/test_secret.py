"""Only invited nodes: a job secret guards the meeting point (channel.py), and
rank 0's store listens only on the job's address."""

import base64
import datetime
import hashlib
import json
import os
import random
import socket
import struct
import threading
import time
import uuid

import pytest

from machinery.relay import relay

from machinery.settings import free_port
from hetseq.distributed import meeting_point
from hetseq.base.errors import UserError
from hetseq.store import channel, job_secret, secret


SECRET = "a8f3e1c97b2d4065a1e0c3b5d7f9e2a4"


OTHER = "3c9b57e0d2a14f86b7e5c0a39d1f6284"   # valid, but not the job's


TIMEOUT = datetime.timedelta(seconds=10)


def key(text):
    return job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: text})


def serve(secret):
    url = f"tcp://127.0.0.1:{free_port()}"
    store = meeting_point.open_store(url, 0, 2, TIMEOUT, access=meeting_point.Access(secret))
    return url, store


def join(url, secret):
    return meeting_point.open_store(url, 1, 2, TIMEOUT, access=meeting_point.Access(secret))


def handshake_pair(client_secret, server_secret):
    """Both ends of one handshake over a socket pair: (client result, server result)."""
    a, b = socket.socketpair()
    results = {}

    def server():
        try:
            results["server"] = channel.handshake_as_server(b, server_secret, None,
                                                           where=("127.0.0.1", 1))
        except channel.Refused as err:
            results["server"] = err
    thread = threading.Thread(target=server)
    thread.start()
    try:
        results["client"] = channel.handshake_as_client(a, client_secret)
    except channel.Refused as err:
        results["client"] = err
    thread.join()
    return a, b, results["client"], results["server"]


def keyed_alike(one, other):
    """Whether a frame ``one`` (a cipher.Seal) seals, ``other`` opens."""
    return other.open(0, b"head", one.seal(0, b"head", b"frame")) == b"frame"


def test_the_handshake_proves_the_secret_both_ways_and_keys_each_direction():
    a, b, client, server = handshake_pair(key(SECRET), key(SECRET))
    # The client's send key is the server's receive key, and the other way round.
    assert keyed_alike(client[0], server[1]) and keyed_alike(server[0], client[1])
    assert not keyed_alike(client[0], client[1]) and not keyed_alike(client[0], server[0])
    _, _, client, server = handshake_pair(key(OTHER), key(SECRET))
    assert isinstance(client, channel.Refused) and isinstance(server, channel.Refused)


def test_a_forged_replayed_or_reordered_frame_is_refused():
    a, b, (send, _, _), (_, receive) = handshake_pair(key(SECRET), key(SECRET))
    channel.send_frame(a, send, 0, b"set key value")
    assert channel.receive_frame(b, receive, 0) == b"set key value"
    channel.send_frame(a, send, 0, b"replayed")                 # sequence number 0 again
    with pytest.raises(channel.Refused):
        channel.receive_frame(b, receive, 1)
    frame = bytearray()
    c, d = socket.socketpair()
    channel.send_frame(c, send, 5, b"claim rank 1")
    frame += d.recv(1024)
    frame[-1] ^= 1                                          # one bit changed in transit
    c.sendall(bytes(frame))
    with pytest.raises(channel.Refused):
        channel.receive_frame(d, receive, 5)
    c.sendall(struct.pack(">I", 4) + bytes(32) + b"junk")  # injected without the key
    with pytest.raises(channel.Refused):
        channel.receive_frame(d, receive, 6)


def recording_relay(target_port):
    """A TCP forwarder on 127.0.0.1 (a port the OS picks) to target_port that
    keeps every byte it passes, both ways: (its port, the bytes, listener)."""
    seen = []
    listener = relay(0, target_port, seen)
    return listener.getsockname()[1], seen, listener


def test_a_relay_between_two_ranks_reads_nothing_of_the_job():
    """Issue 58: a relay between two ranks logged the job's identity, the
    ranks' hosts, PIDs and gloo addresses, and the status key in clear
    text. Rank 1 meets rank 0 through a relay that records every byte; the
    job's own code writes and reads each of these, and none of them is in
    what the relay saw."""
    from hetseq.distributed import identity, rendezvous
    from hetseq.reporting import status
    url, rank0 = serve(key(SECRET))
    relay_port, seen, listener = recording_relay(int(url.rsplit(":", 1)[1]))
    try:
        job = {"lr": [0.000123457], "seed": 918273645, "hetseq_code": "c0de-digest-5e1f"}
        identity.present(rank0, job, 0, url, "founder-host-x1 pid 31337", time.monotonic())
        rank1 = join(f"tcp://127.0.0.1:{relay_port}", key(SECRET))
        identity.present(rank1, job, 1, url, "joiner", time.monotonic() + 10)   # reads rank 0's
        rendezvous.claim_rank(rank1, 1, 2, url, "10.213.77.66")
        board = status.StatusBoard(rank0, ["hostA-status-y2", "hostB"])
        board.update(update=7, loss=2.718281828, checkpoint="/ckpt/run-marker-q9/last.pt")
        assert json.loads(rank1.get(status.KEY))["checkpoint"] == "/ckpt/run-marker-q9/last.pt"
        who = rank0.get("hetseq/who/1").decode()
        rank1.close()
    finally:
        listener.close()
    wire = b"".join(seen)
    assert len(wire) > 500, len(wire)
    plain = [b"918273645", b"0.000123457", b"c0de-digest-5e1f", b"founder-host-x1", b"31337",
             b"10.213.77.66", b"hostA-status-y2", b"2.718281828", b"run-marker-q9",
             b"hetseq/job", b"hetseq/who", b"hetseq/status", str(os.getpid()).encode(),
             socket.gethostname().encode(), who.encode()]
    assert [text for text in plain if text in wire] == []


def test_the_launcher_hands_every_node_and_the_viewer_one_minted_job_id():
    """hetseq-launch mints 128 random bits per job and ends every node's URL
    with them, elastic or not, so that each job has a salt of its own; the
    URL it prints for hetseq-status is the same, and the meeting point
    itself (its summary, --check) stays tcp://HOST:PORT."""
    from machinery.settings import TOY
    from hetseq.launch import hostfile, commands
    ids = {commands.new_job_id() for _ in range(64)}
    assert len(ids) == 64 and all(len(i) == 32 and job_secret.JOB_ID.fullmatch(i) for i in ids)
    for more in ([], ["--elastic", "--global-batch-size", "48"]):
        job = commands.make(hostfile.parse("nodeA slots=2\nnodeB slots=1\n"), "train.py",
                        [*TOY, *more], 29500, job_id="5be0c2d94e1f")
        assert job.url == "tcp://nodeA:29500"
        assert job.node_url == "tcp://nodeA:29500/5be0c2d94e1f"
        for node in job.nodes:
            given = node.argv[node.argv.index("--distributed-init-method") + 1]
            assert given == job.node_url, node.argv
            assert job_secret.job_id(given) == "id 5be0c2d94e1f"


@pytest.mark.parametrize("secret", [None, SECRET])
def test_the_store_listens_only_on_the_jobs_address(secret):
    """127.0.0.2 is this host too (all of 127/8 is loopback): a store that
    listened on every address would answer there."""
    url, _ = serve(None if secret is None else key(secret))
    port = int(url.rsplit(":", 1)[1])
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5)


def test_secrets_are_read_from_a_private_file_or_the_variable(tmp_path):
    assert key(SECRET) == key(f"  {SECRET}\n") != key(OTHER)
    assert job_secret.read_secret(None, {}) is None
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    assert job_secret.read_secret(str(path), {}) == key(SECRET)
    path.chmod(0o644)
    with pytest.raises(UserError, match=f"chmod 600 {path}"):
        job_secret.read_secret(str(path), {})
    with pytest.raises(UserError, match="No such file"):
        job_secret.read_secret(str(tmp_path / "missing"), {})


@pytest.mark.parametrize("text, why", [
    ("", "set but empty: unset it"), (" \t\n", "set but empty: unset it"),
    ("5f0c1d2e3b4a6978", "16 characters, about 64 bits"),        # hex: 4 bits each
    ("Zq8-x_Lm3Rt9Vb2Kp7", "18 characters, about 108 bits"),     # base64: 6 bits each
    ("a" * 32, "only 1 different characters"),
    ("0123456789abcdef0000000000000000", "repeats 8 times in a row"),
    ("0101010101010101010101010101010101010101", "only 2 different characters"),
    ("passwordpasswordpassword", "only 7 different characters"),
    ("correcthorsebatterystaple", "reads as words"),
    ("hetseq-job-secret-2024", "is words"),
    ("correct horse battery staple", "spaces or punctuation"),
    ("hetseq-job-secret-2024!", "spaces or punctuation"),
    ("Password1Password1Password1", "a shorter part repeated"),
    ("0123456789abcdef0123456789abcdef", "counts up for 8 characters"),
    ("1234567890" * 4, "counts up for 8 characters"),
    ("e3b0c44298fc1c149876543210afbf4c", "counts down for 8 characters"),
    ("31415926535897932384626433832795", "32 characters, about 106 bits as digits"),
])
def test_a_secret_that_could_be_guessed_is_refused_with_the_command_that_makes_one(text, why):
    with pytest.raises(UserError) as err:
        key(text)
    message = str(err.value)
    # The reason given, not the rule that follows it (which names every shape).
    reason = message.split("could be guessed (", 1)[-1].split("); ", 1)[0]
    assert why in reason and "hetseq-secret" in message, message
    assert message.startswith(job_secret.SECRET_VARIABLE) and "\n" not in message, message


@pytest.mark.parametrize("text, why", [
    ("CorrectHorseBatteryStaple", "reads as words"),
    ("mysecretpasswordforthejob2024", "reads as words"),
    ("My-Job-Secret-For-Bert-2024", "is words"),
    ("passwordpasswordpassword1", "repeats parts of itself"),
    ("ThisIsMyVerySecretPassword", "reads as words"),
    ("Summer2024Summer2025Summer2026", "repeats parts of itself"),
    ("ZYXWVUTSRQPONMLKJIHGFEDCBA", "counts down"),
    ("1qaz2wsx3edc4rfv5tgb6yhn", "walks the keyboard"),
    ("HETSEQ_PROD_JOB_SECRET_2024", "is words"),
    ("".join(f"{n:08d}" for n in range(1, 9)), "repeats parts of itself"),
    (str(uuid.UUID("c232ab00-9414-11ec-b3c8-9f6bdeced846")), "version-1 UUID"),   # uuid1
    (str(uuid.uuid3(uuid.NAMESPACE_DNS, "hetseq")), "version-3 UUID"),
    # Issue 58: typed input under an encoding, and hexspeak.
    (base64.b64encode(b"the job secret of our bert run").decode(), "base64 of printable text"),
    # SECRET=$(date +%s | sha256sum | base64 | head -c 32): fell in 121 guesses
    (base64.b64encode(b"%s  -\n" % hashlib.sha256(b"1718000000\n").hexdigest().encode())
     .decode()[:32], "base64 of printable text"),
    (base64.b32encode(b"correct horse battery").decode(), "base32 of printable text"),
    ("68657473657120746573742073656372657421", "hex of printable text"),
    (bytes(range(32)).hex(), "decoded as hex, count up, down or stand still"),
    (bytes(range(255, 223, -1)).hex().upper(), "decoded as hex, count up, down"),
    (base64.b64encode(bytes(range(100, 132))).decode(), "decoded as base64, count up"),
    ("9d41e07b5c3a86f2" + "ab" * 8 + "e1b0d4c7a5f93e28", "decoded as hex, count up, down or "
                                                         "stand still"),
    ("c0ffeec0de5afedecafbadfacefeed00", "hexspeak"),
    ("DECAFBAD5EED1E55C0DEBABE7AB1E5AD", "hexspeak"),
])
def test_typed_secrets_that_look_long_are_refused(text, why):
    """What people type when asked for a long secret: words, a keyboard walk,
    counting, repeated parts, and UUIDs that are not random (a uuid1 is a
    time and a MAC address)."""
    assert why in (job_secret.weakness(text.encode()) or ""), job_secret.weakness(text.encode())


def _wrapped(text, width):
    return "\n".join(text[i:i + width] for i in range(0, len(text), width)) + "\n"


GENERATORS = {       # what each prints, from 32 random bytes (and a random source for pwgen)
    "hetseq-secret, openssl rand -hex 32": lambda raw, _: raw.hex(),
    "openssl rand -hex 16": lambda raw, _: raw[:16].hex(),
    "secrets.token_urlsafe(16)": lambda raw, _: base64.urlsafe_b64encode(raw[:16])
    .rstrip(b"=").decode(),
    "openssl rand -base64 32": lambda raw, _: base64.b64encode(raw).decode(),
    "openssl rand -base64 64": lambda raw, d: _wrapped(
        base64.b64encode(raw + d.randbytes(32)).decode(), 64),
    "head -c 32 /dev/urandom | xxd -p": lambda raw, _: _wrapped(raw.hex(), 60),
    "uuidgen (uuid4)": lambda raw, _: str(uuid.UUID(bytes=raw[:16], version=4)),
    "pwgen -s 24": lambda _, d: "".join(d.choice(ALNUM) for _ in range(24)),
    "base32 of 16 bytes": lambda raw, _: base64.b32encode(raw[:16]).decode(),
    "uuid4().hex": lambda raw, _: uuid.UUID(bytes=raw[:16], version=4).hex,
}


ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"


def time_based_ids(now_ms):
    """A uuid7 and a ULID made at ``now_ms``, their random parts drawn:
    each is a time and fewer random bits than a secret needs."""
    draw = random.Random(now_ms)
    tail = draw.getrandbits(62)
    uuid7 = (now_ms << 80) | (7 << 76) | (draw.getrandbits(12) << 64) | (2 << 62) | tail
    ulid, value = "", (now_ms << 80) | draw.getrandbits(80)
    for _ in range(26):
        ulid, value = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"[value & 31] + ulid, value >> 5
    return {"uuid7().hex": (uuid.UUID(int=uuid7).hex, "version-7 UUID without its dashes"),
            "str(uuid7())": (str(uuid.UUID(int=uuid7)), "version-7 UUID"),
            "ULID": (ulid, "a ULID"), "ulid, lower case": (ulid.lower(), "a ULID")}


def test_time_based_ids_are_refused_and_old_or_future_times_are_drawn_hex():
    """uuid7 and ULID hold a time and 74 or 80 random bits: ids made now
    are refused. The same layouts with a time decades away are
    what drawn text looks like now and then, and pass."""
    now_ms = int(time.time() * 1000)
    for name, (text, why) in time_based_ids(now_ms).items():
        assert why in (job_secret.weakness(text.encode()) or ""), (name, text)
    for name, (text, _) in time_based_ids(now_ms - 20 * 365 * 86400 * 1000).items():
        if "-" not in text:
            assert job_secret.weakness(text.encode()) is None, (name, text)


@pytest.mark.parametrize("name", GENERATORS)
def test_20000_draws_of_each_common_generator_are_never_refused(name):
    """The rules refuse typed shapes, never what a generator prints: its
    lines joined (openssl and xxd wrap), a uuid4 counted at its 122 bits."""
    draw = random.Random(name)
    for _ in range(20000):
        made = GENERATORS[name](draw.randbytes(32), draw)
        text = job_secret.joined_lines(made.encode())
        assert job_secret.weakness(text) is None, (made, job_secret.weakness(text))


def test_generator_output_that_spans_lines_is_one_secret(tmp_path):
    """openssl rand -base64 64 prints two lines: the file and the variable
    holding them give the key of the same text on one line."""
    one_line = base64.b64encode(hashlib.sha512(b"drawn").digest()).decode()
    assert job_secret.joined_lines(_wrapped(one_line, 64).encode()) == one_line.encode()
    path = tmp_path / "secret"
    path.write_text(_wrapped(one_line, 64))
    path.chmod(0o600)
    assert job_secret.read_secret(str(path), {}) == key(one_line) == key(_wrapped(one_line, 64))
    with pytest.raises(UserError, match="spaces or punctuation"):
        key("correct horse\nbattery staple")       # blanks inside a line stay


def test_the_key_is_memory_hard_and_salted_with_the_job_id():
    """A recorded handshake must cost a guesser scrypt (N=2^15, r=8: 32 MiB)
    per guess, with the job id as salt: the /JOB_ID of the URL, else its
    port. Each end uses its own: a client of another job id is refused
    like one of another secret, and the message names both causes."""
    import hashlib
    plain = key(SECRET)
    digest = hashlib.sha256(b"hetseq job secret\0" + SECRET.encode()).digest()
    assert plain.key() == hashlib.scrypt(digest, salt=b"hetseq job key\0" + plain.salt,
                                         n=1 << 15, r=8, p=1, maxmem=64 << 20, dklen=32)
    job_a, job_b = plain.for_url("tcp://h:1/a1"), plain.for_url("tcp://other:1/a1")
    assert job_a == job_b and job_a.key() == job_b.key()       # the id, not the host
    by_port = [plain.for_url(url) for url in ("tcp://h:29500", "tcp://10.0.0.2:29500/",
                                              "tcp://h:29501", "tcp://h:29500/29500")]
    assert by_port[0] == by_port[1] and len({plain.key(), job_a.key(),
                                             *(s.key() for s in by_port[1:])}) == 5
    assert "JobSecret(<elided>)" == repr(job_a)
    _, _, client, server = handshake_pair(key(SECRET).for_url("tcp://x:9/a1"), job_a)
    assert keyed_alike(client[0], server[1])
    _, _, client, server = handshake_pair(plain.for_url("tcp://h:1/a2"), job_a)
    assert isinstance(client, channel.Refused) and isinstance(server, channel.Refused)
    assert "its secret differs from this node's, or its job id does (this node has job id " \
        "a2)" in str(client), client
    for url in ("tcp://h:1/a b", "tcp://h:1/a/b", "tcp://h:1/a?b", "tcp://h:1/" + "a" * 129):
        with pytest.raises(UserError, match="is not a job id; expected tcp://HOST:PORT or "
                                            "tcp://HOST:PORT/JOB_ID"):
            job_secret.read_secret(None, {job_secret.SECRET_VARIABLE: SECRET}, url)


def test_a_fake_listener_cannot_choose_the_salt(monkeypatch):
    """A fake service at the meeting point's URL (a typo, a squatter)
    greets as a gate would, with the salt of the table it made in advance
    where the old greeting had one: the client stretches only with the salt
    of its own job id, so the proof it sends is keyed by that salt alone."""
    stretched = []
    real = job_secret.stretch
    monkeypatch.setattr(job_secret, "stretch",
                        lambda digest, salt: stretched.append(salt) or real(digest, salt))
    victim = key(SECRET).for_url("tcp://meeting:29500/job7")
    table_salt, nonce = bytes(range(16)), b"\1" * channel.NONCE
    client, fake = socket.socketpair()
    with client, fake:
        # The old greeting: magic, the listener's salt, its nonce; then "NO".
        fake.sendall(channel.MAGIC + table_salt + nonce + b"NO")
        with pytest.raises(channel.Refused, match="its secret differs"):
            channel.handshake_as_client(client, victim, time.monotonic() + 5)
        fake.settimeout(5)
        seen = channel._recv_exact(fake, channel.NONCE + channel.TAG)
    assert set(stretched) == {job_secret.job_salt("id job7")}, stretched
    # The proof the fake service got is keyed by the victim's own salt: the
    # listener's bytes were read as its nonce, nothing more.
    nc, proof = seen[:channel.NONCE], seen[channel.NONCE:]
    read_as_nonce = (table_salt + nonce)[:channel.NONCE]
    assert proof == channel._mac(victim.key(), b"client", read_as_nonce, nc)


def test_the_gate_never_stretches_what_a_client_sends(monkeypatch):
    """scrypt takes 32 MiB a call: the gate stretches only with the salt it
    derived itself (once, when it opens), never with bytes a client sends,
    whatever the client sends before or instead of its proof."""
    stretched = []
    real = job_secret.stretch
    monkeypatch.setattr(job_secret, "stretch",
                        lambda digest, salt: stretched.append(salt) or real(digest, salt))
    own = key(SECRET).for_job("id gate")
    url, _ = serve(own)
    port = int(url.rsplit(":", 1)[1])
    for sent in (os.urandom(channel.NONCE + channel.TAG), bytes(16) + os.urandom(64),
                 b"\xff" * 4096):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            channel._recv_exact(sock, len(channel.MAGIC) + channel.NONCE)
            sock.sendall(sent)
            sock.settimeout(5)
            assert sock.recv(16) in (b"NO", b"")
    join(url, own).set("member", "in")
    assert set(stretched) == {own.salt}, stretched


def test_a_drawn_secret_the_rule_refuses_is_drawn_again(monkeypatch):
    """About one 256-bit draw in five million holds 8 equal digits in a row,
    which the rule refuses (a suite run once drew c00000000 98b4...):
    hetseq-secret and hetseq-launch never hand out what read_secret refuses."""
    draws = iter(["c0000000098b4e5cc512b9072e315b141557ef2dab019f2863c988c7b2c393d6",
                  "9d41e07b5c3a86f2e1b0d4c7a5f93e2861d0b7c4f5a3e9d2b6c8a0f1e47d3b95"])
    monkeypatch.setattr(secret.secrets, "token_hex", lambda n: next(draws))
    made = secret.make()
    assert made.startswith("9d41e07b") and key(made) is not None


def test_the_secret_file_is_checked_on_what_was_opened(tmp_path, monkeypatch):
    """Opened once without following a link; mode, owner and type come from
    that descriptor (fstat), not from a stat of the path before opening."""
    path = tmp_path / "secret"
    path.write_text(SECRET)
    path.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(UserError, match="symbolic link; give the file itself"):
        job_secret.read_secret(str(link), {})
    os.mkfifo(tmp_path / "fifo", 0o600)    # would block a plain open
    with pytest.raises(UserError, match="not a regular file"):
        job_secret.read_secret(str(tmp_path / "fifo"), {})
    big = tmp_path / "big"
    big.write_text(SECRET * 200)
    big.chmod(0o600)
    with pytest.raises(UserError, match="larger than 4096 bytes"):
        job_secret.read_secret(str(big), {})
    with monkeypatch.context() as patched:      # checked on the descriptor, not the path
        patched.setattr(os, "stat", lambda *a, **k: pytest.fail("stat by path"))
        assert job_secret.read_secret(str(path), {}) == key(SECRET)
    path.chmod(0o640)
    with pytest.raises(UserError, match="readable by others"):
        job_secret.read_secret(str(path), {})
    empty = tmp_path / "empty"
    empty.write_text("\n")
    empty.chmod(0o600)
    with pytest.raises(UserError, match="it is empty"):
        job_secret.read_secret(str(empty), {})


def test_a_secret_needs_a_tcp_meeting_point(tmp_path):
    with pytest.raises(UserError, match="needs a tcp:// meeting point"):
        meeting_point.open_store(f"file://{tmp_path / 'meet'}", 0, 2, TIMEOUT,
                              access=meeting_point.Access(key(SECRET)))


@pytest.mark.parametrize("text, why", [
    ("00000000-0000-4000-8000-000000000000", "different characters"),
    ("aaaaaaaa-aaaa-4aaa-aaaa-aaaaaaaaaaaa", "different characters"),
    ("12345678-1234-4234-1234-123456789abc", "counts up"),
    (uuid.uuid1().hex, "version-1 UUID without its dashes"),
    (uuid.uuid1().hex.upper(), "version-1 UUID without its dashes"),
    (str(uuid.uuid1()) + "\n" + str(uuid.uuid1()) + "\n", "version-1 UUID"),
    (base64.b32encode(bytes(range(50, 61))).decode(), "about 90 bits as base32"),
    (base64.b32encode(bytes(range(50, 63))).decode(), "about 105 bits as base32"),
    (base64.b64encode(bytes(range(50, 63))).decode(), "about 108 bits as base64"),
], ids=["uuid4-zeros", "uuid4-as", "uuid4-counting", "uuid1-hex", "uuid1-hex-upper",
        "two-uuid1-lines", "base32-88-bits", "base32-104-bits", "base64-104-bits"])
def test_uuids_typed_or_undashed_and_padding_hold_no_bits(text, why):
    """A uuid4's shape says nothing of its digits (they are checked as any
    secret's); a uuid1 is refused undashed and among other lines; the '='
    of base32 and base64 padding holds no bits."""
    weak = job_secret.weakness(job_secret.joined_lines(text.encode()))
    assert weak is not None and why in weak, weak


def test_a_secret_variable_that_is_not_utf8_is_one_line():
    variable = "\udcff\udcfe" + "0123456789abcdef" * 2      # os.environ's surrogates
    try:
        job_secret.secret_text(None, {job_secret.SECRET_VARIABLE: variable})
    except UserError as err:
        assert "spaces or punctuation" in str(err), err
    except Exception as err:             # the traceback a user would have seen
        pytest.fail(f"a variable that is not UTF-8 raised {err!r}, not one line")
    else:
        pytest.fail("a secret with bytes no generator prints was accepted")
