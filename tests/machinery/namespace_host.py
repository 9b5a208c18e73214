"""Entering a namespace host (cluster.py) from inside a process: what
``VirtualCluster.command`` has ``ip netns exec`` and ``unshare --uts`` do to a
new process, done by a test zygote's child to itself after its fork
(zygote_server.py), which starts no new interpreter."""

import os
import socket

# <sched.h> and <sys/mount.h>
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
MS_RDONLY, MS_BIND, MS_REC, MS_SLAVE, MNT_DETACH = 1, 4096, 16384, 1 << 19, 2


def enter_host(netns, hostname):
    """In this process (a forked one: it changes namespaces for good), be on
    a ``VirtualCluster`` host as ``VirtualCluster.command`` puts a command
    there (``ip netns exec NETNS unshare --uts`` after ``hostname HOSTNAME``):
    its network namespace; a mount namespace of its own where /sys shows
    that network's interfaces and /etc/netns/NETNS/* lie over /etc/* (its
    /etc/hosts), as iproute2's netns_switch makes it; its own hostname."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, what):
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for host {hostname} ({netns}): {os.strerror(err)}")
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    check(libc.mount(b"", b"/", b"none", MS_SLAVE | MS_REC, None), "mount --make-rslave /")
    sysfs_flags = 0
    if libc.umount2(b"/sys", MNT_DETACH) != 0 and os.statvfs("/sys").f_flag & os.ST_RDONLY:
        sysfs_flags = MS_RDONLY        # a read-only /sys is shadowed by a read-only one
    check(libc.mount(netns.encode(), b"/sys", b"sysfs", sysfs_flags, None), "mount /sys")
    etc = f"/etc/netns/{netns}"
    for name in sorted(os.listdir(etc)) if os.path.isdir(etc) else []:
        check(libc.mount(f"{etc}/{name}".encode(), f"/etc/{name}".encode(), b"none", MS_BIND,
                         None), f"bind {etc}/{name}")
    socket.sethostname(hostname)
