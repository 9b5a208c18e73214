"""The job's identity at rendezvous: what every node must agree on before it may join.

Nodes are started by hand, from different shells: a node with other job
flags or code would silently damage the run. So each node presents
``JobConfig.identity()`` at rendezvous; rank 0 sets it, and a node whose
identity differs is refused before it claims a rank, the differing flags
named. ``NodeConfig`` (config.py) is not part of it. docs/checkpoints.md,
"Checked across nodes".
"""

import json
import time

from hetseq.base.errors import UserError
from hetseq.base.logs import printable

MAX_SHOWN = 256          # characters of a peer's words in a refusal


CODE = {"hetseq_code": "HetSeq's code (install the same version on every node)",
        "user_code": "the --user-dir's code (the same files on every node)"}


def _flag(name):
    return CODE.get(name, "--" + name.replace("_", "-"))


def differences(mine, theirs):
    """'--seed 2 here, 1 in the job; ...' for every flag that differs."""
    keys = sorted(set(mine) | set(theirs))
    return "; ".join(f"{_flag(k)} {mine.get(k)!r} here, {theirs.get(k)!r} in the job"
                     for k in keys if mine.get(k) != theirs.get(k))


def present(store, identity, rank, url, who, deadline):
    """Join the job at ``store`` with ``identity``, or refuse. Rank 0 defines the
    job (the first rank 0 to arrive, by an atomic compare-and-set; it serves a
    TCP store, so the job is where it is); other ranks wait for it until
    ``deadline`` and must match it. ``rank``: a number, or a name for a
    node that has none yet (--elastic)."""
    mine = json.dumps(identity, sort_keys=True)
    name = f"rank {rank}" if isinstance(rank, int) else rank   # "this node": --elastic
    if rank == 0:
        held = store.compare_set("hetseq/job", "", mine).decode("utf-8", "replace")
        if held == mine:
            store.compare_set("hetseq/job-by", "", who)
            return
    else:
        while not store.check(["hetseq/job"]):
            if time.monotonic() > deadline:
                raise UserError(f"{name} waited at {url} for rank 0, which defines the job, "
                                "until --distributed-timeout: start it, or check the address")
            time.sleep(0.05)
        held = store.get("hetseq/job").decode("utf-8", "replace")
        if held == mine:
            return
    # What the store holds was written by a peer: shown only printable (no
    # terminal escapes) and bounded, and read as whatever shape it has.
    founder = store.get("hetseq/job-by").decode("utf-8", "replace") \
        if store.check(["hetseq/job-by"]) else "?"
    try:
        theirs = json.loads(held)
    except (ValueError, RecursionError):      # (a peer's bytes: any nesting)
        theirs = None
    differ = (differences(identity, theirs) if isinstance(theirs, dict)
              else "the job's identity there is of another form (another HetSeq version?)")
    raise UserError(
        f"{name} refused by the job at {url} (started by {printable(founder[:MAX_SHOWN])}): "
        f"its flags differ: {printable(differ[:4 * MAX_SHOWN])}. Start every node with the "
        "same flags (only those listed in the README as per-node may differ), or use another "
        "--distributed-init-method for another job")
