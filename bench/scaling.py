"""A scaling model past one machine, measured on namespace hosts (root needed).

1. Measure, on 2 and 3 hosts (bench/scaling_worker.py, one CPU rank per host)
   at 100 Mbit/s, 1 Gbit/s and 10 Gbit/s links: gloo all-reduce times of
   several sizes up to the default BERT's gradient, and DDP steps of that
   BERT with and without gradient communication.
2. Fit the ring all-reduce cost t = 2(W-1)/W * bytes / bandwidth + latency per
   link rate, and how much communication DDP hides behind the backward pass:
   eta = hidden time / backward time, calibrated on 2 hosts at 100 Mbit/s
   (where communication outlasts the backward pass), never more than the
   bytes outside DDP's last bucket (which only starts when backward ends).
3. Check the model: predict every other measured (rate, hosts) step time.
4. Predict weak-scaling efficiency (update time with no communication /
   update time) of BERT-base and BERT-large on the original HetSeq setting
   (nodes of 4 GPUs, 32 sequences per GPU, its measured 2.60 s per update of
   --update-freq 4 on one node), for 2..128 nodes and several link speeds,
   also for mixed nodes with HetSeq's balanced batches vs equal batches, and
   the link speed each needs for >= 0.9.
5. ``--slow-links``: the same model for the modes of bench/slowlink.py
   (PowerSGD, --local-steps with and without overlap, in float32, bfloat16
   and int8), checked against what that benchmark measured on 3 hosts, then
   BERT-base on 8-128 nodes over 1 Gbit/s (reads scaling.json and
   slowlink.json, measures nothing; writes scaling_slowlinks.json).

    python bench/scaling.py [--quick] [--out bench/results/scaling.json] [--plot bench/results/scaling.png]
    python bench/scaling.py --slow-links
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "tests"))      # machinery: the test helpers

from hetseq.bert.demo import MODEL, VOCAB_SIZE  # noqa: E402
from hetseq.bert.model import BertConfig, BertForPreTraining  # noqa: E402
from machinery import cluster as netns  # noqa: E402

RATES = {"100mbit": 0.1e9, "1gbit": 1e9, "10gbit": 10e9}   # bits per second
HERE = os.path.dirname(os.path.abspath(__file__))
# The original HetSeq's BERT-base table (its README): nodes of 4 GPUs, 32
# sequences per GPU, --update-freq 4; seconds per update and efficiency.
PAPER = {"step_s": {1: 2.60, 2: 2.69, 4: 2.794, 8: 3.126},
         "efficiency": {2: 0.86, 4: 0.81, 8: 0.74}}
NODES = [1, 2, 4, 8, 32, 128]


# ---- measuring ----

def measure(cluster, hosts, args):
    """One worker run on the first ``hosts`` hosts; rank 0's JSON."""
    argv = [sys.executable, os.path.join(HERE, "scaling_worker.py"), "--world", hosts,
            "--port", 29500 + measure.runs, "--batch", args.batch, "--steps", args.steps,
            "--reps", args.reps, "--master", cluster.addresses[0], "--sizes-mb", 1, 4]
    measure.runs += 1
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    procs = [cluster.popen(rank, [*argv, "--rank", rank], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True) for rank in range(hosts)]
    outs = [proc.communicate(timeout=900)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise RuntimeError(f"worker failed on {hosts} hosts: {outs}")
    return json.loads(outs[0].strip().splitlines()[-1])


measure.runs = 0


def measure_all(args):
    runs = []
    with netns.VirtualCluster(3) as cluster:
        for rate in RATES:
            cluster.set_rate(rate)
            for hosts in (2, 3):
                start = time.monotonic()
                row = {"rate": rate, "hosts": hosts, **measure(cluster, hosts, args)}
                print(f"measured {rate} x {hosts} hosts in {time.monotonic() - start:.0f} s",
                      file=sys.stderr)
                runs.append(row)
    return runs


# ---- the model ----

def ring_factor(world):
    return 2 * (world - 1) / world


def fit_link(runs, rate):
    """Least squares of t = ring_factor * bytes / bandwidth + latency."""
    points = [(ring_factor(r["hosts"]) * size, t) for r in runs if r["rate"] == rate
              for size, t in r["all_reduce"]]
    xs, ts = zip(*points)
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in points) / sum((x - mx) ** 2 for x in xs)
    return {"bandwidth_Bps": 1 / slope, "latency_s": mt - slope * mx,
            "of_nominal": 8 / slope / RATES[rate]}


