"""Slow links: synchronous updates, PowerSGD and local steps on rate-limited hosts.

Three namespace hosts (tests/machinery/cluster.py, root needed), one CPU rank
each, joined by links of 100 Mbit/s and of 1 Gbit/s; the default BERT on the
demo corpus (5.4 M parameters: 22 MB of gradient per exchange in float32),
8 sequences per rank, global batch 24.

For each link and mode (synchronous; ``--grad-compression powersgd``;
``--local-steps`` 8/32/128 with and without ``--outer-overlap``; rounds of 32
exchanged in bfloat16 and int8), one run of --updates updates
(the synchronous modes at 100 Mbit/s, --sync-updates: throughput only):

- samples/s from rank 0's log, from its first logged update (or round) to
  its last, as a fraction of the IDEAL: the summed rates of the three hosts
  training alone at the same time (world size 1 each: the same sharing of the
  two cores, no communication);
- the training loss at every logged update or round against samples seen, and
  the validation loss at the end, against the synchronous run's after the same
  samples (1 Gbit/s: every mode runs --updates).

Then a mix of speeds at 100 Mbit/s: host C computes 2x slower
(bench/tasks/slowed_bert.py), rounds of 32, HetSeq's measured split
(``--capacity auto``) against equal shares, each against the ideal of that mix.

Then QUALITY: rounds of 32 with the default outer step at the job's own
learning rate (two of them, --warmup-updates 8) and on an even (8+8+8) and
an uneven (4+8+12) split, validated every round: the validation loss against
the synchronous run's after the same samples (the synchronous run at 1 Gbit/s:
the same mathematics, sooner), and against the synchronous run's at the same
wall time over 100 Mbit/s. Seconds are samples over each mode's samples/s at
100 Mbit/s (the synchronous mode's from a short run on that split; local
steps' from the run itself, validations included: against them).

    python bench/slowlink.py --out bench/results/slowlink.json --png bench/results/slowlink.png \
        --quality-png bench/results/slowlink_quality.png
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "tests"))      # machinery: the test helpers

from bench.output import emit  # noqa: E402
from machinery import cluster as netns  # noqa: E402
from machinery.watched import Watched  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = 3
LINKS = ("100mbit", "1gbit")
SYNC = ("sync", "powersgd")
MODES = {
    "sync": [],
    "powersgd": ["--grad-compression", "powersgd", "--powersgd-rank", 4],
    **{f"local{h}{suffix}": ["--local-steps", h, *flags] for h in (8, 32, 128)
       for suffix, flags in (("", []), ("_overlap", ["--outer-overlap"]))},
    "local32_bfloat16": ["--local-steps", 32, "--outer-dtype", "bfloat16"],
    "local32_int8": ["--local-steps", 32, "--outer-dtype", "int8"],
}
POWERSGD_START = 10         # its default
LOGGED = re.compile(r"\| epoch \d+ \| update [\d/]+ (?:\| [^|=]+ )?\| loss=([\d.]+) \|.*"
                    r"\| sample_size=([\d.]+) \|")
VALID = re.compile(r"valid on 'valid' \| epoch \d+ \| loss=([\d.]+).*\| update (\d+)")
QUALITY_SPLITS = {"even": (8, 8, 8), "uneven": (4, 8, 12)}
ROUND = 32                  # the quality runs' --local-steps, and their validation interval


def node_argv(args, updates, save, flags, world=HOSTS, rank=0, url=None, batch=None):
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--task", "bert-slowed",
            "--user-dir", os.path.join(ROOT, "bench", "tasks"), "--cpu",
            "--max-sentences", batch or args.batch, "--max-update", updates, "--log-format", "simple",
            "--log-interval", 1, "--no-progress-bar", "--no-save", "--save-dir", save,
            "--distributed-timeout", 900, *flags]
    if world > 1:
        argv += ["--distributed-world-size", world, "--distributed-rank", rank,
                 "--distributed-gpus", 1, "--distributed-init-method", url]
    return [str(a) for a in argv]


def start(cluster, host, argv):
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT,
           "HOME": os.environ.get("HOME", "/root")}
    proc = cluster.popen(host, argv, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    return Watched(proc)


def read(node, skip=1):
    """(samples/s from logged update ``skip`` to the last, [(samples seen, loss)],
    [(update, validation loss)]) of one node's log."""
    logged = [(t, float(m.group(1)), float(m.group(2))) for t, line in node.stamped
              if (m := LOGGED.search(line))]
    curve, seen = [], 0.0
    for _, loss, samples in logged:
        seen += samples
        curve.append((seen, loss))
    rate = None
    if len(logged) > skip:
        rate = sum(s for _, _, s in logged[skip:]) / (logged[-1][0] - logged[skip - 1][0])
    valid = [(int(m.group(2)), float(m.group(1))) for _, line in node.stamped
             if (m := VALID.search(line))]
    return rate, curve, valid


