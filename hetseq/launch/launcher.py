"""``hetseq-launch --hostfile FILE [options] train.py FLAGS...``: every node
of a hostfile started from one command (docs/nodes.md).

The launcher plans each node's command (commands.py: ranks, world, the meeting
point at the first host), hands each node the job secret and the forwarded
variables on standard input (node.py), relays every node's lines with its
host in front, and stops them together: on Ctrl-C, Ctrl-\\, SIGTERM or
SIGHUP (each unless ignored when it started: nohup), when a node cannot be
reached, or when one fails in a fixed job. Its exit code is the worst of
the nodes'.
"""

import argparse
import json
import logging
import os
import queue
import shlex
import shutil
import signal
import sys
import tempfile
import threading
import time

from hetseq.base.errors import UserError
from hetseq.base.flags import Parser
from hetseq.distributed.topology import NODE_VARIABLE
from hetseq.launch import hostfile, commands as planning
from hetseq.launch.node import ENV_LIMIT
from hetseq.launch.nodes import RunningNode
from hetseq.launch.transport import TRANSPORTS
from hetseq.launch import check as checking
from hetseq.base.owned_file import read_owned, refuse_unless_owned
from hetseq.store import job_secret, secret as secrets_cli

ENV_FILE = ".hetseq_env"
MAX_ENV_FILE = 1 << 20
# One NAME=VALUE that exec takes (Linux: MAX_ARG_STRLEN, 32 pages), and the
# line every node reads (launch/node.py's ENV_LIMIT, less room for the secret).
MAX_VARIABLE = 128 << 10
MAX_ENV_LINE = ENV_LIMIT - (16 << 10)
# Forwarded without being asked, like DeepSpeed's NCCL*/PYTHON* variables.
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "PYTHON", "HETSEQ_", "OMP_")
STOP_S = 15.0            # after a stop, how long nodes get (beyond the time they said
                         # their save takes) before their ssh is killed
PDSH_REFUSED = ("--launcher pdsh: pdsh runs one command on every host and does not forward "
                "standard input, but each node here has its own command (its ranks and "
                "flags) and takes the job secret on its standard input; use --launcher ssh "
                "(pdsh -R ssh would also run ssh)")
UNREACHABLE = 255       # as ssh's own failure
NOT_STARTED = 1


def port_number(text):
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port from 1 to 65535")
    return int(text)


def build_parser():
    p = Parser(
        prog="hetseq-launch",
        description="Start a HetSeq job on every node of a hostfile over SSH, and stop it "
                    "there too (docs/nodes.md).",
        epilog="example: hetseq-launch --hostfile hosts train.py --task bert --max-update 1000")
    p.add_argument("--hostfile", required=True, metavar="FILE",
                   help="one line per node: 'HOST slots=N [per-node flags as name=value]'")
    p.add_argument("--launcher", default="ssh", choices=[*TRANSPORTS.names(), "pdsh"],
                   help="how nodes are started: ssh (default), or local for localhost lines "
                        "(pdsh: refused, with the reason)")
    p.add_argument("--ssh-opts", default="", metavar="'OPTS'",
                   help="options given to every ssh call, before hetseq-launch's own")
    p.add_argument("--master-addr", metavar="HOST",
                   help="where the job meets (default: the first host, as written)")
    p.add_argument("--master-port", type=port_number, default=29500, metavar="PORT",
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
    p.add_argument("--check", action="store_true",
                   help="reach every host as the launch would, show what each has against "
                        "what its line asks (devices, versions, memory, interface); start "
                        "nothing; exit 2 unless every node can run its part")
    p.add_argument("script", help="the training script each node runs (train.py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its flags")
    return p


def forwarded_env(names, env_file=ENV_FILE, environ=os.environ):
    """{name: value} every node gets: ``environ``'s variables with a known
    prefix, the lines of ``env_file`` (NAME=VALUE) and ``--env`` items."""
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_PREFIXES)}
    env.pop(job_secret.SECRET_VARIABLE, None)
    items = []
    if os.path.lexists(env_file):
        # Its PYTHONPATH or LD_PRELOAD line picks the code every node runs:
        # read only a file of this user's that nobody else can write.
        data = read_owned(env_file, env_file, private=False, limit=MAX_ENV_FILE)
        try:
            lines = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            raise UserError(f"{env_file}: not UTF-8 text; it should hold NAME=VALUE "
                            "lines") from None
        items += [(f"{env_file} line {n}", line.strip()) for n, line in enumerate(lines, 1)
                  if line.strip() and not line.lstrip().startswith("#")]
    items += [("--env", item) for item in names]
    for where, item in items:
        name, eq, value = item.partition("=")
        if not name.isidentifier():
            # (Never the line itself: its value may be a token.)
            raise UserError(f"{where}: expected NAME=VALUE or NAME, with NAME a variable's "
                            "name (no 'export', no spaces)")
        if not eq:
            if name not in environ:
                raise UserError(f"{where}: {name} is not set here; give NAME=VALUE")
            value = environ[name]
        if "\0" in value:
            raise UserError(f"{where}: {name}'s value holds a NUL byte, which no variable can "
                            "hold")
        if len(f"{name}={value}".encode()) >= MAX_VARIABLE:
            raise UserError(f"{where}: {name} is {len(value.encode())} bytes, more than one "
                            f"variable may hold ({MAX_VARIABLE}); pass the path of a file instead")
        env[name] = value
    size = len(json.dumps({"env": env}).encode())
    if size > MAX_ENV_LINE:
        raise UserError(f"the forwarded variables take {size} bytes as the line each node "
                        f"reads, more than {MAX_ENV_LINE}: forward fewer (--env, {env_file})")
    return env


