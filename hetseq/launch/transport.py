"""How ``hetseq-launch`` reaches a node (``--launcher``): the local command
that starts the node's ``python -m hetseq.launch.node`` on its host, over
OpenSSH as installed (the user's ``~/.ssh/config`` applies) or, with
``local``, on this machine. pdsh is not offered: it does not forward
standard input, which carries each node's secret (node.py). docs/nodes.md,
"One command".
"""

import os
import shlex
import socket

from hetseq.base.errors import UserError
from hetseq.launch.commands import meeting_host
from hetseq.base.registry import Registry

TRANSPORTS = Registry("launcher")
# BatchMode: a host that would ask for a password fails at once instead of
# waiting for a terminal.
SSH_DEFAULTS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")


# ``python -m MODULE`` puts the working folder first on sys.path, so a
# json.py that another user dropped in a shared launch folder would run as
# you, with the job secret, before HetSeq's first line; so does an empty
# PYTHONPATH entry (``export PYTHONPATH=$PYTHONPATH:/x`` with none set), and
# an editable install from that folder. So before it imports anything, the
# bootstrap judges the folder and every folder above it with the modules
# Python loaded at start (os, sys) only: owned_file.others_can_change's rule
# (yours or root's; nobody else may write it, nor a folder above it without
# the sticky bit), then exit 2 in one line; and it drops '' (the folder) from
# sys.path: 3.11's -P does that, but a node may run 3.10; -I would also drop
# PYTHONPATH, which .hetseq_env may forward.
BOOT = (
    "import os, sys; c = os.getcwd(); p = c.split('/'); "
    "s = [(d, os.stat(d)) for d in ['/'.join(p[:i]) or '/' for i in range(len(p), 0, -1)]]; "
    "b = [(d, t) for d, t in s if t.st_uid not in (0, os.geteuid()) "
    "or t.st_mode & 0o22 and (d == c or not t.st_mode & 0o1000)]; "
    "b and (print(f'hetseq.launch.node: the launch folder {c} could be changed by another user "
    "({b[0][0]}: mode {b[0][1].st_mode & 0o7777:o}, owner uid {b[0][1].st_uid}): whoever can "
    "change it chooses the code the job runs, with its secret; run the job from a folder of "
    "your own (mkdir -m 700 DIR; --remote-dir DIR)', file=sys.stderr), sys.exit(2)); "
    "sys.path[:] = [x for x in sys.path if x]; import runpy; "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)")


def module_argv(module):
    """Interpreter arguments that run ``module`` as ``-m`` would, without the
    working folder on sys.path."""
    return ["-c", BOOT, module]


def node_command(python, argv):
    """The node wrapper's command line around ``argv``."""
    return [python, *module_argv("hetseq.launch.node"), "--", python, *argv]


def remote_path(path):
    """``path`` quoted for the remote shell; a leading ``~/`` left to it (your
    home there)."""
    if path == "~" or path.startswith("~/"):
        return "~/" + shlex.quote(path[2:]) if path[2:] else "~"
    return shlex.quote(path)


@TRANSPORTS.register("ssh")
class Ssh:
    """``ssh [--ssh-opts] [defaults] HOST 'cd DIR && exec PYTHON -m hetseq.launch.node -- ...'``."""

    wraps = True       # between the launcher and the node's wrapper: ssh

    def __init__(self, ssh_opts=""):
        self.opts = shlex.split(ssh_opts)

    def check(self, lines):
        pass

    def command(self, host, remote_dir, python, argv):
        remote = f"cd -- {remote_path(remote_dir)} && exec {shlex.join(node_command(python, argv))}"
        # --ssh-opts first: ssh keeps the first value it reads for an option.
        # "--": a host is never read as an option of ssh's.
        return ["ssh", *self.opts, *SSH_DEFAULTS, "--", host, remote], None

    @staticmethod
    def unreachable(code):
        return code == 255          # ssh's own failure (the node never started)


@TRANSPORTS.register("local")
class Local:
    """The node on this machine: the wrapper started directly, in ``remote_dir``."""

    wraps = False

    def __init__(self, ssh_opts=""):
        pass

    def check(self, lines):
        """Every line must name this machine: the job meets at the first host's name."""
        here = {"localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn()}
        for line in lines:
            if meeting_host(line.host) not in here:
                raise UserError(f"hostfile line {line.line}: --launcher local runs every node "
                                f"on this machine, and {line.host} is another: write "
                                "localhost, or use --launcher ssh")

    def command(self, host, remote_dir, python, argv):
        return node_command(python, argv), os.path.expanduser(remote_dir)

    @staticmethod
    def unreachable(code):
        return False
