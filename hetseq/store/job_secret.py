"""The job secret: where it is read from, what it must look like, and the
key the handshake (channel.py) derives from it. A recorded handshake lets
anyone test guesses of the secret offline, so the key is memory-hard to
derive (scrypt, salted with the job's identity) and only secrets that look
generated are accepted. docs/security.md, "Who is kept out", gives the
rules and the cost of a guess.
"""

import collections
import functools
import hashlib
import json
import math
import os
import re
import time

from hetseq.errors import UserError
from hetseq.owned_file import read_owned

SECRET_VARIABLE = "HETSEQ_JOB_SECRET"
MAKE_ONE = "hetseq-secret"   # hetseq/store/secret.py; also python -m hetseq.store.secret
MAX_FILE = 4096

# --- the key --------------------------------------------------------------------

SALT = 16
SCRYPT = {"n": 1 << 15, "r": 8, "p": 1, "maxmem": 64 << 20, "dklen": 32}
NO_JOB = b"\0" * SALT        # the salt of a secret read without a job (tests, hetseq-status)
KEYS_KEPT = 8                # salts a process keeps keys for: a hostile gate may send any


class JobSecret:
    """The secret as the handshake uses it: a digest of its text (the text
    itself is not kept) and this job's ``salt``; ``key(salt)`` stretches
    the digest for a salt (the gate's, read in its greeting). Its repr and
    pickle never show the digest's bytes in a log; a pickle (an elastic
    node's other processes) carries the keys already derived."""

    def __init__(self, digest, salt=NO_JOB):
        self._digest, self.salt, self._keys = digest, salt, {}

    def key(self, salt=None):
        salt = self.salt if salt is None else salt
        if salt not in self._keys:
            if len(self._keys) >= KEYS_KEPT:
                self._keys.clear()
            self._keys[salt] = stretch(self._digest, salt)
        return self._keys[salt]

    def for_job(self, identity):
        """The same secret salted with the job's identity (its flags and
        code: JobConfig.identity()); None leaves it as it is."""
        if identity is None:
            return self
        salt = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).digest()[:SALT]
        job = JobSecret(self._digest, salt)
        job._keys = self._keys
        return job

    def __eq__(self, other):
        return isinstance(other, JobSecret) and (self._digest, self.salt) == (other._digest,
                                                                              other.salt)

    def __hash__(self):
        return hash((self._digest, self.salt))

    def __repr__(self):
        return "JobSecret(<elided>)"


@functools.lru_cache(maxsize=KEYS_KEPT)
def stretch(digest, salt):
    """scrypt of the secret's digest: what an offline guess must compute."""
    return hashlib.scrypt(digest, salt=b"hetseq job key\0" + salt, **SCRYPT)


def read_secret(path, env=os.environ, identity=None):
    """The job secret (a JobSecret salted with ``identity``), from
    --job-secret-file (a file only its owner can read) or HETSEQ_JOB_SECRET;
    None when neither is given."""
    text = secret_text(path, env)
    if text is None:
        return None
    return JobSecret(hashlib.sha256(b"hetseq job secret\0" + text).digest()).for_job(identity)


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


# --- what a secret must look like ---------------------------------------------------

# NIST's floor for a symmetric key (SP 800-131A), before scrypt's cost: a
# base64 string of 128 random bits that happens to hold only lowercase
# letters and digits counts 114.
MIN_BITS = 112
MIN_DISTINCT = 8
MAX_RUN = 8
# The alphabets generators print, smallest first, and the bits a character
# of each holds: a secret counts those of the smallest that holds it all.
ALPHABETS = [(name, frozenset(chars.encode()), bits) for name, chars, bits in (
    ("digits", "0123456789", math.log2(10)),
    ("hex", "0123456789abcdef", 4),
    ("hex", "0123456789ABCDEF", 4),
    ("base32", "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567=", 5),
    ("lowercase and digits", "abcdefghijklmnopqrstuvwxyz0123456789", math.log2(36)),
    ("letters and digits",
     "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789", math.log2(62)),
    # (standard and URL-safe base64, and its padding)
    ("base64", "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_", 6),
)]
UUID = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-([0-9a-fA-F])[0-9a-fA-F]{3}-"
                  rb"[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
