"""Evaluation metrics that stay exact when the data is split across ranks.

Each metric is computed from statistics that add up across micro-batches and
ranks, summed in the stats all-reduce (Spearman's pairs gathered), so the
value is the one a single process computes on the whole set (docs/bert.md).
``*_stats(...)`` give one batch's logs; the functions taking ``totals`` turn
the summed logs into the metric.
"""

import math

import numpy as np
import torch


def binary_stats(predictions, labels):
    """Confusion counts of a binary task, label 1 positive."""
    p, t = predictions.bool(), labels.bool()
    return {"tp": (p & t).sum(), "fp": (p & ~t).sum(), "fn": (~p & t).sum(),
            "tn": (~p & ~t).sum()}


def f1(totals):
    tp, fp, fn = totals["tp"], totals["fp"], totals["fn"]
    return 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def matthews_correlation(totals):
    tp, tn, fp, fn = totals["tp"], totals["tn"], totals["fp"], totals["fn"]
    denominator = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    return (tp * tn - fp * fn) / denominator if denominator else 0.0


def regression_stats(predictions, labels):
    """Sums from which Pearson's r follows (in float64: no cancellation)."""
    x, y = predictions.double(), labels.double()
    return {"sum_x": x.sum(), "sum_y": y.sum(), "sum_xx": (x * x).sum(),
            "sum_yy": (y * y).sum(), "sum_xy": (x * y).sum()}


def pearson(totals, n):
    sx, sy = totals["sum_x"], totals["sum_y"]
    cov = totals["sum_xy"] - sx * sy / n
    var_x, var_y = totals["sum_xx"] - sx * sx / n, totals["sum_yy"] - sy * sy / n
    return cov / math.sqrt(var_x * var_y) if var_x > 0 and var_y > 0 else 0.0


def average_ranks(values):
    """Ranks 1..n, tied values sharing their average rank (as scipy's rankdata)."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    # Each run of equal values gets the mean of the positions it spans.
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    return ranks


def spearman(pairs):
    """Spearman's rho of gathered (prediction, label) rows."""
    # Ranks over the whole set, which no sum carries: hence the pairs are gathered
    # (hetseq.update.stats.Gathered), not summed.
    pairs = torch.as_tensor(pairs, dtype=torch.float64).reshape(-1, 2).numpy()
    if len(pairs) < 2:
        return 0.0
    x, y = average_ranks(pairs[:, 0]), average_ranks(pairs[:, 1])
    x, y = x - x.mean(), y - y.mean()
    denominator = math.sqrt((x * x).sum() * (y * y).sum())
    return float((x * y).sum() / denominator) if denominator else 0.0
