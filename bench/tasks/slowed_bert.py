"""The default BERT with a host made slower, for bench/slowlink.py's mix of speeds.

``--bench-slowdown F`` (a node's own flag) makes this node F times slower: after
each forward it sleeps (F - 1) x 3 x the forward's time (a backward costs about
two forwards), before the backward, where the rank's compute clock counts it
(stats.py), as an older machine spends it. Sleeping costs no CPU, so three
hosts on two cores still compute as before.
"""

import time

from hetseq.tasks import register_task
from hetseq.tasks.bert_pretraining import BertTask


@register_task("bert-slowed")
class SlowedBert(BertTask):
    per_node_flags = BertTask.per_node_flags | {"bench_slowdown"}

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        parser.add_argument("--bench-slowdown", type=float, default=1.0, metavar="F",
                            help="this node computes F times slower (bench/slowlink.py)")

    def loss(self, model, sample):
        start = time.perf_counter()
        out = super().loss(model, sample)
        if model.training and self.args.bench_slowdown > 1:
            time.sleep((self.args.bench_slowdown - 1) * 3 * (time.perf_counter() - start))
        return out