UUID4_BITS = 122
# Typed words: tokens of letters (a capital starts one), no two capitals in
# a row, 12 letters or more, 3.5 letters a token on average, and letters
# that read as English (ENGLISH_BITS per letter more likely under English
# letter pairs than drawn at random). A drawn base64 or alphanumeric string
# of 128 bits passes all four about once in a million; a random string of
# lowercase letters and digits about once in 20,000.
TOKEN = re.compile(rb"[A-Z]?[a-z]+|[A-Z]+")
MIN_LETTERS = 12
TOKEN_LETTERS = 3.5
ENGLISH_BITS = 0.3
WORD_PART = re.compile(rb"[A-Z]?[a-z]+|[A-Z]+|[0-9]+")   # a word as typed, or a number
REPEATS_SAVE = 32
KEYBOARD = ("1234567890-=", "qwertyuiop[]", "asdfghjkl;'", "zxcvbnm,./")
WALKED = 0.75
RULE = (f"a secret needs {MIN_BITS} bits counted as a generator would print them (4 a "
        "character for hex, 6 for base64, 122 for a uuid4), "
        f"{MIN_DISTINCT} different characters, and nothing typed: no words, no keyboard walk, "
        f"no character {MAX_RUN} times in a row, no counting run, no repeated part")


def weakness(text):
    """Why the secret ``text`` (bytes, its lines joined) could be guessed,
    or None."""
    if not text:
        return "it is empty"
    for match in UUID.finditer(text):        # two uuid1s on two lines are no uuid4
        if match.group(1) != b"4":
            return _uuid_weakness(match.group(0))
    if UUID.fullmatch(text):                 # a uuid4's digits, typed or drawn
        return _uuid_weakness(text) or _shape(text.replace(b"-", b""), ALPHABETS[1])
    if _time_uuid(text):
        return ("it is a version-1 UUID without its dashes (uuid1().hex: a time and the "
                "machine's address), not a random one")
    alphabet = next((a for a in ALPHABETS if set(text) <= a[1]), None)
    if alphabet is None:
        return ("it has spaces or punctuation that generators do not print (typed words? a "
                "password manager's symbols: turn them off, or use hetseq-secret)")
    counted = len(text.rstrip(b"="))          # padding holds no bits
    bits = round(counted * alphabet[2])
    if bits < MIN_BITS:
        return f"it has {counted} characters, about {bits} bits as {alphabet[0]}"
    return _shape(text, alphabet)


def _shape(text, alphabet):
    """The first typed shape ``text`` has (SHAPES), or None."""
    for check in SHAPES:
        why = check(text, alphabet)
        if why is not None:
            return why
    return None


# 100-ns intervals from the Gregorian calendar's start to 1970; a uuid1 is
# made when it is used: a time within UUID1_YEARS before now, or just after.
UUID1_EPOCH = 0x01B21DD213814000
UUID1_YEARS = 2


def _time_uuid(text):
    """Whether 32 hex digits are a uuid1 without dashes: version 1, the
    variant's bits, and a time of the last UUID1_YEARS. Drawn hex looks so
    about once in 10^5 (1/16 * 1/4 * 2 years of the 3,655 a uuid1 spans)."""
    if len(text) != 32 or not set(text.lower()) <= ALPHABETS[1][1]:
        return False
    digits = text.lower().decode()
    if digits[12] != "1" or digits[16] not in "89ab":
        return False
    ticks = (int(digits[13:16], 16) << 48) | (int(digits[8:12], 16) << 32) | int(digits[:8], 16)
    made, now = (ticks - UUID1_EPOCH) / 1e7, time.time()
    return now - UUID1_YEARS * 365.25 * 86400 <= made <= now + 86400


def _uuid_weakness(text):
    version = text[14:15].decode()
    if version != "4":
        return (f"it is a version-{version} UUID, not a random one (uuid1 holds a time and the "
                "machine's address); a uuid4 holds only 122 random bits")
    return None if UUID4_BITS >= MIN_BITS else f"a uuid4 holds {UUID4_BITS} random bits"


def _few_characters(text, _):
    if len(set(text)) < MIN_DISTINCT:
        return f"it uses only {len(set(text))} different characters"


def _runs(text, _):
    if any(text[i:i + MAX_RUN] == text[i:i + 1] * MAX_RUN for i in range(len(text))):
        return f"a character repeats {MAX_RUN} times in a row"


def _counting(text, _):
    steps = bytes((b - a) & 0xFF for a, b in zip(text, text[1:]))
    for step, way in ((1, "up"), (0xFF, "down")):
        if bytes([step]) * (MAX_RUN - 1) in steps:
            return f"it counts {way} for {MAX_RUN} characters (like 12345678 or ZYXWVUTS)"


