"""MNIST (or any IDX image data such as Fashion-MNIST) as a user task.

This file lives outside the package on purpose: it is the example of
extending HetSeq. Load it with ``--user-dir examples/mnist``.
"""

import logging
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hetseq.base.errors import UserError
from hetseq.keyed.nn import Dropout
from hetseq.tasks import Task, register_task

from .idx import read_idx

logger = logging.getLogger(__name__)

# File-name prefixes of the standard MNIST distribution, by split.
SPLIT_PREFIX = {"train": "train", "valid": "t10k", "test": "t10k"}
MEAN, STD = 0.1307, 0.3081


class IdxImages(Dataset):
    def __init__(self, images, labels):
        self.images = torch.from_numpy(np.array(images, dtype=np.uint8))  # a writable copy
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return index

    def collater(self, indices):
        # The dataset yields indices; the batch is cut with one vectorised slice.
        index = torch.as_tensor(indices)
        images = (self.images[index].unsqueeze(1).float() / 255.0 - MEAN) / STD
        return {"image": images, "target": self.labels[index]}


class Net(nn.Module):
    """The CNN of PyTorch's MNIST example (HetSeq's MNIST model). Its dropout
    is ``hetseq.keyed.nn.Dropout``: each image's masks come from its own stream
    (seed, epoch, its index, the module), so the update does not depend on
    which rank trained the image (docs/tasks.md)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = Dropout(0.25)
        self.dropout2 = Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2)).flatten(1)
        return self.fc2(self.dropout2(F.relu(self.fc1(x))))


def find_idx_file(folder, prefix, kind):
    for name in (f"{prefix}-{kind}", f"{prefix}-{kind}".replace("-idx", ".idx")):
        for suffix in ("", ".gz"):
            path = os.path.join(folder, name + suffix)
            if os.path.exists(path):
                return path
    raise UserError(f"--data {folder}: no {prefix}-{kind}[.gz]; expected the four MNIST IDX files "
                    "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-...), see "
                    "examples/mnist/README.md")


# Debian's and Ubuntu's `apt-get install dataset-fashion-mnist` puts it here.
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@register_task("mnist")
class MNISTTask(Task):
    # PyTorch's MNIST example recipe (Adadelta at lr 1.0, batches of 64) for
    # two epochs, the rate decaying linearly to 0 over the run: about 0.88
    # test accuracy on Fashion-MNIST (0.98 on MNIST) with 2 CPU ranks.
    defaults = {"optimizer": "adadelta", "lr": [1.0], "max_sentences": 64, "max_epoch": 2,
                "lr_scheduler": "polynomial_decay", "total_num_update": 0, "clip_norm": 0.0,
                "keep_last_epochs": 0}

    @classmethod
    def resolve_inputs(cls, args):
        """The data folder: --data, else Fashion-MNIST where Debian installs it."""
        if args.data is not None:
            return args.data
        if os.path.isdir(FASHION_MNIST):
            logger.info("no --data: training on Fashion-MNIST in %s", FASHION_MNIST)
            return FASHION_MNIST
        raise UserError(f"no --data, and no Fashion-MNIST in {FASHION_MNIST}: pass --data DIR "
                        "with the four IDX files, run `apt-get install dataset-fashion-mnist`, "
                        "or make demo digits with python examples/mnist/make_demo_data.py "
                        "--out data/mnist-demo")

    def load_dataset(self, split):
        data = self.inputs or self.args.data
        if not data or not os.path.isdir(data):
            raise UserError(f"--data {data}: not a directory; pass the folder of the "
                            "MNIST IDX files")
        if split not in SPLIT_PREFIX:
            raise UserError(f"mnist has splits {sorted(SPLIT_PREFIX)}, not '{split}'")
        prefix = SPLIT_PREFIX[split]
        try:
            images = read_idx(find_idx_file(data, prefix, "images-idx3-ubyte"))
            labels = read_idx(find_idx_file(data, prefix, "labels-idx1-ubyte"))
        except ValueError as err:
            raise UserError(f"--data {data}: {err}")
        if images.ndim != 3 or images.shape[1:] != (28, 28) or len(images) != len(labels):
            raise UserError(f"--data {data}: expected N x 28 x 28 images and N labels "
                            f"for '{split}', got {images.shape} and {labels.shape}")
        return IdxImages(images, labels)

    def build_model(self):
        return Net()

    def loss(self, model, sample):
        logits = model(sample["image"])
        target = sample["target"]
        loss = F.cross_entropy(logits, target, reduction="sum")
        correct = (logits.argmax(dim=1) == target).sum()
        return loss, target.numel(), {"correct": correct}