def all_reduce_s(link, world, size):
    return ring_factor(world) * size / link["bandwidth_Bps"] + link["latency_s"]


def tail_fraction(model, bucket_cap_mb, first_bucket_mb=1.0):
    """Share of gradient bytes in DDP's last bucket (filled in reverse parameter
    order): it is ready only when backward ends, so it is never hidden."""
    sizes = [p.numel() * 4 for p in reversed(list(model.parameters()))]
    buckets, cap, current = [], first_bucket_mb * 2**20, 0
    for size in sizes:
        current += size
        if current >= cap:
            buckets.append(current)
            current, cap = 0, bucket_cap_mb * 2**20
    if current:
        buckets.append(current)
    return buckets[-1] / sum(sizes)


def update_s(compute, backward, comm, eta, tail):
    """Step time: compute plus the communication that overlap cannot hide."""
    hidden = min(comm * (1 - tail), eta * backward)
    return compute + comm - hidden


def bert(size):
    dims = {"base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                         intermediate_size=3072),
            "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                          intermediate_size=4096)}[size]
    with torch.device("meta"):
        return BertForPreTraining(BertConfig(vocab_size=30522, **dims))


def calibrate(runs, links, tiny_tail):
    """eta from 2 hosts at 100 Mbit/s; then every measured step predicted."""
    anchor = next(r for r in runs if r["rate"] == "100mbit" and r["hosts"] == 2)
    comm = all_reduce_s(links["100mbit"], 2, anchor["grad_bytes"])
    hidden = comm + anchor["step_no_comm_s"] - anchor["step_s"]
    eta = min(1.0, max(0.0, hidden / anchor["backward_s"]))
    checks = []
    for run in runs:
        comm = all_reduce_s(links[run["rate"]], run["hosts"], run["grad_bytes"])
        predicted = update_s(run["step_no_comm_s"], run["backward_s"], comm, eta, tiny_tail)
        checks.append({"rate": run["rate"], "hosts": run["hosts"], "comm_s": comm,
                       "step_no_comm_s": run["step_no_comm_s"], "measured_step_s": run["step_s"],
                       "predicted_step_s": predicted,
                       "measured_efficiency": run["step_no_comm_s"] / run["step_s"],
                       "predicted_efficiency": run["step_no_comm_s"] / predicted,
                       "error": predicted / run["step_s"] - 1, "calibration": run is anchor})
    return eta, checks


# ---- predictions for GPU clusters ----

def step_time(spec, link_bps, nodes, update_freq, micro_s):
    """One update of ``update_freq`` micro-batches per GPU taking ``micro_s`` each;
    only the last micro-batch's backward (2/3 of it) can hide communication.
    One node is the baseline (its intra-node all-reduce is inside ``micro_s``)."""
    link = {"bandwidth_Bps": link_bps * spec["link_eff"] / 8, "latency_s": spec["latency"]}
    comm = all_reduce_s(link, nodes * spec["gpus"], spec["bytes"]) if nodes > 1 else 0.0
    return update_s(update_freq * micro_s, 2 / 3 * micro_s, comm, spec["eta"], spec["tail"])


def efficiency(spec, link_bps, nodes, update_freq, micro_s):
    """Weak scaling: samples/s of ``nodes`` nodes over ``nodes`` x one node's."""
    return update_freq * micro_s / step_time(spec, link_bps, nodes, update_freq, micro_s)


def needed_link(spec, target, nodes, update_freq, micro_s):
    """Smallest link (bit/s) reaching ``target`` efficiency (bisection in log space)."""
    low, high = 1e7, 1e13
    if efficiency(spec, high, nodes, update_freq, micro_s) < target:
        return None
    for _ in range(60):
        mid = (low * high) ** 0.5
        if efficiency(spec, mid, nodes, update_freq, micro_s) < target:
            low = mid
        else:
            high = mid
    return high


def model_spec(size, eta, link_eff, latency, gpus=4):
    model = bert(size)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "bytes": params * 4, "tail": tail_fraction(model, 25), "eta": eta,
            "link_eff": link_eff, "latency": latency, "gpus": gpus}