def _repeated(text, alphabet):
    if any(text == (text[:k] * (len(text) // k + 1))[:len(text)]
           for k in range(1, len(text) // 2 + 1)):
        return "it is a shorter part repeated"
    each = alphabet[2]
    bits = _bits_after_repeats(text, each)
    # (A drawn string may repeat 4 characters once: that costs it a few bits.)
    if bits < MIN_BITS and len(text) * each - bits >= REPEATS_SAVE:
        return (f"it repeats parts of itself (like Summer2024Summer2025): about {bits:.0f} bits "
                "once they are counted once")


def _bits_after_repeats(text, bits_each):
    """Bits left when every repeat of 4 or more characters costs only where
    it comes from and its length (a greedy LZ77 parse), counted up to
    MIN_BITS: generated text almost never repeats 4 characters, typed text
    does."""
    at, bits = 0, 0.0
    while at < len(text) and bits < MIN_BITS:      # (more text only adds bits)
        longest = 3       # the longest part from ``at`` on seen before (it may overlap)
        while at + longest < len(text) and \
                text.find(text[at:at + longest + 1], 0, at + longest) >= 0:
            longest += 1
        if longest >= 4:            # where from, and a short length
            bits, at = bits + math.log2(at) + 2, at + longest
        else:
            bits, at = bits + bits_each, at + 1
    return bits


def _words(text, alphabet):
    if alphabet[0] in ("digits", "hex"):    # a-f make few words, and hex is drawn often
        return None
    parts = re.split(rb"[-_]", text)
    if len(parts) >= 3 and all(WORD_PART.fullmatch(part) for part in parts):
        return "it is words (like my-job-secret-2024)"
    tokens = TOKEN.findall(text)
    letters = sum(map(len, tokens))
    if re.search(rb"[A-Z][A-Z]", text) or letters < MIN_LETTERS or \
            letters < TOKEN_LETTERS * len(tokens):
        return None
    if _english_bits(text) >= ENGLISH_BITS * letters:
        return "it reads as words (like CorrectHorseBatteryStaple or mysecretpassword2024)"


def _english_bits(text):
    """How many bits more likely the letters of ``text`` (case folded, runs
    of letters) are under English letter pairs than drawn uniformly."""
    start, pairs = _english()
    total = 0.0
    for run in re.findall(rb"[a-z]+", text.lower()):
        total += start[run[0]] + sum(pairs[a, b] for a, b in zip(run, run[1:]))
    return total


@functools.lru_cache(maxsize=1)
def _english():
    """Letter-pair log-odds against uniform, from the English of Python's own
    documentation (pydoc_data, in the standard library; built once): the
    first letter of a word, and each next letter across word boundaries."""
    from pydoc_data.topics import topics
    words = re.findall(rb"[a-z]+", " ".join(topics.values()).lower().encode())
    stream = b"".join(words)
    firsts = collections.Counter(w[0] for w in words)
    pairs = collections.Counter(zip(stream, stream[1:]))
    after = collections.Counter(stream[:-1])
    letters = range(ord("a"), ord("z") + 1)
    uniform = math.log2(26)     # add-1/2 smoothing: a pair never seen is rare, not impossible
    start = {a: math.log2((firsts[a] + 0.5) / (len(words) + 13)) + uniform for a in letters}
    odds = {(a, b): math.log2((pairs[a, b] + 0.5) / (after[a] + 13)) + uniform
            for a in letters for b in letters}
    return start, odds


def _keyboard_walk(text, _):
    """Most of ``text`` in runs of 3 or more keys, each next to the last."""
    places = [KEYS.get(c) for c in text.lower()]
    covered = run = 0
    for a, b in zip(places, places[1:]):
        if a is not None and b is not None and (a[0] - b[0], a[1] - b[1]) in NEXT_TO:
            run += 1
            continue
        covered += run + 1 if run >= 2 else 0
        run = 0
    covered += run + 1 if run >= 2 else 0
    if covered >= WALKED * len(text):
        return "it walks the keyboard (like 1qaz2wsx3edc)"


# Keys next to each other on a staggered keyboard: (row, column) differences.
NEXT_TO = {(0, 1), (0, -1), (1, 0), (-1, 0), (1, -1), (-1, 1)}
KEYS = {ord(c): (row, col) for row, line in enumerate(KEYBOARD) for col, c in enumerate(line)}

SHAPES = (_few_characters, _runs, _counting, _repeated, _words, _keyboard_walk)
