"""What ``hetseq-launch --check`` asks of each host: one JSON line, printed
after ``PREFIX``, with the facts a node's part depends on (check.py judges
them)::

    python -m hetseq.launch.probe [--master HOST] [--interface NAME] [--backend NAME]

HetSeq's version and code digest (digests.py: what the job's identity
compares at the meeting point), torch's version, the CUDA devices this
host's Python sees, the memory available, and the interface a rank would
bind to reach ``--master`` (distributed/network.py's own choice).
"""

import argparse
import json
import os
import platform
import sys

PREFIX = "hetseq-probe "


def memory_available():
    """Bytes the kernel says a new process could take (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cuda_devices(torch):
    """[{name, free}] of the visible CUDA devices; (devices, why none) ."""
    try:
        count = torch.cuda.device_count()
    except Exception as err:   # a broken driver says so here, not in a traceback
        return [], f"{type(err).__name__}: {err}"
    devices = []
    for index in range(count):
        try:
            free = torch.cuda.mem_get_info(index)[0]
        except Exception:
            free = None
        devices.append({"name": torch.cuda.get_device_name(index), "free": free})
    return devices, None


def interface(master, flag, backend):
    """'NAME ADDRESS' a rank would bind to, or the reason it cannot."""
    from hetseq.distributed import network
    from hetseq.base.errors import UserError
    try:
        binding = network.choose(master, flag, backend or "gloo")
    except (UserError, OSError) as err:
        return None, str(err)
    return f"{binding.interface or '?'} {binding.address}", None


def facts(master=None, flag=None, backend=None):
    import hetseq
    from hetseq.app.digests import code_digest
    out = {"host": platform.node(), "python": sys.executable, "hetseq": hetseq.__version__,
           "code": code_digest(), "hetseq_at": os.path.dirname(hetseq.__file__),
           "memory": memory_available()}
    try:
        import torch
    except ImportError as err:
        out.update(torch=None, torch_error=str(err), cuda=[])
    else:
        out["torch"] = torch.__version__
        out["cuda"], out["cuda_error"] = cuda_devices(torch)
    out["interface"], out["interface_error"] = interface(master, flag, backend)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hetseq.launch.probe",
                                description="What hetseq-launch --check asks of a host.")
    p.add_argument("--master", help="the meeting point's host (the interface that routes there)")
    p.add_argument("--interface", help="the node's --distributed-interface, if any")
    p.add_argument("--backend", help="the job's --distributed-backend")
    args = p.parse_args(argv)
    print(PREFIX + json.dumps(facts(args.master, args.interface, args.backend)), flush=True)


if __name__ == "__main__":
    main()
