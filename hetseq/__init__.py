"""HetSeq: synchronous data-parallel training on heterogeneous infrastructure."""

__version__ = "0.2.0"