def finish(nodes, timeout):
    for node in nodes:
        node.finish(timeout)
        if node.proc.returncode != 0:
            raise RuntimeError(f"a node failed ({node.proc.returncode}):\n" +
                               "".join(node.lines[-30:]))


def ideal(cluster, args, folder, slow=None):
    """The hosts alone at the same time: the sum of their samples/s."""
    nodes = [start(cluster, h, node_argv(args, args.ideal_updates, f"{folder}/alone{h}",
                                         ["--disable-validation", *_slowed(h, slow)], world=1))
             for h in range(HOSTS)]
    finish(nodes, args.timeout)
    rates = [read(node)[0] for node in nodes]
    return {"samples_per_s": sum(rates), "per_host": rates}


def _slowed(host, slow):
    return ["--bench-slowdown", 2] if host == slow else []


def job(cluster, args, folder, name, flags, updates, slow=None, skip=1, batches=None):
    url = f"tcp://{cluster.addresses[0]}:29810"
    began = time.monotonic()
    nodes = [start(cluster, h, node_argv(args, updates, f"{folder}/{name}{h}",
                                         [*flags, *_slowed(h, slow)], rank=h, url=url,
                                         batch=batches[h] if batches else None))
             for h in range(HOSTS)]
    finish(nodes, args.timeout)
    rate, curve, valid = read(nodes[0], skip)
    last = valid[-1][1] if valid else None
    print(f"{name}: {rate:.2f} samples/s, valid loss {last}, {time.monotonic() - began:.0f} s",
          file=sys.stderr, flush=True)
    return {"samples_per_s": rate, "updates": updates, "valid_loss": last, "curve": curve,
            "valid": valid}


def measure(args):
    runs, folder = {}, tempfile.mkdtemp(prefix="hetseq-slowlink-")
    with netns.VirtualCluster(HOSTS, rate="1gbit") as cluster:
        if args.only_quality:
            return {"quality": quality(cluster, args, folder)}
        base = ideal(cluster, args, folder)
        for link in args.links:
            cluster.set_rate(link)
            for name in args.modes:
                updates = args.sync_updates if link == "100mbit" and name in SYNC else \
                    args.updates
                if link == "1gbit" and name in ("local32_bfloat16", "local32_int8"):
                    continue   # the codecs' throughput matters on the slow link; loss is the same
                # PowerSGD's first updates are plain all-reduces (--powersgd-start).
                run = job(cluster, args, folder, f"{link}-{name}", MODES[name], updates,
                          skip=POWERSGD_START + 1 if name == "powersgd" else 1)
                run["fraction_of_ideal"] = run["samples_per_s"] / base["samples_per_s"]
                runs[f"{link} {name}"] = run
        mix = mixed(cluster, args, folder) if args.mix else None
        found = quality(cluster, args, folder) if args.quality else None
    return {"ideal": base, "runs": runs, "mix": mix, "quality": found}


