"""Small helpers shared across modules."""

import random

import numpy as np
import torch


def move_to(sample, device):
    """Move every tensor in a (nested) dict/list/tuple to ``device``."""
    if torch.is_tensor(sample):
        return sample.to(device, non_blocking=True)
    if isinstance(sample, dict):
        return {key: move_to(value, device) for key, value in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(move_to(value, device) for value in sample)
    return sample


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
