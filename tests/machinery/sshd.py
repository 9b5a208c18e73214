"""A real OpenSSH server in namespace hosts (cluster.py), for tests of
``hetseq-launch`` as users run it: key login only, with its own host key,
client key and configuration in a folder of the test's, nothing of the
machine's own ssh set-up read or changed.

    with SshServers(cluster, folder) as ssh:
        cluster.popen(0, ["hetseq-launch", "--ssh-opts", ssh.opts, ...])
"""

import os
import shutil
import subprocess

from machinery.watched import Watched

SSHD = "/usr/sbin/sshd"
PRIVSEP = "/run/sshd"       # sshd's privilege separation directory (Debian)


def available():
    """(True, "") when sshd and ssh are installed, else (False, why)."""
    for tool in (SSHD, "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return False, f"needs '{tool}' (Debian packages openssh-server, openssh-client)"
    return True, ""


def _keygen(path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True,
                   capture_output=True, timeout=30)


class SshServers:
    """An sshd on port 22 of hosts ``indices`` of ``cluster`` (default all);
    ``opts``: the ssh options that log in to them (``-F`` a config of the
    folder's: its key, no known_hosts, no agent, no password)."""

    def __init__(self, cluster, folder, indices=None):
        self.cluster, self.folder = cluster, str(folder)
        self.indices = list(range(cluster.size) if indices is None else indices)
        self.servers = []
        self.config = os.path.join(self.folder, "ssh_config")
        self.opts = f"-F {self.config}"

    def __enter__(self):
        os.makedirs(self.folder, exist_ok=True)
        os.makedirs(PRIVSEP, mode=0o755, exist_ok=True)
        key, host_key = (os.path.join(self.folder, name) for name in ("client_key", "host_key"))
        _keygen(key)
        _keygen(host_key)
        shutil.copy(key + ".pub", os.path.join(self.folder, "authorized_keys"))
        server_config = os.path.join(self.folder, "sshd_config")
        with open(server_config, "w") as f:
            f.write(f"Port 22\nListenAddress 0.0.0.0\nHostKey {host_key}\n"
                    f"AuthorizedKeysFile {self.folder}/authorized_keys\n"
                    "PubkeyAuthentication yes\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                    "UsePAM no\nStrictModes no\nPidFile none\nLogLevel INFO\n")
        with open(self.config, "w") as f:
            f.write(f"Host *\n  IdentityFile {key}\n  IdentitiesOnly yes\n  User root\n"
                    "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                    "  LogLevel ERROR\n  PasswordAuthentication no\n")
        for index in self.indices:
            server = Watched(self.cluster.popen(index, [SSHD, "-D", "-e", "-f", server_config],
                                                stdout=subprocess.PIPE,
                                                stderr=subprocess.STDOUT, text=True))
            self.servers.append(server)
        for server in self.servers:
            server.wait_for(r"Server listening on 0\.0\.0\.0 port 22", timeout=30)
        return self

    def __exit__(self, *exc):
        for server in self.servers:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()