class Secret:
    """The job secret for the nodes: given (--job-secret-file,
    HETSEQ_JOB_SECRET) or made, and then kept in a file only this user reads
    while the job runs, so that hetseq-status can be pointed at it."""

    def __init__(self, path):
        given = job_secret.secret_text(path)
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
        return f"a new job secret, in {self.path} while hetseq-launch runs"

    def status_flag(self):
        """How hetseq-status is given the same secret."""
        if self.path is None:
            return f"(with {job_secret.SECRET_VARIABLE} set as here)"
        return f"--job-secret-file {self.path}"

    def close(self):
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def describe(job):
    return (f"{len(job.nodes)} node(s), meeting at {job.url}"
            + (" (--elastic: ranks given there)" if job.elastic else
               f", world size {job.world_size}"))


def dry_run(job, transport, args, env):
    print(f"hetseq-launch: {describe(job)}")
    names = ", ".join(sorted([job_secret.SECRET_VARIABLE + "=<elided>", *env]))
    for node in job.nodes:
        command, _ = transport.command(node.host, args.remote_dir, args.remote_python, node.argv)
        print(f"{node.label} ({node.ranks()}): {shlex.join(command)}")
    print(f"standard input of every node: {names}")


class Launch:
    """The nodes of one job while they run. Signals only record a request
    (``requested``); the main thread acts on it, between two starts or
    within POLL_S, so a handler never prints or waits for a lock."""

    POLL_S = 0.2

    def __init__(self, job, transport, args, env):
        self.job, self.transport, self.args, self.env = job, transport, args, env
        self.events, self.lock = queue.Queue(), threading.Lock()
        self.nodes, self.stopping, self.requested, self.signalled = [], None, None, None
        self.now = False         # a second signal: stop the nodes at once
        self.command = None      # this command as typed, for the line that resumes it
        self.handled = set()
        self.cause = None        # the exit code of the node whose end stopped the others

    def say(self, text):
        with self.lock:
            try:
                print(f"hetseq-launch: {text}", flush=True)
            except (OSError, ValueError):
                pass            # (a closed terminal or pipe: the nodes still get stopped)

    def request_stop(self, signum, _frame):
        """A signal: the nodes stop after their save; a second: at once."""
        self.now = self.requested is not None
        self.requested = f"{signal.Signals(signum).name} received"
        self.signalled = self.signalled or signum

    def start(self):
        for node in self.job.nodes:
            command, cwd = self.transport.command(node.host, self.args.remote_dir,
                                                  self.args.remote_python, node.argv)
            if self.requested:        # (run() stops those already started)
                break
            try:
                # The node's name in its lines and in hetseq-status: the same.
                env = {**self.env, NODE_VARIABLE: node.label}
                self.nodes.append(RunningNode(node, command, cwd, env, self.events,
                                              lock=self.lock))
            except OSError as err:
                self.stop(f"could not start {node.label}: {err.filename or command[0]}: "
                          f"{err.strerror or err}")
                break

    def stop(self, why):
        """Close every node's input (they stop), then say so."""
        if self.stopping is None:
            self.stopping = why
            for node in self.nodes:
                if node.running:
                    node.stop()
            self.say(f"stopping every node: {why}")

    def run(self):
        """Wait for every node; returns the exit code."""
        if self.requested and not self.nodes:     # a signal before the first node started
            self._stopped_by(128 + self.signalled, self.requested)
        while len(self.handled) < len(self.nodes):
            if self.requested:
                self.stop(self.requested)
            if self.stopping is not None:
                break
            self._next(self.POLL_S)
        self._wait_stopped()
        while len(self.handled) < len(self.nodes) and not self.events.empty():
            self._next(0)
        return self.summary()

    def _next(self, timeout):
        try:
            node = self.events.get(timeout=timeout) if timeout else self.events.get_nowait()
        except queue.Empty:
            return
        if node.plan.label not in self.handled:
            self.handled.add(node.plan.label)
            self._ended(node)

    def _wait_stopped(self):
        """After a stop: the nodes save and end within the time they said
        (base/stopping.py) and STOP_S; then, or at a second signal, they are
        told to stop at once, and their local processes killed STOP_S later."""
        if self.stopping is None:
            return
        began, told = time.monotonic(), None
        while any(n.running for n in self.nodes):
            bound = max((n.outcome.bound or 0.0 for n in self.nodes), default=0.0)
            if told is None and (self.now or time.monotonic() > began + bound + STOP_S):
                told = time.monotonic()
                if self.now:
                    self.say("stopping every node at once: a second signal")
                for node in self.nodes:
                    if node.running:
                        node.stop(now=True)
            if told is not None and time.monotonic() > told + STOP_S:
                break
            self._next(self.POLL_S)
        for node in self.nodes:
            if node.running:
                node.kill()
        for node in self.nodes:
            node.proc.wait()

    def _ended(self, node):
        out, label = node.outcome, node.plan.label
        if not out.reached and self.transport.unreachable(out.code):
            self.say(f"{label}: could not be reached over ssh: "
                     f"{out.last_line or f'ssh exited {out.code}'}"
                     f"{checking.local_hint(node.plan.host)}")
            if not self.job.elastic:
                self._stopped_by(UNREACHABLE, f"{label} could not be reached")
        elif out.code != 0 and not self.job.elastic:
            self._stopped_by(out.code, f"{label} exited with {out.code}")

    def _stopped_by(self, code, why):
        if self.stopping is None:
            self.cause = code
        self.stop(why)

    def summary(self):
        """Says how each node ended; returns the exit code: that of the node
        whose end stopped the others (HetSeq's 2, 3 or 4, or 255: not the
        143 of the nodes it stopped), else the worst of the nodes'."""
        self.say("summary:")
        codes = []
        for node in self.nodes:
            state, code = self._outcome(node)
            if code is not None:
                codes.append(code)
            self.say(f"  {node.plan.label} ({node.plan.ranks()}): {state}, "
                     f"{node.outcome.seconds:.0f} s")
        for plan in self.job.nodes[len(self.nodes):]:
            codes.append(NOT_STARTED)
            self.say(f"  {plan.label} ({plan.ranks()}): not started ({self.stopping})")
        if self.cause is not None:
            return self.cause
        if self.signalled:
            # Its nodes saved where they could (each node's last line says);
            # the same command resumes from there.
            if self.command:
                self.say(f"resume with the same command: {self.command}")
            return 128 + self.signalled
        return max(codes, default=NOT_STARTED)

    def _outcome(self, node):
        """(what the summary says, the code it counts; None: not counted)."""
        out = node.outcome
        if out.code is None:           # its output could not be read to the end
            return "still running when hetseq-launch gave up on it", NOT_STARTED
        if not out.reached and self.transport.unreachable(out.code):
            if self.job.elastic:
                return "unreachable (the job went on without it: --elastic)", None
            return "unreachable", UNREACHABLE
        if not out.reached and self.transport.wraps:
            # ssh ran, but not the node's wrapper (it never said it started).
            return f"exit {out.code} without starting the node", max(out.code, NOT_STARTED)
        stopped = " (stopped by hetseq-launch)" if out.stopped and out.code != 0 else ""
        return f"exit {out.code}{stopped}", out.code


