#!/usr/bin/env python
"""Write a small MNIST-format data set of synthetic digits (no download).

Each image is a seven-segment style digit drawn with random size, position,
slant, stroke width, jitter and noise, so a model has to learn something
real. The files have MNIST's names and IDX format; real MNIST or
Fashion-MNIST files can replace them as they are.

    python examples/mnist/make_demo_data.py --out data/mnist-demo
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from idx import write_idx  # noqa: E402

# Segment ends in a unit box (x right, y down): a top, b/c right, d bottom,
# e/f left, g middle.
SEGMENTS = {"a": ((0, 0), (1, 0)), "b": ((1, 0), (1, .5)), "c": ((1, .5), (1, 1)),
            "d": ((0, 1), (1, 1)), "e": ((0, .5), (0, 1)), "f": ((0, 0), (0, .5)),
            "g": ((0, .5), (1, .5))}
DIGITS = ["abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgedc", "abc", "abcdefg", "abcdfg"]


def draw_digit(digit, rng):
    width, height = rng.uniform(8, 14), rng.uniform(14, 20)
    left, top = rng.uniform(3, 25 - width), rng.uniform(3, 25 - height)
    slant, thickness = rng.uniform(-0.3, 0.3), rng.uniform(1.0, 2.2)
    ys, xs = np.mgrid[0:28, 0:28].astype(np.float64)
    image = np.zeros((28, 28))
    for name in DIGITS[digit]:
        ends = np.array(SEGMENTS[name], dtype=np.float64) + rng.uniform(-0.06, 0.06, (2, 2))
        px = left + ends[:, 0] * width + slant * (1 - ends[:, 1]) * height * 0.5
        py = top + ends[:, 1] * height
        image = np.maximum(image, _stroke(xs, ys, px, py, thickness))
    image += rng.normal(0, 0.08, image.shape)
    return (np.clip(image, 0, 1) * 255).astype(np.uint8)


def _stroke(xs, ys, px, py, thickness):
    """Intensity of a line segment: 1 within ``thickness`` of it, fading over 1 px."""
    dx, dy = px[1] - px[0], py[1] - py[0]
    t = np.clip(((xs - px[0]) * dx + (ys - py[0]) * dy) / max(dx * dx + dy * dy, 1e-9), 0, 1)
    dist = np.hypot(xs - (px[0] + t * dx), ys - (py[0] + t * dy))
    return np.clip(1.0 - (dist - thickness), 0.0, 1.0)


def write_split(folder, prefix, count, rng):
    labels = rng.integers(0, 10, count).astype(np.uint8)
    images = np.stack([draw_digit(int(d), rng) for d in labels])
    write_idx(os.path.join(folder, f"{prefix}-images-idx3-ubyte.gz"), images)
    write_idx(os.path.join(folder, f"{prefix}-labels-idx1-ubyte.gz"), labels)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the four IDX files")
    parser.add_argument("--train", type=int, default=6000, help="training images (default 6000)")
    parser.add_argument("--test", type=int, default=1000, help="test images (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    write_split(args.out, "train", args.train, rng)
    write_split(args.out, "t10k", args.test, rng)
    print(f"wrote {args.train} training and {args.test} test images to {args.out}")


if __name__ == "__main__":
    main()