def predict(eta, link_eff, latency):
    micro_base = PAPER["step_s"][1] / 4    # one micro-batch of 32 on the paper's GPUs
    base_params = model_spec("base", eta, link_eff, latency)["params"]
    out = {"assumptions": {"gpus_per_node": 4, "sequences_per_gpu": 32,
                           "micro_batch_s_bert_base": micro_base, "link_efficiency": link_eff,
                           "latency_s": latency, "eta": eta, "gradients": "fp32"}}
    for size in ("base", "large"):
        spec = model_spec(size, eta, link_eff, latency)
        micro = micro_base * spec["params"] / base_params   # compute scales with parameters
        table = {f"{gbit}gbit_update_freq{freq}": {
                     n: round(efficiency(spec, gbit * 1e9, n, freq, micro), 3) for n in NODES}
                 for gbit in (1, 10, 25, 100) for freq in (1, 4)}
        needed = {f"{n}_nodes_update_freq{freq}": needed_link(spec, 0.9, n, freq, micro)
                  for n in (2, 8, 32, 128) for freq in (1, 4)}
        out[f"bert_{size}"] = {
            "params": spec["params"], "tail_fraction": round(spec["tail"], 3),
            "micro_batch_s": micro, "efficiency": table,
            "link_gbit_for_0.9": {k: v and round(v / 1e9, 2) for k, v in needed.items()}}
    out["mixed_nodes_bert_base_10gbit"] = mixed(eta, link_eff, latency, micro_base)
    return out


def mixed(eta, link_eff, latency, micro_s):
    """Nodes in pairs: 4 GPUs at the paper's speed + 2 GPUs at half that speed
    (3 GPUs a node on average), 10 Gbit/s, BERT-base, --update-freq 4.
    Efficiency against the sum of every GPU's standalone rate. Balanced
    batches (HetSeq --capacity auto: 32 vs 16 a micro-batch) finish together;
    equal batches (32 each) wait for the slow GPUs."""
    spec = model_spec("base", eta, link_eff, latency, gpus=3)
    rows = {}
    for nodes in NODES[1:]:
        fast, slow = 2 * nodes, nodes
        ideal = (32 * fast + 16 * slow) / micro_s
        balanced = efficiency(spec, 10e9, nodes, 4, micro_s)
        equal = 4 * 32 * (fast + slow) / step_time(spec, 10e9, nodes, 4, 2 * micro_s) / ideal
        rows[nodes] = {"balanced": round(balanced, 3), "equal": round(equal, 3)}
    return rows


def compare_with_paper(prediction):
    """The paper's BERT-base runs at --update-freq 4: its efficiency and its
    per-update slowdown (1-node step time / N-node step time)."""
    rows = {}
    for gbit in (1, 10):
        ours = prediction["bert_base"]["efficiency"][f"{gbit}gbit_update_freq4"]
        rows[f"predicted_{gbit}gbit"] = {n: ours[n] for n in (2, 4, 8)}
    rows["paper_efficiency"] = PAPER["efficiency"]
    rows["paper_step_ratio"] = {n: round(PAPER["step_s"][1] / PAPER["step_s"][n], 3)
                                for n in (2, 4, 8)}
    return rows