def mixed(cluster, args, folder):
    """Host C 2x slower, rounds of 32 at 100 Mbit/s: measured split against equal shares."""
    cluster.set_rate("100mbit")
    base = ideal(cluster, args, folder, slow=2)
    rounds = ["--local-steps", 32]
    out = {"ideal": base}
    for name, flags in (("hetseq_split", ["--capacity", "auto", "--global-batch-size",
                                          HOSTS * args.batch]),
                        ("equal_shares", ["--capacity", "equal", "--global-batch-size",
                                          HOSTS * args.batch])):
        run = job(cluster, args, folder, f"mix-{name}", [*rounds, *flags], args.mix_updates,
                  slow=2)
        run["fraction_of_ideal"] = run["samples_per_s"] / base["samples_per_s"]
        out[name] = run
    out["hetseq_over_equal"] = out["hetseq_split"]["samples_per_s"] / \
        out["equal_shares"]["samples_per_s"]
    return out


def quality(cluster, args, folder):
    """Rounds of 32 with the default outer step, at each --quality-lrs and
    split, against synchronous updates (module docstring)."""
    out = {}
    for split, batches in QUALITY_SPLITS.items():
        cluster.set_rate("100mbit")
        sync_rate = job(cluster, args, folder, f"q-{split}-sync-rate", ["--disable-validation"],
                        args.sync_updates, batches=batches)["samples_per_s"]
        for lr in args.quality_lrs:
            flags = ["--lr", lr, "--warmup-updates", 8, "--validate-interval-updates", ROUND]
            cluster.set_rate("1gbit")
            sync = job(cluster, args, folder, f"q-{split}-{lr}-sync", flags,
                       args.quality_updates, batches=batches)
            cluster.set_rate("100mbit")
            local = job(cluster, args, folder, f"q-{split}-{lr}-local",
                        ["--local-steps", ROUND, *flags], args.quality_updates, batches=batches)
            out[f"{split} lr {lr}"] = compare(sync, local, sync_rate, sum(batches))
    return out


def compare(sync, local, sync_rate, batch):
    """Local steps' validation loss over the synchronous run's: after the same
    samples (every round from the 8th), and at the same seconds over 100
    Mbit/s (where the synchronous run has validated: linear between its points)."""
    ours, theirs = dict(local["valid"]), dict(sync["valid"])
    same_samples = {u: ours[u] / theirs[u] for u in sorted(ours) if u in theirs and u >= 8 * ROUND}
    seconds = {"sync": [(u * batch / sync_rate, loss) for u, loss in sync["valid"]],
               "local": [(u * batch / local["samples_per_s"], loss) for u, loss in local["valid"]]}
    same_time = {}
    for t, loss in seconds["local"]:
        done = t * sync_rate / batch              # the synchronous run's updates by then
        below = [(u, v) for u, v in sync["valid"] if u <= done]
        above = [(u, v) for u, v in sync["valid"] if u > done]
        if below and above:
            (u0, v0), (u1, v1) = below[-1], above[0]
            same_time[round(t, 1)] = loss / (v0 + (v1 - v0) * (done - u0) / (u1 - u0))
    return {"sync_samples_per_s_100mbit": sync_rate,
            "local_samples_per_s_100mbit": local["samples_per_s"],
            "valid_vs_sync_same_samples": {u: round(r, 4) for u, r in same_samples.items()},
            "worst_vs_sync_from_round_8": round(max(same_samples.values()), 4),
            "valid_vs_sync_same_seconds": {t: round(r, 4) for t, r in same_time.items()},
            "lower_than_sync_at_same_seconds": all(r < 1 for r in same_time.values()),
            "seconds": seconds}


