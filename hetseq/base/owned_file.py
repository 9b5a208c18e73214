"""Paths whose content decides what a job trusts or runs: the secret, the
launcher's .hetseq_env, the hostfile, the launch folder, --user-dir, the
compile cache. Whoever can change one owns the job, so it is used only when
it is yours (or root's) and nobody else can write it or a folder above it.
"""

# The secret and .hetseq_env (whose PYTHONPATH chooses the code every node
# imports) are read through read_owned; the hostfile names a --user-dir;
# Python imports from the folder of the script it runs; the compile cache
# holds pickled code. A folder above with the sticky bit (like /tmp) cannot
# swap a path: only a name's owner renames it there. Only these paths are
# checked: data folders shared by a group are common and decide no code.

import errno
import os
import pwd
import stat

from hetseq.base.errors import UserError


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


def _owner(uid):
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def others_can_change(path):
    """Why another user could change what ``path`` holds, or None: it (after
    its links are resolved) is owned by someone other than you or root, or
    group or others may write it; or a folder above it is owned by someone
    else, or writable by others without the sticky bit. A missing path: None
    (whoever reads it says so)."""
    me = os.geteuid()
    real = os.path.realpath(path)
    # The folders on the way as written are judged too: a link kept in a
    # folder that others may write can be pointed elsewhere after the check.
    if os.path.abspath(path) != real:
        why = _changeable(os.path.dirname(os.path.abspath(path)), real, me, target=False)
        if why:
            return why
    return _changeable(real, real, me, target=True)


def _changeable(current, real, me, target):
    """others_can_change's rule for ``current`` and every folder above it."""
    while True:
        try:
            info = os.stat(current)
        except OSError:
            return None
        mode = stat.S_IMODE(info.st_mode)
        shown = f"{current}: mode {mode:o}, owner {_owner(info.st_uid)}"
        if info.st_uid not in (me, 0):
            return (f"{shown}: its owner could change "
                    + ("it" if target else f"what {real} holds"))
        writable = mode & 0o022
        if writable and (target or not mode & stat.S_ISVTX):
            return (f"{shown}: others may write "
                    + ("it" if target else f"in it and replace {real}"))
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current, target = parent, False


def refuse_unless_owned(path, what, fix_folder="~/hetseq-job"):
    """UserError when another user could change ``path`` (others_can_change),
    naming it as ``what``, the path, its owner and mode, and the fix: a folder
    of your own (chmod only where the path is yours)."""
    why = others_can_change(path)
    if why is None:
        return
    real = os.path.realpath(path)
    info = os.stat(real)
    fix = f"use a folder of your own: mkdir -m 700 {fix_folder}"
    if info.st_uid == os.geteuid() and os.geteuid() != 0 and why.startswith(real + ":"):
        fix = f"chmod go-w {real}, or {fix}"
    raise UserError(f"{what} {path}: {why}; whoever can change it chooses the code the job "
                    f"runs, with its secret; {fix}")


def private_folder(path, what):
    """``path`` as a folder only you use (made with mode 700, with its parents,
    when missing); refused when another user could change it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as err:
        raise UserError(f"{what} {path}: {err.strerror or err}") from None
    refuse_unless_owned(path, what, fix_folder=path)
    return path


def compile_cache():
    """The folder torch.compile keeps its compiled code in, set as
    TORCHINDUCTOR_CACHE_DIR for this process and its children: the one the
    user set, or ``$XDG_CACHE_HOME/hetseq/inductor`` (``~/.cache/...``);
    either must be yours alone. torch's default, ``/tmp/torchinductor_USER``,
    holds pickled code that it loads, and another local user can make that
    folder first. Persistent, not one per run: every run would recompile."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = given or os.path.join(base, "hetseq", "inductor")
    private_folder(path, "TORCHINDUCTOR_CACHE_DIR" if given else "--compile's cache")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(path)
    return path
