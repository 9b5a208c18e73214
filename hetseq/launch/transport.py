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

from hetseq.errors import UserError
from hetseq.launch.plan import meeting_host
from hetseq.registry import Registry

TRANSPORTS = Registry("launcher")
# BatchMode: a host that would ask for a password fails at once instead of
# waiting for a terminal.
SSH_DEFAULTS = ("-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10",
                "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")


def node_command(python, argv):
    """The node wrapper's command line around ``argv``."""
    return [python, "-m", "hetseq.launch.node", "--", python, *argv]


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
