"""Models the benchmarks train, each as a HetSeq task on random in-memory batches,
and how several Controllers are timed side by side."""

import time

import torch
import torch.nn.functional as F
from torch import nn

from hetseq.tasks import TASKS, Task, register_task


class MLP:
    name = "bench_mlp"

    @staticmethod
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))

    @staticmethod
    def batch(size, g):
        return {"x": torch.randn(size, 784, generator=g), "y": torch.randint(0, 10, (size,), generator=g)}

    @staticmethod
    def loss(model, sample):
        y = sample["y"]
        return F.cross_entropy(model(sample["x"]), y, reduction="sum"), len(y), {}


class Bert:
    """The default BERT of --task bert, on random token ids (MLM + NSP heads)."""
    name = "bench_bert"
    SEQ, PRED = 128, 20
    VOCAB = 8192          # hetseq.bert.demo.VOCAB_SIZE
    CONFIG = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  intermediate_size=1024, max_position_embeddings=128)   # demo.MODEL

    @classmethod
    def config(cls):
        from hetseq.bert import BertConfig
        return BertConfig(vocab_size=cls.VOCAB, **cls.CONFIG)

    @classmethod
    def build(cls):
        from hetseq.bert import BertForPreTraining
        torch.manual_seed(0)
        return BertForPreTraining(cls.config())

    @classmethod
    def batch(cls, size, g):
        VOCAB_SIZE = cls.VOCAB
        positions = torch.sort(torch.randint(1, cls.SEQ, (size, cls.PRED), generator=g), 1).values
        return {"input_ids": torch.randint(5, VOCAB_SIZE, (size, cls.SEQ), generator=g),
                "segment_ids": (torch.arange(cls.SEQ) >= 64).long().expand(size, -1),
                "input_mask": torch.ones(size, cls.SEQ, dtype=torch.long),
                "masked_lm_positions": positions,
                "masked_lm_ids": torch.randint(5, VOCAB_SIZE, (size, cls.PRED), generator=g),
                "next_sentence_labels": torch.randint(0, 2, (size,), generator=g)}

    @staticmethod
    def loss(model, sample):
        from hetseq.tasks.bert_pretraining import BertTask
        return BertTask.loss(None, model, sample)


class BertBase(Bert):
    """BERT-base: 110M parameters (uncased vocabulary of 30522)."""
    name = "bench_bert_base"
    VOCAB = 30522
    CONFIG = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                  intermediate_size=3072, max_position_embeddings=512)


MODELS = {"mlp": MLP, "bert": Bert, "bert-base": BertBase}


def register(kind):
    """``kind`` as a task (named ``kind.name``), once per process."""
    if kind.name not in TASKS:
        register_task(kind.name)(type(kind.name, (Task,), {
            "build_model": lambda self: kind.build(),
            "loss": lambda self, model, sample: kind.loss(model, sample)}))


def take_turns(ctrls, batches, warmup=2):
    """Seconds each Controller of ``ctrls`` ({name: Controller}) spent on
    ``batches``, one update each per batch, their order rotating, so the
    drift of a shared machine hits all alike; the first ``warmup`` rounds
    are not counted."""
    spent, names = dict.fromkeys(ctrls, 0.0), list(ctrls)
    for i, batch in enumerate(batches):
        for name in names[i % len(names):] + names[:i % len(names)]:
            begin = time.perf_counter()
            ctrls[name].train_step([batch], batch)
            if i >= warmup:
                spent[name] += time.perf_counter() - begin
    return spent
