"""One node of a ``hetseq-launch`` job, as the launcher starts it on its host:
``python -m hetseq.launch.node -- PYTHON train.py FLAGS...``. It reads the
job secret and the forwarded variables as one JSON line on standard input
(never a command line), runs the command in a session of its own, and stops
that session (SIGTERM, SIGKILL ``STOP_S`` later) when its input closes. It
exits with the command's code (128 + N after signal N). docs/nodes.md,
"One command".
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading

STARTED = "hetseq-launch node started"   # the launcher reads (and hides) this line
STOP_S = 5.0
PR_SET_PDEATHSIG = 1
ENV_LIMIT = 1 << 20


def read_env(stream):
    """The variables of the first line of ``stream`` (bounded, checked)."""
    line = b""
    # The launcher writes this one line, then nothing until it closes the
    # input (the stop): a read never takes anything past it.
    while b"\n" not in line and len(line) < ENV_LIMIT:
        chunk = os.read(stream.fileno(), 1 << 16)
        if not chunk:
            break
        line += chunk
    line = line.split(b"\n", 1)[0]
    try:
        env = json.loads(line.decode("utf-8"))["env"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"hetseq.launch.node: expected a JSON line {{\"env\": {{...}}}} on "
                         f"standard input from hetseq-launch, got {len(line)} bytes that are not")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                            for k, v in env.items()):
        raise SystemExit("hetseq.launch.node: 'env' must map names to strings")
    return env


def die_with_parent():
    """In the command before exec: SIGKILL when this wrapper dies, even by
    SIGKILL (Linux's PR_SET_PDEATHSIG; this wrapper forks from its main
    thread, which lives as long as it does). Elsewhere nothing."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def exit_code(returncode):
    return 128 - returncode if returncode < 0 else returncode


def stop(proc):
    """SIGTERM to the command's session, SIGKILL after STOP_S."""
    for sig, wait in ((signal.SIGTERM, STOP_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            pass


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m hetseq.launch.node -- COMMAND... (started by "
                         "hetseq-launch, which sends the environment on standard input)")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **read_env(sys.stdin)}
    # Listening before the command starts: a stop that comes while it
    # starts still reaches it (ending.wait returns at once).
    ending = threading.Event()

    def on_signal(*_):
        ending.set()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, on_signal)

    def hold_stdin():
        # EOF: the launcher let go of this node, or its connection dropped.
        # (The descriptor itself: the buffered reader's lock, held by this
        # thread, would stop the interpreter's exit.)
        while os.read(sys.stdin.fileno(), 4096):
            pass
        ending.set()
    threading.Thread(target=hold_stdin, daemon=True).start()
    if ending.is_set():
        os._exit(exit_code(-signal.SIGTERM))
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=die_with_parent)
    try:
        print(f"{STARTED} (pid {proc.pid})", flush=True)
    except OSError:
        ending.set()          # nobody reads this node any more
    threading.Thread(target=lambda: (proc.wait(), ending.set()), daemon=True).start()
    ending.wait()
    if proc.poll() is None:
        stop(proc)
    # The command is done; what it left running in its session goes too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        sys.stdout.flush()
    except OSError:
        pass
    os._exit(exit_code(proc.wait()))


if __name__ == "__main__":
    main()
