"""The secret's rules: what a job secret must look like to be accepted
(bits counted as a generator prints them, typed shapes such as words,
keyboard walks and repeats, encodings of typed text, time-based ids).
job_secret.py reads the secret and refuses what ``weakness`` names;
docs/security.md, "Who is kept out", gives the rules and why.
"""

import base64
import binascii
import collections
import functools
import math
import re
import time

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
    timed = _time_id(text)
    if timed is not None:
        return timed
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


# 100-ns intervals from the Gregorian calendar's start to 1970; a time-based
# id is made when it is used: a time within ID_YEARS before now, or just after.
UUID1_EPOCH = 0x01B21DD213814000
ID_YEARS = 2
CROCKFORD = "0123456789abcdefghjkmnpqrstvwxyz"      # a ULID's base32, read in either case


def _recent(seconds):
    now = time.time()
    return now - ID_YEARS * 365.25 * 86400 <= seconds <= now + 86400


def _time_id(text):
    """Why ``text`` is a time-based id printed without dashes, or None: a
    uuid1 (a time and the machine's address) or a uuid7 (a time in
    milliseconds and 74 random bits) as 32 hex digits, or a ULID (26
    characters: a time in milliseconds and 80 random bits); each read only
    when its time falls within the last ID_YEARS. Drawn hex looks so about
    once in 10^5 (uuid1: 1/16 * 1/4 * 2 of the 3,655 years it spans) and
    3 * 10^5 (uuid7) strings; a ULID's alphabet and time, once in 10^7
    drawn alphanumeric strings of its length. (A uuid6, a uuid1's time
    reordered, would refuse one drawn hex string in 10^5 more: it passes.)"""
    lower = text.lower()
    if len(text) == 26 and all(c in CROCKFORD.encode() for c in lower):
        ms = 0
        for c in lower[:10]:
            ms = ms * 32 + CROCKFORD.index(chr(c))
        if ms < 1 << 48 and _recent(ms / 1000):
            return "it is a ULID (a time and 80 random bits), not a random secret"
    if len(text) != 32 or not set(lower) <= ALPHABETS[1][1]:
        return None
    digits = lower.decode()
    version = digits[12]
    if digits[16] not in "89ab" or version not in "17":
        return None
    if version == "1":
        ticks = (int(digits[13:16], 16) << 48) | (int(digits[8:12], 16) << 32) | \
            int(digits[:8], 16)
        made = (ticks - UUID1_EPOCH) / 1e7
    else:
        made = int(digits[:12], 16) / 1000
    if not _recent(made):
        return None
    if version == "1":
        return ("it is a version-1 UUID without its dashes (uuid1().hex: a time and the "
                "machine's address), not a random one")
    return ("it is a version-7 UUID without its dashes (a time and 74 random bits), not a "
            "random one")


def _uuid_weakness(text):
    version = text[14:15].decode()
    if version != "4":
        return (f"it is a version-{version} UUID, not a random one (uuid1 holds a time and the "
                "machine's address); a uuid4 holds only 122 random bits")
    return None if UUID4_BITS >= MIN_BITS else f"a uuid4 holds {UUID4_BITS} random bits"


def _few_characters(text, _):
    if len(set(text)) < MIN_DISTINCT:
        return f"it uses only {len(set(text))} different characters"


_RUN = re.compile(rb"(.)\1{%d}" % (MAX_RUN - 1), re.DOTALL)


def _runs(text, _):
    if _RUN.search(text):
        return f"a character repeats {MAX_RUN} times in a row"


def _counting(text, _):
    steps = bytes((b - a) & 0xFF for a, b in zip(text, text[1:]))
    for step, way in ((1, "up"), (0xFF, "down")):
        if bytes([step]) * (MAX_RUN - 1) in steps:
            return f"it counts {way} for {MAX_RUN} characters (like 12345678 or ZYXWVUTS)"


