"""hetseq-secret: print a new job secret, or write it to a private file.

    export HETSEQ_JOB_SECRET=$(hetseq-secret)          # then the same on every node
    hetseq-secret --file ~/.hetseq/job-secret          # then --job-secret-file PATH

64 hex digits (256 random bits) from the operating system's generator: far
beyond what job_secret.read_secret asks, so that no recorded handshake can be
used to find it by guessing.
"""

import os
import secrets
import sys

from hetseq.base.errors import UserError
from hetseq.base.flags import Parser

BYTES = 32


def make():
    """A new secret that job_secret.weakness accepts: about one draw in five
    million holds a run of 8 equal digits, which the rule refuses in a
    typed secret; it is drawn again (the entropy lost is negligible)."""
    from hetseq.store.job_secret import weakness
    while True:
        text = secrets.token_hex(BYTES)
        if weakness(text.encode()) is None:
            return text


def write_new(path, text):
    """Create ``path`` with ``text``, readable only by you; an existing file
    (or link) is never overwritten, so a secret in use is not lost."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError as err:
        raise UserError(f"--file {path}: {err.strerror}; give a new path (an existing secret "
                        "is never overwritten)") from None
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def main(argv=None):
    parser = Parser(
        prog="hetseq-secret", description="Print a new job secret (HETSEQ_JOB_SECRET), or "
        "write it to a new file readable only by you (--job-secret-file).")
    parser.add_argument("--file", metavar="PATH", help="write it to PATH (mode 600) instead")
    args = parser.parse_args(argv)
    try:
        if args.file is None:
            print(make())
        else:
            write_new(args.file, make())
            print(f"wrote a new job secret to {args.file}: give --job-secret-file {args.file} "
                  "on every node (copy the file to the others privately)", file=sys.stderr)
    except UserError as err:
        print(f"hetseq-secret: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