# Ctrl-C, kill, Ctrl-\ and the terminal closing all stop every node and
# remove a made secret (SIGQUIT's default would leave the secret's file and
# the remote nodes behind).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)


def stop_on_signals(handler):
    """Installs ``handler`` for STOP_SIGNALS; returns what to restore. A
    signal ignored when the launcher started stays ignored: ``nohup
    hetseq-launch`` must survive its terminal closing (SIGHUP), and a shell
    that starts it in the background ignores SIGINT and SIGQUIT for it."""
    previous = {}
    for sig in STOP_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            previous[sig] = signal.signal(sig, handler)
    return previous


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    secret = None
    try:
        # Where the nodes' Python imports from (the script's folder): refused
        # when another user could plant code there (owned_file.py).
        refuse_unless_owned(os.getcwd(), "the launch folder")
        lines = hostfile.read(args.hostfile)
        job = planning.make(lines, args.script, args.args, args.master_port, args.master_addr,
                            planning.new_job_id())      # the secret's salt: this job's own
        if args.launcher == "pdsh":
            raise UserError(PDSH_REFUSED)
        transport = TRANSPORTS.get(args.launcher)(args.ssh_opts)
        transport.check(lines)
        if not transport.wraps:          # (over ssh, each node's wrapper checks its own)
            refuse_unless_owned(os.path.expanduser(args.remote_dir), "--remote-dir")
        env = forwarded_env(args.env)
        if args.check:
            sys.exit(checking.run(job, lines, transport, args, env))
        if args.dry_run:
            dry_run(job, transport, args, env)
            return
        checking.refuse_missing_devices(job, lines, transport, args, env)
        launch = Launch(job, transport, args, env)
        launch.command = shlex.join(["hetseq-launch", *(sys.argv[1:] if argv is None else argv)])
        # Before the secret exists: a signal from here on ends in summary()
        # and the secret's removal.
        previous = stop_on_signals(launch.request_stop)
        try:
            secret = Secret(args.job_secret_file)
            launch.env = {**env, job_secret.SECRET_VARIABLE: secret.text}
            launch.say(describe(job))
            launch.say(f"{secret.where()}; see the job with: hetseq-status {job.node_url} "
                       f"{secret.status_flag()}")
            launch.start()
            code = launch.run()
        finally:
            # The secret goes before the handlers: a second signal must not
            # find the default action and leave the file behind.
            if secret is not None:
                secret.close()
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
