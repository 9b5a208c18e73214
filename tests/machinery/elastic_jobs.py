"""Elastic jobs as tests start them (docs/elastic.md): the job's flags and
secret, one node on a namespace host, its end, and the lines that show a
change of members."""

from machinery.commands import start_nodes
from machinery.in_process import alone
from machinery.parity import COMMON
from machinery.watched import Watched

SECRET = "5f0c1d2e3b4a69788796a5b4c3d2e1f0"
INVITED = {"HETSEQ_JOB_SECRET": SECRET}
UPDATES = 100
# The command: B = 48, every node --max-sentences 16.
# Heartbeats of 3 s (the default is 5): a frozen or cut-off member is told
# 2 s sooner, with room for a starved watchdog on CI's 2 cores.
ELASTIC = ["--max-update", UPDATES, "--elastic", "--min-nodes", 2, "--global-batch-size", 48,
           "--max-sentences", 16, "--distributed-gpus", 1, "--distributed-timeout", 10,
           "--heartbeat-timeout", 3, "--log-format", "simple", "--log-interval", 1,
           "--toy-sample-ms", 6]


def reference(updates=UPDATES):
    """One process with the whole global batch of 48."""
    return alone(*COMMON, "--max-update", updates, "--max-sentences", 48)["model"]


def node(cluster, host, url, save, *extra, env=INVITED):
    """One elastic node on namespace host ``host`` (None: this host)."""
    command = [*COMMON, *ELASTIC, "--distributed-init-method", url, "--save-dir", save, *extra]
    return Watched(start_nodes([command], cluster, on=None if cluster is None else [host],
                               env=env)[0])


def finish_ok(*nodes):
    outputs = []
    for watched in nodes:
        code, out = watched.finish(240)
        assert code == 0, out[-4000:]
        outputs.append(out)
    return outputs


def new_rank_0(outputs, after):
    """Index of the output whose generation line saying ``after`` made it rank 0."""
    ranked = [i for i, out in enumerate(outputs) if any(
        after in line and "this node is rank 0" in line for line in out.splitlines())]
    assert len(ranked) == 1, [out[-2000:] for out in outputs]
    return ranked[0]


def changed(host, how):
    """The survivors' line for a membership change (not the first generation's)."""
    return rf"generation [2-9]\d*: .*{how}: [^;]*{host} \("
