"""The job secret: where it is read from, its job id, and the key the
handshake (channel.py) derives from it. A recorded handshake lets anyone
test guesses of the secret offline, so the key is memory-hard to derive
(scrypt) and only secrets that look generated are accepted (the rules:
secret_rules.py). The salt is the job id each node was told (``job_id``):
never one sent by the other end, so a fake service cannot make every
victim stretch the secret with the salt of its one precomputed table.
docs/security.md, "Who is kept out", gives the rules and a guess's cost.
"""

import functools
import hashlib
import os
import re
import urllib.parse

from hetseq.base.errors import UserError
from hetseq.base.owned_file import read_owned
from hetseq.store import cipher
from hetseq.store.secret_rules import RULE, weakness  # (weakness: also read from here)

SECRET_VARIABLE = "HETSEQ_JOB_SECRET"
MAKE_ONE = "hetseq-secret"   # hetseq/store/secret.py; also python -m hetseq.store.secret
MAX_FILE = 4096

# --- the key --------------------------------------------------------------------

SALT = 16
SCRYPT = {"n": 1 << 15, "r": 8, "p": 1, "maxmem": 64 << 20, "dklen": 32}
NO_JOB = b"\0" * SALT        # the salt of a secret read without a meeting point (tests)
KEYS_KEPT = 8                # stretched keys a process keeps (its jobs: one, tests: a few)
# A job id as the /JOB_ID of tcp://HOST:PORT/JOB_ID: one path segment of
# characters a URL carries as they are (hetseq-launch mints 32 hex digits).
JOB_ID = re.compile(r"[A-Za-z0-9._~-]{1,128}")


class JobSecret:
    """The secret as the handshake uses it: a digest of its text (the text
    itself is not kept) and the salt of one job id (``job``: "id X" or
    "port N", the words messages use; None: no meeting point). ``key()``
    stretches the digest with that salt only: both ends of a handshake use
    their own, so neither can be made to stretch with the other's. Its repr
    and pickle never show the digest's bytes in a log; a pickle (an elastic
    node's other processes) carries the key already derived."""

    def __init__(self, digest, job=None):
        self._digest, self.job, self._key = digest, job, None
        self.salt = NO_JOB if job is None else job_salt(job)

    def key(self):
        if self._key is None:
            self._key = stretch(self._digest, self.salt)
        return self._key

    def for_job(self, job):
        """The same secret salted with ``job`` (``job_id``'s words); the key
        already derived is kept when the salt is the same."""
        salted = JobSecret(self._digest, job)
        if salted.salt == self.salt:
            salted._key = self._key
        return salted

    def for_url(self, url, env=os.environ):
        """The same secret salted with the job id of meeting point ``url``."""
        return self.for_job(job_id(url, env))

    def __eq__(self, other):
        return isinstance(other, JobSecret) and (self._digest, self.salt) == (other._digest,
                                                                              other.salt)

    def __hash__(self):
        return hash((self._digest, self.salt))

    def __repr__(self):
        return "JobSecret(<elided>)"


def job_salt(job):
    """The salt of job id ``job`` (``job_id``'s words: "id X", "port N")."""
    return hashlib.sha256(b"hetseq job id\0" + job.encode()).digest()[:SALT]


def job_id(url, env=os.environ):
    """The job id that salts the key, from the meeting point's URL as this
    node was told it: "id X" for tcp://HOST:PORT/X (hetseq-launch mints X
    and hands it to every node and to hetseq-status in the URL), else "port
    N", the URL's port (env://: MASTER_PORT), which every node of a job is
    told, elastic members that join through another member's address
    included. Never the job's flags: a node whose flags differ must pass
    the handshake to be told which flag differs. None without a URL. An X
    that is no job id is a UserError naming it."""
    if url is None:
        return None
    if url.startswith("env://"):
        return f"port {env.get('MASTER_PORT', '')}"
    if not url.startswith("tcp://"):
        return None          # file://: no handshake (a secret with it is refused)
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:     # tcp://[::1: meeting_point names what is wrong with it
        return f"port {url.rpartition(':')[2]}"
    given = parts.path[1:] if parts.path.startswith("/") else parts.path
    if given or parts.query or parts.fragment:
        if parts.query or parts.fragment or not JOB_ID.fullmatch(given):
            raise UserError(f"{url}: {url[len('tcp://') + len(parts.netloc):]!r} is not a job "
                            "id; expected tcp://HOST:PORT or tcp://HOST:PORT/JOB_ID, a JOB_ID of "
                            "1 to 128 letters, digits, '.', '_', '~' or '-' (hetseq-launch mints "
                            "one and prints the URL with it)")
        return f"id {given}"
    return f"port {parts.netloc.rpartition(':')[2]}"


def job_words(job):
    """``job`` as a message names it."""
    if job is None:
        return "no job id (no meeting point)"
    if job.startswith("id "):
        return f"job id {job[3:]}"
    return f"no job id (the URL names none: its {job} stands for one)"


@functools.lru_cache(maxsize=KEYS_KEPT)
def stretch(digest, salt):
    """scrypt of the secret's digest: what an offline guess must compute."""
    return hashlib.scrypt(digest, salt=b"hetseq job key\0" + salt, **SCRYPT)


def read_secret(path, env=os.environ, url=None):
    """The job secret (a JobSecret salted with the job id of meeting point
    ``url``, ``job_id``), from --job-secret-file (a file only its owner can
    read) or HETSEQ_JOB_SECRET; None when neither is given. A secret seals
    the store's frames: without the cipher's package it is a UserError."""
    text = secret_text(path, env)
    if text is None:
        return None
    cipher.aead()
    return JobSecret(hashlib.sha256(b"hetseq job secret\0" + text).digest(),
                     job_id(url, env))


def secret_text(path, env=os.environ):
    """The job secret's text, checked, from --job-secret-file or
    HETSEQ_JOB_SECRET (None when neither is given): for the key above, and
    for hetseq-launch, which hands it to its nodes. Generator output that
    spans lines (openssl rand -base64 64, xxd -p) is one secret: its lines
    are joined."""
    if path is not None:
        where = f"--job-secret-file {path}"
        raw = read_owned(path, where, private=True, limit=MAX_FILE)
    elif SECRET_VARIABLE in env:
        # (fsencode: bytes that are not UTF-8 come back as they were given)
        raw, where = os.fsencode(env[SECRET_VARIABLE]), SECRET_VARIABLE
        if not raw.strip():
            raise UserError(f"{SECRET_VARIABLE} is set but empty: unset it for a job without a "
                            f"secret, or give one made with {MAKE_ONE}")
    else:
        return None
    text = joined_lines(raw)
    why = weakness(text)
    if why is not None:
        raise UserError(f"{where}: the secret could be guessed ({why}); {RULE}. Make one "
                        f"with: {MAKE_ONE} (or python -m hetseq.store.secret)")
    return text


def joined_lines(raw):
    """The lines of ``raw`` without their ends' blanks, joined: a generator
    wraps its output (base64 at 64 or 76 characters, xxd -p at 60), a
    secret file ends with a newline. Blanks inside a line stay (typed words
    are refused as such)."""
    return b"".join(line.strip() for line in raw.splitlines())

