"""``hetseq-launch --hostfile FILE [options] train.py FLAGS...``: every node
of a hostfile started from one command (docs/nodes.md).

The launcher plans each node's command (plan.py: ranks, world, the meeting
point at the first host), hands each node the job secret and the forwarded
variables on standard input (node.py), relays every node's lines with its
host in front, and stops them together: on Ctrl-C or SIGTERM, when a node
cannot be reached, or when one fails in a fixed job. Its exit code is the
worst of the nodes'.
"""

import argparse
import logging
import os
import queue
import shlex
import shutil
import signal
import sys
import tempfile
import threading

from hetseq.distributed import secret as secrets_cli
from hetseq.distributed import tunnel
from hetseq.errors import UserError
from hetseq.launch import hostfile, plan as planning
from hetseq.launch.nodes import RunningNode, wait_all
from hetseq.launch.transport import TRANSPORTS

logger = logging.getLogger("hetseq.launch")

ENV_FILE = ".hetseq_env"
# Forwarded without being asked, like DeepSpeed's NCCL*/PYTHON* variables.
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "HETSEQ_", "OMP_")
STOP_S = 15.0            # after a stop, how long nodes get before their ssh is killed
UNREACHABLE = 255


def build_parser():
    p = argparse.ArgumentParser(
        prog="hetseq-launch", allow_abbrev=False,
        description="Start a HetSeq job on every node of a hostfile over SSH, and stop it "
                    "there too (docs/nodes.md).",
        epilog="example: hetseq-launch --hostfile hosts train.py --task bert --max-update 1000")
    p.add_argument("--hostfile", required=True, metavar="FILE",
                   help="one line per node: 'HOST slots=N [per-node flags as name=value]'")
    p.add_argument("--launcher", default="ssh", choices=TRANSPORTS.names(),
                   help="how nodes are started: ssh (default), or local for localhost lines")
    p.add_argument("--ssh-opts", default="", metavar="'OPTS'",
                   help="options given to every ssh call, before hetseq-launch's own")
    p.add_argument("--master-addr", metavar="HOST",
                   help="where the job meets (default: the first host, as written)")
    p.add_argument("--master-port", type=int, default=29500, metavar="PORT",
                   help="the meeting point's port on that host (default: 29500)")
    p.add_argument("--remote-dir", default=os.getcwd(), metavar="DIR",
                   help="the directory each node runs in (default: this one)")
    p.add_argument("--remote-python", default=sys.executable, metavar="PYTHON",
                   help="the interpreter each node runs (default: this one)")
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help=f"forward a variable (as here, or VALUE); also every line of ./{ENV_FILE}")
    p.add_argument("--job-secret-file", metavar="PATH",
                   help="the job secret to hand to every node (or HETSEQ_JOB_SECRET); "
                        "default: a new one, kept in a private file while the job runs")
    p.add_argument("--dry-run", action="store_true",
                   help="print each node's command (the secret elided) and start nothing")
    p.add_argument("script", help="the training script each node runs (train.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its flags")
    return p


def forwarded_env(names, env_file=ENV_FILE, environ=os.environ):
    """{name: value} every node gets: ``environ``'s variables with a known
    prefix, the lines of ``env_file`` (NAME=VALUE) and ``--env`` items."""
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.pop(tunnel.SECRET_VARIABLE, None)
    items = []
    if os.path.exists(env_file):
        with open(env_file, encoding="utf-8") as f:
            items += [(f"{env_file} line {n}", line.strip()) for n, line in enumerate(f, 1)
                      if line.strip() and not line.lstrip().startswith("#")]
    items += [("--env", item) for item in names]
    for where, item in items:
        name, eq, value = item.partition("=")
        if not name.isidentifier():
            raise UserError(f"{where}: {item!r}: expected NAME=VALUE or NAME")
        if not eq:
            if name not in environ:
                raise UserError(f"{where}: {name} is not set here; give NAME=VALUE")
            value = environ[name]
        env[name] = value
    return env


