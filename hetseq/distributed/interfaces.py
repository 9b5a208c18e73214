"""This machine's network interfaces and the kernel's choice of source address.

Two questions the start-up asks of the operating system, answered without
any dependency: which local address would the kernel use to reach a given
address (``route_source``), and which interface holds an address
(``interface_of``). Linux's ``getifaddrs`` lists every address of every
interface (also secondary and IPv6 ones), which ``ioctl`` cannot.
"""

import ctypes
import ctypes.util
import ipaddress
import socket
import sys

IFF_UP, IFF_LOOPBACK = 0x1, 0x8


class _Sockaddr(ctypes.Structure):
    # Linux layout: the family is the first unsigned short (BSD differs).
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 26)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [("next", ctypes.POINTER(_Ifaddrs)), ("name", ctypes.c_char_p),
                     ("flags", ctypes.c_uint), ("addr", ctypes.POINTER(_Sockaddr)),
                     ("netmask", ctypes.POINTER(_Sockaddr)),
                     ("broadaddr", ctypes.POINTER(_Sockaddr)), ("data", ctypes.c_void_p)]


def _address(sockaddr):
    """The address in a sockaddr_in / sockaddr_in6, or None for other families."""
    raw = bytes(sockaddr.data)
    if sockaddr.family == socket.AF_INET:      # port (2 bytes), then 4 address bytes
        return socket.inet_ntop(socket.AF_INET, raw[2:6])
    if sockaddr.family == socket.AF_INET6:     # port (2), flow info (4), 16 address bytes
        return socket.inet_ntop(socket.AF_INET6, raw[6:22])
    return None


def list_addresses():
    """[(interface, address, is_up, is_loopback)] for every IP address here.
    Empty where getifaddrs is not available (then nothing is chosen for the user)."""
    if not sys.platform.startswith("linux"):
        return []
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    found = []
    try:
        node = head
        while node:
            entry = node.contents
            address = _address(entry.addr.contents) if entry.addr else None
            if address is not None:
                found.append((entry.name.decode(), address, bool(entry.flags & IFF_UP),
                              bool(entry.flags & IFF_LOOPBACK)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def is_loopback(address):
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


def resolve(host):
    """The first address ``host`` resolves to here (what TCPStore tries first)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return infos[0][4][0]


def route_source(address):
    """The local address the kernel would send from to reach ``address``.
    A UDP connect only looks up the route; no packet leaves the machine."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def interface_of(address):
    """The interface that holds ``address``; loopback addresses that no interface
    lists (127.0.1.1) belong to the loopback interface. None if not local."""
    entries = list_addresses()
    for name, held, _, _ in entries:
        if held == address.split("%")[0]:
            return name
    if is_loopback(address):
        return next((name for name, _, _, loop in entries if loop), None)
    return None


def address_of(interface):
    """The first address of ``interface`` (IPv4 first, as gloo picks), or None."""
    held = [addr for name, addr, _, _ in list_addresses() if name == interface]
    held.sort(key=lambda addr: ":" in addr)
    return held[0] if held else None


def default_route_interface():
    """The interface of the IPv4 default route (Linux), or None."""
    try:
        with open("/proc/net/route") as table:
            rows = [line.split() for line in table.readlines()[1:]]
    except OSError:
        return None
    return next((row[0] for row in rows if len(row) > 2 and row[1] == "00000000"), None)


def names_this_host(host):
    """Whether ``host`` is this machine's own name (the one other machines
    may resolve to a real address). "localhost" is this machine too, but
    never a name another machine could use for it."""
    name = host.lower()
    return not name.startswith("localhost") and \
        name in {socket.gethostname().lower(), socket.getfqdn().lower()}


def primary_address():
    """This host's address for peers when there is no master address to route
    to (file:// rendezvous): the default route's interface, else the first
    interface that is up and not loopback, else loopback."""
    default = default_route_interface()
    if default and address_of(default):
        return address_of(default)
    up = sorted((":" in addr, name, addr) for name, addr, is_up, loop in list_addresses()
                if is_up and not loop and not addr.startswith("fe80"))
    return up[0][2] if up else "127.0.0.1"
