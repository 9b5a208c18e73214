"""``hetseq-launch --check``: before a launch, every host of the hostfile is
reached the way the launch reaches it, in parallel and within
``DEADLINE_S``, and asked (probe.py) what it has; one table, then each
problem with its fix. A launch itself checks only what would go wrong in
silence: a line that asks for GPUs on a host that has fewer
(``missing_devices``). docs/nodes.md, "Check before you launch".
"""

import dataclasses
import ipaddress
import json
import os
import signal
import socket
import subprocess
import threading
import time

from hetseq.app import cli
from hetseq.base.errors import UserError
from hetseq.base.logs import printable
from hetseq.launch.node import STARTED
from hetseq.launch.commands import meeting_host
from hetseq.launch.probe import PREFIX
from hetseq.launch.transport import module_argv

DEADLINE_S = 60.0
NOT_READY = 2
OUTPUT_LIMIT = 1 << 20     # what a host may say (its words are not trusted to be sane)


def _clean(text):
    """A host's words, printable: no terminal escapes."""
    return printable(text)


def is_this_machine(host):
    """Whether ``host`` ([user@]name or address) names the machine this runs on."""
    name = meeting_host(host).lower()
    if name == "localhost" or name.startswith("localhost."):
        return True
    try:
        if ipaddress.ip_address(name).is_loopback:
            return True
    except ValueError:
        pass
    if name in {socket.gethostname().lower(), socket.getfqdn().lower()}:
        return True
    from hetseq.distributed import interfaces
    return name in {address for _, address, _, _ in interfaces.list_addresses()}


def local_hint(host):
    """What to add to an ssh failure on ``host`` when it is this machine."""
    if not is_this_machine(host):
        return ""
    return (f"; {meeting_host(host)} is this machine: without an SSH server there, run every "
            "line here with --launcher local (hostfile lines naming localhost)")


@dataclasses.dataclass
class Answer:
    label: str
    host: str
    line: int
    slots: int
    gpus: int                 # the GPUs its line asks for (0: cpu)
    facts: dict | None = None
    problems: list = dataclasses.field(default_factory=list)   # [(what, fix)]


def node_options(plan):
    """(asks for CPU, its --distributed-interface, the job's backend) of a node's command."""
    _, job, node = cli.parse(list(plan.argv[1:]))
    return node.launch.cpu, node.launch.distributed_interface, job.distributed_backend


def probe_argv(job, plan):
    cpu, interface, backend = node_options(plan)
    master = job.url.split("//", 1)[1].rsplit(":", 1)[0].strip("[]")
    argv = [*module_argv("hetseq.launch.probe"), "--master", master]
    argv += ["--interface", interface] if interface else []
    argv += ["--backend", backend] if backend else []
    return cpu, argv


def ask(job, lines, transport, remote_dir, python, env, deadline=DEADLINE_S, only_gpus=False):
    """[Answer] of every node (of those whose line asks for GPUs with
    ``only_gpus``), probed in parallel; those without an answer within
    ``deadline`` seconds are stopped and say so. Ctrl-C stops them all."""
    answers, probes = [], []
    try:
        for plan, line in zip(job.nodes, lines):
            cpu, argv = probe_argv(job, plan)
            if only_gpus and cpu:
                continue
            answer = Answer(plan.label, plan.host, line.line, plan.slots, 0 if cpu else plan.slots)
            command, cwd = transport.command(plan.host, remote_dir, python, argv)
            answers.append(answer)
            probes.append(_Probe(answer, command, cwd, env, transport))
        end = time.monotonic() + deadline
        for probe in probes:
            probe.thread.join(max(0.0, end - time.monotonic()))
    except KeyboardInterrupt:
        for probe in probes:
            probe.give_up(deadline)
        raise Interrupted("interrupted (Ctrl-C) while asking the hosts; nothing was "
                          "started") from None
    for probe in probes:
        probe.give_up(deadline)
    return answers


class Interrupted(UserError):
    exit_code = 130


