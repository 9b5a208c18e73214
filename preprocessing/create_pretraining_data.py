#!/usr/bin/env python
"""Raw text files -> NVIDIA-format BERT HDF5 shards (train and test by name).

    python preprocessing/create_pretraining_data.py --input corpus/*.txt \
        --output-dir preprocessing/test_128 --vocab uncased_L-12_H-768_A-12/vocab.txt \
        --max-seq-length 128 --max-predictions-per-seq 20 --num-workers 2

Input: documents separated by blank lines, a sentence or a paragraph per line.
Each input file becomes ``{prefix}_train_{i}.hdf5`` and ``{prefix}_test_{i}.hdf5``
(a ``--test-fraction`` of its documents), so split big corpora into several
files to use all cores. Without ``--vocab`` a WordPiece vocab of
``--vocab-size`` is trained on the input and written next to the shards.
"""

import argparse
import glob
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from hetseq.bert.preprocess import Settings, create_pretraining_data  # noqa: E402
from hetseq.base.errors import UserError  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True,
                   help="text files, folders (all *.txt inside) or glob patterns")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--vocab", "--dict", help="WordPiece vocab.txt (default: train one)")
    p.add_argument("--vocab-size", type=int, default=30522, help="size of a trained vocab")
    p.add_argument("--cased", action="store_true", help="keep case (default: lower-case)")
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--dupe-factor", type=int, default=5)
    p.add_argument("--test-fraction", type=float, default=0.02,
                   help="share of documents written to the test shards")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--prefix", default="corpus", help="shard file name prefix")
    p.add_argument("--num-workers", type=int, default=os.cpu_count() or 1)
    return p.parse_args(argv)


def expand_inputs(patterns):
    files = []
    for pattern in patterns:
        if os.path.isdir(pattern):
            files += sorted(glob.glob(os.path.join(pattern, "*.txt")))
        else:
            files += sorted(glob.glob(pattern)) or [pattern]
    return files


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    settings = Settings(max_seq_length=args.max_seq_length,
                        max_predictions_per_seq=args.max_predictions_per_seq,
                        masked_lm_prob=args.masked_lm_prob, short_seq_prob=args.short_seq_prob,
                        dupe_factor=args.dupe_factor, seed=args.seed,
                        test_fraction=args.test_fraction, lowercase=not args.cased)
    try:
        vocab, counts = create_pretraining_data(
            expand_inputs(args.input), args.output_dir, vocab=args.vocab,
            vocab_size=args.vocab_size, settings=settings, num_workers=args.num_workers,
            prefix=args.prefix)
    except UserError as err:
        logging.error("error: %s", err)
        sys.exit(2)
    logging.info("wrote %s sequences to %s (vocab %s)", counts, args.output_dir, vocab)


if __name__ == "__main__":
    main()
