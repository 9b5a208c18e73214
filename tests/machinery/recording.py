"""A process group that records every collective its rank issues.

For tests and benchmarks: which collectives an update makes, in what order,
with how many bytes, and whether every rank makes the same ones (ranks that
pair different collectives hang or compute wrong numbers). It wraps gloo
and is registered as a torch.distributed backend, so everything that
communicates goes through it: DDP's C++ reducer, FSDP2, and HetSeq's own
calls (a Python ``torch.distributed.ProcessGroup`` subclass sees all of them,
as PyTorch's own tests of Python process groups do).

    from machinery import recording
    recording.register()
    dist.init_process_group(recording.BACKEND, init_method=..., rank=r, world_size=w)
    recording.mark("update 1")           # a marker between calls
    ...
    calls = recording.calls()            # [Call(op, tensors), ...] and markers

Markers split the log into sections (``sections``), e.g. one per update.
"""

import dataclasses

import torch
import torch.distributed as dist

BACKEND = "recording"

# ProcessGroup methods that communicate (torch 2.6 to 2.13). Each is recorded
# with the dtypes and sizes of every tensor it is handed.
COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
    "reduce_scatter_single", "reduce_scatter_single_coalesced", "broadcast", "reduce", "gather",
    "scatter", "alltoall", "alltoall_base", "all_to_all_single", "barrier", "monitored_barrier",
    "send", "recv", "recv_anysource")


@dataclasses.dataclass(frozen=True)
class Call:
    """One collective: its name and the (dtype, elements) of each tensor
    handed to it (inputs and outputs); or a marker, with ``op`` '#'."""
    op: str
    tensors: tuple = ()
    label: str = ""

    @property
    def is_marker(self):
        return self.op == "#"

    @property
    def elements(self):
        return sum(numel for _, numel in self.tensors)


_LOG = []


def calls():
    """Everything recorded in this process so far, in order."""
    return list(_LOG)


def clear():
    _LOG.clear()


def mark(label):
    _LOG.append(Call("#", label=label))


def sections(log, prefix=""):
    """{label: [calls up to the next marker]} for markers starting with ``prefix``."""
    out, current = {}, None
    for call in log:
        if call.is_marker:
            current = call.label if call.label.startswith(prefix) else None
            if current is not None:
                out[current] = []
        elif current is not None:
            out[current].append(call)
    return out


def seen_from_both_ends(log):
    """``log`` with sends and receives both named "send/recv": one message
    is a send on one rank and a receive on the other, so two ranks that
    exchange the same messages have equal logs."""
    return [dataclasses.replace(call, op="send/recv") if call.op in ("send", "recv") else call
            for call in log]


def _tensors(value):
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


class RecordingProcessGroup(dist.ProcessGroup):
    """Forwards every call to ``inner`` (a gloo process group), recording it."""

    def __init__(self, inner, name):
        super().__init__(inner.rank(), inner.size())
        self.inner, self._name = inner, name

    def getBackendName(self):
        return BACKEND

    def getGroupName(self):
        return self._name

    def getGroupDesc(self):
        return "recording"


def _recorded(name):
    def method(self, *args, **kwargs):
        tensors = _tensors([list(args), list(kwargs.values())])
        _LOG.append(Call(name, tuple((str(t.dtype).replace("torch.", ""), t.numel())
                                     for t in tensors)))
        return getattr(self.inner, name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name in COLLECTIVES:
    setattr(RecordingProcessGroup, _name, _recorded(_name))


def _create(options, _backend_options):
    gloo = dist.ProcessGroupGloo(options.store, options.group_rank, options.group_size,
                                 options.timeout)
    inner = dist.ProcessGroup(options.store, options.group_rank, options.group_size)
    inner._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    inner._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    inner._set_group_name(f"{options.group_id}-inner")
    return RecordingProcessGroup(inner, options.group_id)


def register():
    """Make ``BACKEND`` available to ``dist.init_process_group`` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
