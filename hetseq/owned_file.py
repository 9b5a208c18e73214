"""Files whose content decides what a job trusts or runs: the job secret
(--job-secret-file) and the launcher's forwarded variables (.hetseq_env,
whose PYTHONPATH chooses the code every node imports). Whoever can change
such a file owns the job, so it is read only when it is yours and nobody
else can write it (the secret: nor read it), checked on the descriptor that
is then read, so that it cannot be swapped between the check and the read.
"""

import errno
import os
import stat

from hetseq.errors import UserError


def read_owned(path, what, *, private, limit):
    """The bytes of ``path`` (at most ``limit``), named ``what`` in errors
    ("--job-secret-file PATH"). Refused with the fix: a symbolic link (it
    may point anywhere), anything but a regular file (a FIFO would block),
    another owner than you, mode bits that let others write it, and with
    ``private`` read it, and a file larger than ``limit``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise UserError(f"{what}: a symbolic link; give the file itself") from None
        raise UserError(f"{what}: {err.strerror}") from None
    try:
        info = os.fstat(fd)
        _check(info, path, what, private)
        data = _read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise UserError(f"{what}: larger than {limit} bytes, so not the file expected here")
    return data


def _check(info, path, what, private):
    if not stat.S_ISREG(info.st_mode):
        raise UserError(f"{what}: not a regular file")
    mode = info.st_mode & 0o777
    if info.st_uid != os.geteuid():
        raise UserError(f"{what}: owned by uid {info.st_uid}, not by you (uid {os.geteuid()}): "
                        "its owner would choose what the job trusts; use a file of your own")
    if private and mode & 0o077:
        raise UserError(f"{what}: readable by others (mode {mode:o}, owner uid {info.st_uid}); "
                        f"it must be yours and private: chmod 600 {path}")
    if mode & 0o022:
        raise UserError(f"{what}: writable by others (mode {mode:o}): whoever can write it "
                        f"chooses what the job runs; chmod go-w {path}")


def _read_at_most(fd, limit):
    data = b""
    while len(data) < limit:
        got = os.read(fd, limit - len(data))
        if not got:
            break
        data += got
    return data