def _repeated(text, alphabet):
    # (Period k: the text shifted by k is itself, a last part cut short allowed.)
    if any(text[k:] == text[:-k] for k in range(1, len(text) // 2 + 1)):
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
def _corpus():
    """The words of Python's own documentation (pydoc_data, in the standard
    library), lower case, as bytes: English that every Python has."""
    from pydoc_data.topics import topics
    return re.findall(rb"[a-z]+", " ".join(topics.values()).lower().encode())


@functools.lru_cache(maxsize=1)
def _english():
    """Letter-pair log-odds against uniform, from the English of Python's own
    documentation (pydoc_data, in the standard library; built once): the
    first letter of a word, and each next letter across word boundaries."""
    words = _corpus()
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

# --- encodings: what a secret decodes to ----------------------------------------

MIN_DECODED = 14          # bytes: shorter decodings say too little to refuse on
TEXT_LETTERS = 0.8        # letters and blanks among digits decoded as hex
DECODED_RUN = 8           # bytes counting up or down by one, or one byte repeated
# (Strides, 0x0f apart say, would refuse no drawn bytes either, but HetSeq's
# own test fixtures hold one: 5f0c1d2e3b4a69788796a5b4c3d2e1f0.)
DECODED_STEPS = (1, 0xFF, 0)


def _decoded(text, alphabet):
    """(the encoding's name, the bytes ``text`` decodes to), or None: hex
    digits as hex, base32's letters as base32, base64's as base64 (its
    longest whole prefix: ``head -c 32`` cuts anywhere)."""
    name = alphabet[0]
    try:
        if name in ("hex", "digits"):        # (hex of lower-case text is often digits only)
            return "hex", bytes.fromhex(text[:len(text) // 2 * 2].decode())
        if name == "base32":
            body = text.rstrip(b"=")
            body = body[:len(body) // 8 * 8]
            return "base32", base64.b32decode(body)
        if name in ("base64", "letters and digits"):
            body = text.rstrip(b"=").replace(b"-", b"+").replace(b"_", b"/")
            return "base64", base64.b64decode(body[:len(body) // 4 * 4], validate=True)
    except (ValueError, binascii.Error):
        return None
    return None


def _printable(data):
    """Whether ``data`` reads as ASCII text: printable characters and blanks.
    Drawn bytes do so 0.38 ** n for n bytes (1 in 800,000 at MIN_DECODED);
    UTF-8 beyond ASCII would take 10 times more of them."""
    return all(32 <= b < 127 or b in b"\t\n\r" for b in data)


def _encoded(text, alphabet):
    """Typed input under an encoding: hex, base32 or base64 of printable
    text (base64 of a sentence; `date | sha256sum | base64`: hex digits
    and a dash), or of bytes that count (bytes(range(32)).hex()). An
    encoding adds no secret."""
    found = _decoded(text, alphabet)
    if found is None or len(found[1]) < MIN_DECODED:
        return None
    name, data = found
    # Decimal digits read as hex are printable 6 bytes in 10: only text of
    # letters and blanks counts (drawn digits make it 4 bytes in 10).
    if _printable(data) and (alphabet[0] != "digits" or sum(
            chr(b).isalpha() or chr(b).isspace() for b in data) >= TEXT_LETTERS * len(data)):
        return (f"it is {name} of printable text (typed words, a date, digits or another "
                "encoding: encoding them adds nothing to guess)")
    steps = bytes((b - a) & 0xFF for a, b in zip(data, data[1:]))
    for step in DECODED_STEPS:
        if bytes([step]) * (DECODED_RUN - 1) in steps:
            return (f"its bytes, decoded as {name}, count up, down or stand still for "
                    f"{DECODED_RUN} bytes (like bytes(range(32)).hex())")
    return None


# Hexspeak: words spelt in hex digits (deadbeef, cafebabe, c0ffee), with
# these digits for letters. Words of HEXSPEAK_MIN letters or more, from the
# English of Python's documentation and the classics, that cover half a hex
# secret or more: drawn hex has about one such word in 1,000 characters.
HEX_DIGITS = frozenset(b"0123456789abcdef")     # o, i, l, s and t spelt 0, 1, 1, 5, 7
HEXSPEAK_MIN = 4
HEXSPEAK_CLASSICS = ("dead beef babe cafe face feed food code coffee decaf bead fade deaf "
                     "baad dood abba added faded facade decade decode accede affect "
                     "effect default")
HEXSPEAK_COVERS = 0.5


@functools.lru_cache(maxsize=1)
def _hexspeak_words():
    """The hexspeak vocabulary, as hex digits, grouped by length (longest first)."""
    spell = bytes.maketrans(b"oilst", b"01157")
    words = set()
    for word in {*_corpus(), *HEXSPEAK_CLASSICS.encode().split()}:
        spelt = word.translate(spell)
        if len(spelt) >= HEXSPEAK_MIN and HEX_DIGITS.issuperset(spelt):
            words.add(spelt)
    lengths = sorted({len(w) for w in words}, reverse=True)
    # The words' first HEXSPEAK_MIN digits: most places of a random draw
    # start no word, and are passed over without trying every length.
    starts = frozenset(w[:HEXSPEAK_MIN] for w in words)
    return starts, [(n, frozenset(w for w in words if len(w) == n)) for n in lengths]


def _hexspeak(text, alphabet):
    if alphabet[0] != "hex":
        return None
    lower, covered, at = text.lower(), 0, 0
    starts, vocabulary = _hexspeak_words()
    needed = HEXSPEAK_COVERS * len(text)
    while at < len(lower) and covered + len(lower) - at >= needed:
        n = 0
        if lower[at:at + HEXSPEAK_MIN] in starts:
            n = next((n for n, words in vocabulary if lower[at:at + n] in words), 0)
        covered, at = covered + n, at + max(n, 1)
    if covered >= needed:
        return "it is hexspeak: words spelt in hex digits (like deadbeefcafebabe)"


SHAPES = (_few_characters, _runs, _counting, _repeated, _words, _keyboard_walk, _encoded,
          _hexspeak)