class Secret:
    """The job secret for the nodes: given (--job-secret-file,
    HETSEQ_JOB_SECRET) or made, and then kept in a file only this user reads
    while the job runs, so that hetseq-status can be pointed at it."""

    def __init__(self, path):
        given = tunnel.secret_text(path)
        self.folder = None
        if given is not None:
            self.text, self.path = given.decode(), path
            return
        self.text = secrets_cli.make()
        self.folder = tempfile.mkdtemp(prefix="hetseq-launch-")    # mode 700
        self.path = os.path.join(self.folder, "job-secret")
        secrets_cli.write_new(self.path, self.text)

    def where(self):
        if self.folder is None:
            return "the job secret given"
        return f"a new job secret, in {self.path} while the job runs"

    def close(self):
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def describe(job):
    return (f"{len(job.nodes)} node(s), meeting at {job.url}"
            + (" (--elastic: ranks given there)" if job.elastic else
               f", world size {job.world_size}"))


def dry_run(job, transport, args, env):
    print(f"hetseq-launch: {describe(job)}")
    names = ", ".join(sorted([tunnel.SECRET_VARIABLE + "=<elided>", *env]))
    for node in job.nodes:
        command, _ = transport.command(node.host, args.remote_dir, args.remote_python, node.argv)
        print(f"{node.label} ({node.ranks()}): {shlex.join(command)}")
    print(f"standard input of every node: {names}")


class Launch:
    """The nodes of one job while they run."""

    def __init__(self, job, transport, args, env):
        self.job, self.transport, self.args, self.env = job, transport, args, env
        # Re-entrant: the signal handler says a line in the thread that may hold it.
        self.events, self.lock = queue.Queue(), threading.RLock()
        self.nodes, self.stopping = [], None

    def say(self, text):
        with self.lock:
            print(f"hetseq-launch: {text}", flush=True)

    def start(self):
        for node in self.job.nodes:
            command, cwd = self.transport.command(node.host, self.args.remote_dir,
                                                  self.args.remote_python, node.argv)
            self.nodes.append(RunningNode(node, command, cwd, self.env, self.events,
                                          lock=self.lock))

    def stop(self, why):
        if self.stopping is None:
            self.stopping = why
            self.say(f"stopping every node: {why}")
            for node in self.nodes:
                if node.running:
                    node.stop()

    def run(self):
        """Wait for every node; returns the exit code."""
        while self.stopping is None and any(n.running for n in self.nodes):
            try:
                self._ended(self.events.get(timeout=0.2))
            except queue.Empty:
                pass
        wait_all(self.nodes, self.events, STOP_S)
        return self.summary()

    def _ended(self, node):
        out, label = node.outcome, node.plan.label
        if not out.reached and self.transport.unreachable(out.code):
            reason = out.last_line or f"ssh exited {out.code}"
            self.say(f"{label}: could not be reached over ssh: {reason}")
            if not self.job.elastic:
                self.stop(f"{label} could not be reached")
        elif out.code != 0 and not self.job.elastic:
            self.stop(f"{label} exited with {out.code}")

    def summary(self):
        self.say("summary:")
        codes = []
        for node in self.nodes:
            out, plan = node.outcome, node.plan
            if not out.reached and self.transport.unreachable(out.code):
                left_out = self.job.elastic
                state = "unreachable" + (" (the job went on without it: --elastic)"
                                         if left_out else "")
                if not left_out:
                    codes.append(UNREACHABLE)
            else:
                state = f"exit {out.code}" + (" (stopped by hetseq-launch)"
                                              if out.stopped and out.code != 0 else "")
                codes.append(out.code)
            self.say(f"  {plan.label} ({plan.ranks()}): {state}, {out.seconds:.0f} s")
        return max(codes, default=UNREACHABLE)


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    secret = None
    try:
        lines = hostfile.read(args.hostfile)
        job = planning.make(lines, args.script, args.args, args.master_port, args.master_addr)
        transport = TRANSPORTS.get(args.launcher)(args.ssh_opts)
        env = forwarded_env(args.env)
        if args.dry_run:
            dry_run(job, transport, args, env)
            return
        secret = Secret(args.job_secret_file)
        launch = Launch(job, transport, args, {**env, tunnel.SECRET_VARIABLE: secret.text})
        launch.say(describe(job))
        launch.say(f"{secret.where()}; see the job with: hetseq-status {job.url} "
                   f"--job-secret-file {secret.path}")
        previous = {sig: signal.signal(sig, lambda s, _: launch.stop(
            f"{signal.Signals(s).name} received")) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            launch.start()
            code = launch.run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except UserError as err:
        print(f"hetseq-launch: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    finally:
        if secret is not None:
            secret.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