def plot(prediction, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: pip install matplotlib for the plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, size in zip(axes, ("base", "large")):
        table = prediction[f"bert_{size}"]["efficiency"]
        for key, values in table.items():
            if key.endswith("update_freq4") or key.startswith(("1gbit", "10gbit")):
                style = "-" if key.endswith("freq4") else "--"
                ax.plot(NODES, [values[n] for n in NODES], style, marker="o", ms=3,
                        label=key.replace("_update_freq", ", update-freq "))
        if size == "base":
            ax.plot(list(PAPER["efficiency"]), list(PAPER["efficiency"].values()), "k*", ms=10,
                    label="original HetSeq, measured")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("nodes (4 GPUs each)")
        ax.set_title(f"BERT-{size}: predicted weak-scaling efficiency")
        ax.axhline(0.9, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("efficiency")
    axes[1].legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ---- slow links: what each mode sends per update (bench/slowlink.py) ----

CODEC_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1 + 4 / 256}   # per value (int8: + scales)


def powersgd_bytes(model, rank, min_compression=2.0):
    """Bytes PowerSGD all-reduces per update: (m + n) R per matrix worth
    compressing (PyTorch's rule), the rest whole; fp32."""
    total = 0
    for p in model.parameters():
        if p.dim() >= 2:
            m, n = p.shape[0], p.numel() // p.shape[0]
            r = min(m, n, rank)
            if (m + n) * r * min_compression < m * n:
                total += (m + n) * r * 4
                continue
        total += p.numel() * 4
    return total


def mode_update_s(mode, spec, link, world, compute, backward):
    """Seconds per update (one global batch) of ``mode``: {"kind": "sync" |
    "powersgd" | "local", "local_steps": H, "overlap": bool, "dtype": ...}."""
    if mode["kind"] == "sync":
        return update_s(compute, backward, all_reduce_s(link, world, spec["bytes"]), spec["eta"],
                        spec["tail"])
    if mode["kind"] == "powersgd":
        comm = all_reduce_s(link, world, spec["powersgd_bytes"]) + link["latency_s"]  # P, then Q
        return update_s(compute, backward, comm, spec["eta"], spec["tail"])
    exchange = all_reduce_s(link, world, spec["params"] * CODEC_BYTES[mode["dtype"]])
    h = mode["local_steps"]
    # Overlapped, a round's exchange runs beside the next round's compute.
    return max(compute, exchange / h) if mode["overlap"] else compute + exchange / h


def slowlink_modes():
    modes = {"sync": {"kind": "sync"}, "powersgd": {"kind": "powersgd"}}
    for h in (8, 32, 128):
        for overlap in (False, True):
            modes[f"local{h}{'_overlap' if overlap else ''}"] = {
                "kind": "local", "local_steps": h, "overlap": overlap, "dtype": "float32"}
    for dtype in ("bfloat16", "int8"):
        modes[f"local32_{dtype}"] = {"kind": "local", "local_steps": 32, "overlap": False,
                                     "dtype": dtype}
    return modes


def slow_links(scaling, slowlink):
    """The model against slowlink.json's 3 hosts, then BERT-base predicted."""
    links = {rate: scaling["links"][rate] for rate in ("100mbit", "1gbit")}
    tiny = BertForPreTraining(BertConfig(vocab_size=VOCAB_SIZE, **MODEL))
    hosts, batch = slowlink["setup"]["hosts"], slowlink["setup"]["batch_per_rank"]
    # One update's compute on a host, from the hosts alone at the same time.
    compute = statistics.fmean(batch / rate for rate in slowlink["ideal"]["per_host"])
    params = sum(p.numel() for p in tiny.parameters())
    spec = {"params": params, "bytes": params * 4, "eta": scaling["eta"],
            "tail": tail_fraction(tiny, 25), "powersgd_bytes": powersgd_bytes(tiny, 4)}
    checks = {}
    for key, run in slowlink["runs"].items():
        rate, name = key.split(" ")
        mode = slowlink_modes()[name]
        predicted = compute / mode_update_s(mode, spec, links[rate], hosts, compute,
                                            2 / 3 * compute)
        checks[key] = {"measured": round(run["fraction_of_ideal"], 3),
                       "predicted": round(predicted, 3)}
    return {"check_3_hosts": checks,
            "check_mean_abs_error": round(statistics.fmean(
                abs(c["predicted"] - c["measured"]) for c in checks.values()), 3),
            "bert_base_1gbit": predict_slow_links(scaling)}


def predict_slow_links(scaling, nodes=(8, 32, 128)):
    """BERT-base, nodes of 4 GPUs, 32 sequences a GPU, 1 Gbit/s between nodes:
    efficiency of each mode at --update-freq 1 and 4."""
    links = scaling["links"]
    link = {"bandwidth_Bps": 1e9 * statistics.fmean(l["of_nominal"] for l in links.values()) / 8,
            "latency_s": statistics.median(l["latency_s"] for l in links.values())}
    base = bert("base")
    params = sum(p.numel() for p in base.parameters())
    spec = {"params": params, "bytes": params * 4, "eta": scaling["eta"],
            "tail": tail_fraction(base, 25), "powersgd_bytes": powersgd_bytes(base, 4)}
    micro = PAPER["step_s"][1] / 4
    out = {"powersgd_rank4_compression": round(spec["bytes"] / spec["powersgd_bytes"], 1)}
    for name, mode in slowlink_modes().items():
        out[name] = {f"update_freq{freq}": {
            n: round(freq * micro / mode_update_s(mode, spec, link, 4 * n, freq * micro,
                                                  2 / 3 * micro), 3) for n in nodes}
            for freq in (1, 4)}
    return out


def main_slow_links():
    with open(os.path.join(HERE, "results", "scaling.json")) as f:
        scaling = json.load(f)
    with open(os.path.join(HERE, "results", "slowlink.json")) as f:
        slowlink = json.load(f)
    result = slow_links(scaling, slowlink)
    with open(os.path.join(HERE, "results", "scaling_slowlinks.json"), "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps(result, indent=1))


def main():
    if "--slow-links" in sys.argv:
        return main_slow_links()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=6, help="step pairs (with/without comm)")
    parser.add_argument("--reps", type=int, default=3, help="timed all-reduces per size")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "scaling.json"))
    parser.add_argument("--plot", default=os.path.join(HERE, "results", "scaling.png"))
    args = parser.parse_args()
    ok, why = netns.available()
    if not ok:
        sys.exit(f"bench/scaling.py needs namespace hosts: {why}")
    netns.remove_stale()
    runs = measure_all(args)
    links = {rate: fit_link(runs, rate) for rate in RATES}
    tiny = BertForPreTraining(BertConfig(vocab_size=VOCAB_SIZE, **MODEL))
    eta, checks = calibrate(runs, links, tail_fraction(tiny, runs[0]["bucket_cap_mb"]))
    latency = statistics.median(link["latency_s"] for link in links.values())
    prediction = predict(eta, statistics.fmean(l["of_nominal"] for l in links.values()), latency)
    errors = [abs(c["error"]) for c in checks if not c["calibration"]]
    result = {"measured": runs, "links": links, "eta": eta, "model_check": checks,
              "model_check_mean_abs_error": statistics.fmean(errors),
              "model_check_max_abs_error": max(errors),
              "prediction": prediction, "paper": compare_with_paper(prediction)}
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    plot(prediction, args.plot)
    print(json.dumps({k: result[k] for k in ("links", "eta", "model_check_mean_abs_error",
                                             "model_check_max_abs_error", "paper")}, indent=1))


if __name__ == "__main__":
    main()
