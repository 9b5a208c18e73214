"""The hostfile of ``hetseq-launch``: one line per node, DeepSpeed's form
(``HOST slots=N``) plus that node's own flags (``name=value`` becomes
``--name value``, a bare ``name`` ``--name``), words split as a shell would.
Whether a name is a per-node flag is the plan's question (commands.py asks the
parser); here only the form is checked. docs/nodes.md, "One command".
"""

import dataclasses
import re
import shlex

from hetseq.base.errors import UserError
from hetseq.base.flags import nearest
from hetseq.base.owned_file import read_owned, refuse_unless_owned

# A host as ssh takes it: [user@]name, an IPv4 address or a bracketless IPv6 one.
HOST = re.compile(r"^(?!-)([A-Za-z0-9._-]+@)?[A-Za-z0-9.:_-]+$")
FLAG = re.compile(r"^[a-z][a-z0-9-]*$")
MAX_SLOTS = 1024
MAX_HOSTFILE = 1 << 20   # a hostfile is lines of hosts, not the file expected when larger


@dataclasses.dataclass(frozen=True)
class HostLine:
    host: str
    slots: int
    flags: tuple = ()       # ((name, value or None), ...) as written, in order
    line: int = 0           # its line number, for messages

    def argv(self):
        """The flags as command-line words: ``--name value`` or ``--name``."""
        words = []
        for name, value in self.flags:
            words += [f"--{name}"] if value is None else [f"--{name}", value]
        return words


def parse(text, where="hostfile"):
    """The nodes of a hostfile's ``text``, in order; a malformed line is a
    UserError naming it."""
    nodes = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = _words(raw, number, where)
        if words:
            nodes.append(_node(words, number, where))
    if not nodes:
        raise UserError(f"{where} names no host: write one line per node, e.g. "
                        "'nodeA slots=4 max-sentences=48'")
    return nodes


def _words(raw, number, where):
    """The line's words as a shell splits them, up to a word that starts
    with "#" (read lazily: a comment may hold an apostrophe; "run#1" keeps
    its "#")."""
    lexer = shlex.shlex(raw, posix=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    words = []
    try:
        for word in lexer:
            if word.startswith("#"):
                break
            words.append(word)
    except ValueError as err:
        raise UserError(f"{where} line {number}: {err} in {raw.strip()!r}") from None
    return words


def read(path):
    # Its flags choose code (user-dir=...): only a file no other user can change
    # (nor a folder above it), opened once without following a link and
    # judged on that descriptor: it cannot be swapped after the check.
    refuse_unless_owned(path, "--hostfile")
    try:
        return parse(read_owned(path, f"--hostfile {path}", private=False,
                                limit=MAX_HOSTFILE).decode("utf-8"), path)
    except UnicodeDecodeError:
        raise UserError(f"--hostfile {path}: not UTF-8 text") from None


def _node(words, number, where):
    host, rest = words[0], words[1:]
    if not HOST.match(host):
        raise UserError(f"{where} line {number}: {host!r} is not a host name or address")
    slots, flags = None, []
    for word in rest:
        name, eq, value = word.partition("=")
        if not FLAG.match(name):
            raise UserError(f"{where} line {number}: {word!r}: expected slots=N or a flag "
                            "as name=value (e.g. max-sentences=20) or a bare name (e.g. cpu)")
        if name == "slots":
            slots = _slots(value, number, where)
        else:
            flags.append((name, value if eq else None))
    if slots is None:
        for name, value in flags:           # slot=2: a misspelt slots, named as the flags are
            if nearest(name, ["slots"]):
                written = name if value is None else f"{name}={value}"
                right = "slots" if value is None else f"slots={value}"
                raise UserError(f"{where} line {number}: unknown key {written}: did you mean "
                                f"{right}?")
        raise UserError(f"{where} line {number}: {host} has no slots=N (the ranks it runs: "
                        "its GPUs, or its CPU processes with 'cpu')")
    return HostLine(host, slots, tuple(flags), number)


def _slots(value, number, where):
    if not value.isdigit() or not 1 <= int(value) <= MAX_SLOTS:
        raise UserError(f"{where} line {number}: slots={value}: expected a whole number "
                        f"from 1 to {MAX_SLOTS}")
    return int(value)
