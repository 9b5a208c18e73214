#!/usr/bin/env python
"""HDF5 BERT loader: time to first batch and samples/s at 10k, 100k and 1M
sequences (length 128), against the rate the default BERT model consumes data.

Shards are written the way NVIDIA's recipe writes them (its dtypes, gzip,
h5py's default chunks; 100k sequences per file), once, under --workdir.
Prints JSON. Targets: first batch < 2 s at 1M; loader >= 10x the model.

    python bench/data.py [--sizes 10000,100000,1000000] [--workdir /tmp/hetseq-bench-data]
"""

import argparse
import json
import os
import sys
import time

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.data import GlobalBatches, GlobalBatchIterator  # noqa: E402
from hetseq.bert.pretraining_data import BertH5Dataset, find_shards  # noqa: E402
from hetseq.bert import BertConfig, BertForPreTraining  # noqa: E402

SEQ, PRED, VOCAB, PER_FILE = 128, 20, 30522, 100_000


def write_nvidia_shard(path, n, rng):
    lengths = rng.integers(64, SEQ + 1, n)
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype(np.int8)
    ids = rng.integers(1000, VOCAB, (n, SEQ), dtype=np.int32) * mask
    positions = np.sort(rng.integers(1, 64, (n, PRED)), 1).astype(np.int32)
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        for key, data, dtype in (("input_ids", ids, "i4"), ("input_mask", mask, "i1"),
                                 ("segment_ids", mask * (np.arange(SEQ) > 40), "i1"),
                                 ("masked_lm_positions", positions, "i4"),
                                 ("masked_lm_ids", rng.integers(1000, VOCAB, (n, PRED)), "i4"),
                                 ("next_sentence_labels", rng.integers(0, 2, n), "i1")):
            f.create_dataset(key, data=data, dtype=dtype, compression="gzip")
    os.replace(tmp, path)


def make_dataset(workdir, size):
    folder = os.path.join(workdir, f"n{size}")
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(size)
    for i, start in enumerate(range(0, size, PER_FILE)):
        path = os.path.join(folder, f"bench_training_{i}.hdf5")
        if not os.path.exists(path):
            write_nvidia_shard(path, min(PER_FILE, size - start), rng)
    return folder


def loader_rate(folder, batch, batches, workers):
    """(seconds to the first batch, samples/s over the next ``batches``), built
    the way the training loop builds it (one shard at a time, rows shuffled)."""
    start = time.perf_counter()
    data = BertH5Dataset(find_shards(folder, "train"))
    iterator = GlobalBatchIterator(data, data.collater, GlobalBatches.for_dataset(data, batch, 1),
                                   [batch], 0, num_workers=workers)
    steps = iterator.next_epoch_itr()
    next(steps)
    first = time.perf_counter() - start
    batches = min(batches, len(iterator) - 1)
    start = time.perf_counter()
    for _ in range(batches):
        next(steps)
    return first, batches * batch / (time.perf_counter() - start)


def model_rate(batch, steps=6):
    """Samples/s of forward+backward of the default BERT (4 layers, hidden 256)."""
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4,
                                          num_attention_heads=4, intermediate_size=1024,
                                          max_position_embeddings=SEQ))
    ids = torch.randint(5, 8192, (batch, SEQ))
    args = (ids, torch.zeros_like(ids), torch.ones_like(ids), torch.randint(1, SEQ, (batch, PRED)))
    for step in range(steps + 1):
        if step == 1:
            start = time.perf_counter()
        mlm, nsp = model(*args)
        (mlm.float().logsumexp(-1).sum() + nsp.sum()).backward()
    return steps * batch / (time.perf_counter() - start)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10000,100000,1000000")
    p.add_argument("--workdir", default="/tmp/hetseq-bench-data")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=7000,
                   help="batches timed after the first (7000 x 32 crosses two 100k shards)")
    p.add_argument("--workers", type=int, default=0, help="data-loader workers")
    opts = p.parse_args()
    model = model_rate(opts.batch)
    report = {"sequence_length": SEQ, "batch": opts.batch, "loader_workers": opts.workers,
              "model_samples_per_s": round(model, 1), "datasets": []}
    for size in map(int, opts.sizes.split(",")):
        folder = make_dataset(opts.workdir, size)
        first, rate = loader_rate(folder, opts.batch, opts.batches, opts.workers)
        report["datasets"].append({"sequences": size, "first_batch_s": round(first, 3),
                                   "loader_samples_per_s": round(rate, 1),
                                   "loader_over_model": round(rate / model, 1)})
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