def plot_quality(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = result["quality"]
    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4.2), squeeze=False)
    for ax, (case, row) in zip(axes[0], cases.items()):
        for mode, style in (("sync", "-o"), ("local", "--s")):
            t, loss = zip(*row["seconds"][mode])
            label = "synchronous" if mode == "sync" else f"--local-steps {ROUND}"
            ax.plot(t, loss, style, markersize=3, label=label)
        ax.set_title(f"{case}: worst {row['worst_vs_sync_from_round_8']:.3f} x sync", fontsize=9)
        ax.set_xlabel("seconds over 100 Mbit/s")
        ax.set_ylabel("validation loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(result):
    """Fractions of the ideal per link and mode, and each mode's validation loss
    against the synchronous run's at 1 Gbit/s (the same samples)."""
    runs = result["runs"]
    sync = runs.get("1gbit sync", {}).get("valid_loss")
    table = {}
    for key, run in runs.items():
        link, mode = key.split(" ")
        row = table.setdefault(mode, {})
        row[f"{link}_fraction_of_ideal"] = round(run["fraction_of_ideal"], 3)
        if run["valid_loss"] is not None and run["updates"] == max(r["updates"] for r in
                                                                   runs.values()):
            row["valid_loss"] = run["valid_loss"]
            if sync:
                row["valid_loss_vs_sync"] = round(run["valid_loss"] / sync, 4)
    return table


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    table = result["summary"]
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(14, 5))
    modes = list(table)
    for i, link in enumerate(LINKS):
        values = [table[m].get(f"{link}_fraction_of_ideal", 0) for m in modes]
        bars.bar([x + 0.4 * i for x in range(len(modes))], values, width=0.4, label=link)
    bars.axhline(0.9, color="gray", linestyle="--", linewidth=1)
    bars.set_xticks([x + 0.2 for x in range(len(modes))], modes, rotation=40, ha="right")
    bars.set_ylabel("samples/s / ideal (3 hosts alone)")
    bars.set_title("Throughput, 3 hosts, default BERT")
    bars.legend()
    for key, run in result["runs"].items():
        if run["updates"] != max(r["updates"] for r in result["runs"].values()):
            continue
        seen, loss = zip(*run["curve"])
        style = "-" if "sync" in key else "--" if "overlap" in key else ":"
        curves.plot(seen, loss, style, label=f"{key} (valid {run['valid_loss']:.3f})")
    curves.set_xlabel("samples seen")
    curves.set_ylabel("training loss (per update or round)")
    curves.set_title("Loss against samples")
    curves.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--updates", type=int, default=256)
    parser.add_argument("--sync-updates", type=int, default=24,
                        help="updates of the synchronous modes at 100 Mbit/s (throughput only)")
    parser.add_argument("--ideal-updates", type=int, default=40)
    parser.add_argument("--mix-updates", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=LINKS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--no-mix", dest="mix", action="store_false")
    parser.add_argument("--no-quality", dest="quality", action="store_false")
    parser.add_argument("--only-quality", action="store_true",
                        help="only the QUALITY runs (with --merge: into an earlier result)")
    parser.add_argument("--quality-lrs", nargs="+", default=["1e-4", "5e-4"])
    parser.add_argument("--quality-updates", type=int, default=12 * ROUND)
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--merge", metavar="JSON",
                        help="add these runs to an earlier result (each against its own ideal)")
    parser.add_argument("--out")
    parser.add_argument("--png")
    parser.add_argument("--quality-png")
    args = parser.parse_args()
    ok, why = netns.available()
    if not ok:
        sys.exit(f"bench/slowlink.py {why}")
    netns.remove_stale()
    result = {"setup": {"hosts": HOSTS, "batch_per_rank": args.batch,
                        "global_batch": HOSTS * args.batch, "updates": args.updates,
                        "model": "default BERT (hidden 256, 4 layers, vocab 8192)"},
              **measure(args)}
    if args.merge:
        with open(args.merge) as f:
            earlier = json.load(f)
        earlier["runs"].update({key: {**run, "ideal": result["ideal"]["samples_per_s"]}
                                for key, run in result.get("runs", {}).items()})
        result = {**earlier, **{key: result.get(key) or earlier.get(key)
                                for key in ("mix", "quality")}}
    if "runs" in result:
        result["summary"] = summarize(result)
    if args.png:
        plot(result, args.png)
    if args.quality_png:
        plot_quality(result, args.quality_png)
    emit(result, args.out)


if __name__ == "__main__":
    main()