class _Probe:
    def __init__(self, answer, command, cwd, env, transport):
        self.answer, self.transport, self.proc, self.done = answer, transport, None, False
        self.lock, self.gave_up = threading.Lock(), False
        self.output = ""
        try:
            self.proc = subprocess.Popen(command, cwd=cwd, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as err:
            answer.problems.append((f"could not start {command[0]}: {err.strerror or err}",
                                    "install it, or choose another --launcher"))
            self.done = True
        self.thread = threading.Thread(target=self._read, args=(env,), daemon=True)
        self.thread.start()

    def _read(self, env):
        if self.proc is None:
            return
        try:
            # (Its input stays open: the node wrapper stops its command when it ends.)
            self.proc.stdin.write((json.dumps({"env": env}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass
        self.output = _clean_lines(self.proc.stdout.read(OUTPUT_LIMIT))
        self.proc.stdout.close()
        code = self.proc.wait()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        with self.lock:
            if not self.gave_up:
                self._judge(code)
                self.done = True

    def give_up(self, deadline):
        with self.lock:
            if self.done:
                return
            self.gave_up = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.answer.problems.append((f"no answer within {deadline:.0f} s",
                                     "see that the host is up and its Python imports "
                                     "HetSeq and torch (try the ssh command of --dry-run)"))

    def _judge(self, code):
        answer, lines = self.answer, [s for s in self.output.splitlines() if s.strip()]
        reached = any(s.startswith(STARTED) for s in lines)
        said = [s for s in lines if not s.startswith((STARTED, PREFIX))]
        last = said[-1].strip() if said else f"exit {code}"
        facts = [s[len(PREFIX):] for s in lines if s.startswith(PREFIX)]
        if facts:
            try:
                said_facts = json.loads(facts[-1])
            except ValueError:
                said_facts = None
            unread = malformed(said_facts)
            if unread is None:
                answer.facts = said_facts
            else:
                answer.problems.append((f"its probe answered in a form this HetSeq does not "
                                        f"read ({unread}): another HetSeq version there?",
                                        "install the same HetSeq on every host"))
            return
        if not reached and self.transport.unreachable(code):
            answer.problems.append((f"could not be reached over ssh: {last}",
                                    "set up ssh to it (docs/nodes.md)" + local_hint(answer.host)))
        elif not reached:
            answer.problems.append((f"its node wrapper did not start: {last}",
                                    "check --remote-dir and --remote-python there"))
        else:
            answer.problems.append((f"the probe failed there: {last}",
                                    "install the same HetSeq (and torch) there, in "
                                    "--remote-dir, for --remote-python"))


# What a probe's answer holds (probe.facts): key -> the types its value may
# take. A host with another HetSeq may answer with other keys or types;
# that is a problem line, never a KeyError (a check exists to report skew).
_STR, _OPT_STR, _OPT_NUMBER = (str,), (str, type(None)), (int, float, type(None))
FACTS = {"hetseq": _STR, "code": _STR, "memory": _OPT_NUMBER, "torch": _OPT_STR,
         "cuda": (list,), "cuda_error": _OPT_STR, "interface": _OPT_STR,
         "interface_error": _OPT_STR}
OPTIONAL = {"host": _OPT_STR, "python": _OPT_STR, "hetseq_at": _OPT_STR,
            "torch_error": _OPT_STR}
DEVICE = {"name": _STR, "free": _OPT_NUMBER}


def malformed(facts):
    """What in a probe's answer ``facts`` is not of the expected form, or None."""
    if not isinstance(facts, dict):
        return f"expected an object of facts, got {type(facts).__name__}"
    for key, types in [*FACTS.items(), *OPTIONAL.items()]:
        if key not in facts:
            if key in FACTS:
                return f"no '{key}'"
            continue
        if not isinstance(facts[key], types):
            return f"'{key}' is {type(facts[key]).__name__}"
    for device in facts["cuda"]:
        if not isinstance(device, dict) or any(k not in device or not isinstance(device[k], t)
                                               for k, t in DEVICE.items()):
            return "a CUDA device of another form"
    return None


def _clean_lines(raw):
    return "\n".join(_clean(line) for line in raw.decode("utf-8", "replace").splitlines())


def missing_devices(answer):
    """(what, fix) when the line asks for more GPUs than the host has, else None."""
    facts = answer.facts
    if facts is None or not answer.gpus or len(facts.get("cuda") or []) >= answer.gpus:
        return None
    have = len(facts.get("cuda") or [])
    why = f" ({facts['cuda_error']})" if facts.get("cuda_error") else ""
    fix = f"add 'cpu' to hostfile line {answer.line} to run its {answer.slots} rank(s) on CPU"
    if have:
        fix += f", or write slots={have}"
    return (f"its line asks for {answer.gpus} GPU(s) (slots={answer.slots}, no 'cpu') and "
            f"torch there sees {have}{why}", fix)


def judge(answers):
    """Adds each answer's problems: devices, torch, interface, agreement."""
    first = next((a for a in answers if a.facts), None)
    for answer in answers:
        facts = answer.facts
        if facts is None:
            continue
        missing = missing_devices(answer)
        if missing:
            answer.problems.append(missing)
        if facts.get("torch") is None:
            answer.problems.append((f"torch does not import: {facts.get('torch_error')}",
                                    "install torch for --remote-python there"))
        if facts.get("interface_error"):
            answer.problems.append((facts["interface_error"], "see docs/nodes.md (network "
                                                              "interface)"))
        for key, what in (("hetseq", "HetSeq version"), ("code", "HetSeq code digest")):
            if facts.get(key) != first.facts.get(key):
                answer.problems.append((f"{what} {facts.get(key)}, but {first.label} has "
                                        f"{first.facts.get(key)}: the meeting point would "
                                        "refuse the job",
                                        "install the same HetSeq commit on every host"))
                break
        if facts.get("torch") != first.facts.get("torch"):
            answer.problems.append((f"torch {facts.get('torch')}, but {first.label} has "
                                    f"{first.facts.get('torch')}",
                                    "install the same torch version on every host"))


def _gb(count):
    return "?" if count is None else f"{count / 1e9:.1f} GB"


def table(answers):
    """The table's lines, one row per node."""
    rows = [("host", "asks", "has", "free memory", "interface", "HetSeq (code)", "torch", "")]
    for a in answers:
        asks = f"{a.slots} CPU" if not a.gpus else f"{a.gpus} GPU"
        f = a.facts or {}
        cuda = f.get("cuda") or []
        has = "-" if not f else f"{len(cuda)} GPU" if cuda else "CPU only"
        memory = _gb(f.get("memory")) if f else "-"
        if cuda:
            memory += " + GPU " + ", ".join(_gb(d.get("free")) for d in cuda)
        code = f"{f['hetseq']} ({f['code'][:8]})" if f else "-"
        rows.append((a.label, asks, has, memory, f.get("interface") or "-", code,
                     f.get("torch") or "-", "ok" if not a.problems else "PROBLEM"))
    rows = [tuple(_clean(c) for c in r) for r in rows]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def run(job, lines, transport, args, env, deadline=DEADLINE_S):
    """``--check``: prints the table and every problem; returns the exit code."""
    print(f"hetseq-launch --check: {len(job.nodes)} node(s), meeting at {job.url}", flush=True)
    answers = ask(job, lines, transport, args.remote_dir, args.remote_python, env, deadline)
    judge(answers)
    for row in table(answers):
        print(row)
    problems = [(a, what, fix) for a in answers for what, fix in a.problems]
    for answer, what, fix in problems:
        print(f"hetseq-launch: {answer.label} (hostfile line {answer.line}): {_clean(what)}; "
              f"fix: {fix}")
    if problems:
        print(f"hetseq-launch: --check: {len({a.label for a, _, _ in problems})} of "
              f"{len(answers)} node(s) cannot run their part", flush=True)
        return NOT_READY
    print("hetseq-launch: --check: every node can run its part", flush=True)
    return 0


def refuse_missing_devices(job, lines, transport, args, env, deadline=DEADLINE_S):
    """Before a launch: a line that asks for GPUs on a host without them is
    a UserError naming the line and the fix. Only such lines are probed (no
    cost to a CPU job); a host that does not answer is left to the launch."""
    answers = ask(job, lines, transport, args.remote_dir, args.remote_python, env, deadline,
                  only_gpus=True)
    for answer in answers:
        missing = missing_devices(answer)
        if missing:
            raise UserError(f"hostfile line {answer.line} ({answer.label}): {_clean(missing[0])}; "
                            f"fix: {missing[1]} (hetseq-launch --check shows every host)")
