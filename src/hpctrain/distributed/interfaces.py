"""The node's network interfaces, and which one is the cluster's fabric (stdlib only).

A multi-node job has channels besides NCCL's own: the rendezvous store (TCP to MASTER_ADDR),
gloo groups (CPU collectives, the checkpoint's and the loader's side channels), the health
probe. Each goes where its address resolves, and a node name usually resolves to the
Ethernet management network: a state transfer over gloo there took 800 s instead of 20 s in
another trainer. On a profile whose `fabric` is `infiniband` the fabric's interface is, in
this order: the profile's `fabric_interface` (exported as `HPCTRAIN_FABRIC_INTERFACE`); the
first interface NCCL's own `NCCL_SOCKET_IFNAME` selects; the network device of the first HCA
`NCCL_IB_HCA` selects; the first InfiniBand interface (IPoIB) with an IPv4 address. gloo
binds to it (`GLOO_SOCKET_IFNAME`, unless set), the probe's hub listens on it, and the store's
address is the first node's address on it (`attempts place` exports it from the probe).

The addresses come from the kernel (`SIOCGIFADDR`) and the kinds and HCA devices from sysfs,
rather than a library (psutil has no interface types and is no dependency of the job's step).
"""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.errors import LaunchFailure

FABRIC_INTERFACE_ENV = "HPCTRAIN_FABRIC_INTERFACE"  # the profile's fabric_interface
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
SYS_NET = Path("/sys/class/net")
SYS_INFINIBAND = Path("/sys/class/infiniband")
_SIOCGIFADDR = 0x8915
# ARPHRD_* of /sys/class/net/<if>/type (linux/if_arp.h)
_KINDS = {"1": "ethernet", "32": "infiniband", "772": "loopback"}


class FabricInterfaceError(LaunchFailure):
    """The profile names a fabric interface this node does not have."""


@dataclass(frozen=True)
class Interface:
    """One network interface of this node with an IPv4 address."""

    name: str
    address: str
    kind: str = "other"  # ethernet, infiniband, loopback, other


@dataclass(frozen=True)
class FabricChoice:
    """The fabric's interface on this node, and what chose it."""

    interface: Interface
    source: str  # e.g. "the profile's fabric_interface", "NCCL_SOCKET_IFNAME=ib"


def _address(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        packed = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, packed)[20:24])


def local_interfaces(sys_net: Path = SYS_NET) -> list[Interface]:
    """This node's interfaces that have an IPv4 address, in the kernel's order."""
    found = []
    for _index, name in socket.if_nameindex():
        try:
            address = _address(name)
        except OSError:
            continue  # no IPv4 address (down, or IPv6 only)
        try:
            kind = _KINDS.get((sys_net / name / "type").read_text().strip(), "other")
        except OSError:
            kind = "other"
        found.append(Interface(name, address, kind))
    return found


def hca_devices(hca: str, sys_infiniband: Path = SYS_INFINIBAND) -> list[str]:
    """The network devices of an InfiniBand HCA (`mlx5_0` -> `ib0`), from sysfs; with `hca`
    "": the node's HCAs."""
    folder = sys_infiniband / hca / "device" / "net" if hca else sys_infiniband
    try:
        return sorted(p.name for p in folder.iterdir())
    except OSError:
        return []


def _nccl_list(value: str) -> tuple[bool, bool, list[str]]:
    """NCCL's list syntax (`NCCL_SOCKET_IFNAME`, `NCCL_IB_HCA`): (exclude, exact, names).

    `^a,b`: anything but those; `=a`: exactly those; else prefixes. An HCA may carry a port
    (`mlx5_0:1`): the port is dropped.
    """
    value = value.strip()
    exclude = value.startswith("^")
    value = value.removeprefix("^")
    exact = value.startswith("=")
    value = value.removeprefix("=")
    return exclude, exact, [v.split(":")[0] for v in value.split(",") if v]


def _selected(name: str, exclude: bool, exact: bool, names: Sequence[str]) -> bool:
    hit = any(name == n if exact else name.startswith(n) for n in names)
    return hit != exclude


def fabric_interface(
    environ: Mapping[str, str],
    interfaces: Sequence[Interface],
    devices_of: Callable[[str], list[str]] = hca_devices,  # an HCA's devices; "": the HCAs
    node: str = "",
) -> FabricChoice | None:
    """This node's fabric interface (see the module doc), or None when none is found.

    Raises:
        FabricInterfaceError: the profile names an interface this node lacks (or that has no
            IPv4 address): the node cannot reach the others on the fabric.
    """
    by_name = {i.name: i for i in interfaces}
    named = environ.get(FABRIC_INTERFACE_ENV, "").strip()
    if named:
        if named in by_name:
            return FabricChoice(by_name[named], "the profile's fabric_interface")
        have = ", ".join(f"{i.name} {i.address}" for i in interfaces) or "none"
        where = f" on {node}" if node else ""
        raise FabricInterfaceError(
            f"the cluster profile's fabric_interface={named}: no such interface with an IPv4 "
            f"address{where} (interfaces: {have})"
        )
    usable = [i for i in interfaces if i.kind != "loopback"]
    wanted = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if wanted:
        exclude, exact, names = _nccl_list(wanted)
        for interface in usable:
            if _selected(interface.name, exclude, exact, names):
                return FabricChoice(interface, f"NCCL_SOCKET_IFNAME={wanted}")
    hcas = environ.get("NCCL_IB_HCA", "").strip()
    if hcas:
        exclude, exact, names = _nccl_list(hcas)
        present = devices_of("") if exclude else names
        for hca in present:
            if not _selected(hca, exclude, exact, names):
                continue
            for device in devices_of(hca):
                if device in by_name:
                    return FabricChoice(by_name[device], f"NCCL_IB_HCA={hcas} ({hca})")
    for interface in usable:
        if interface.kind == "infiniband":
            return FabricChoice(interface, "the first InfiniBand interface")
    return None


def route_interface(address: str, interfaces: Sequence[Interface]) -> Interface | None:
    """The interface this node reaches `address` (an IPv4 address) through, by its routes."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((address, 9))  # a UDP connect sends nothing: the kernel picks a route
            source = sock.getsockname()[0]
    except OSError:
        return None
    return next((i for i in interfaces if i.address == source), None)


def gloo_interface(environ: Mapping[str, str], choice: FabricChoice | None) -> dict[str, str]:
    """`GLOO_SOCKET_IFNAME` set to the fabric's interface, unless the user set it (or none)."""
    if choice is None or environ.get(GLOO_INTERFACE_ENV):
        return {}
    return {GLOO_INTERFACE_ENV: choice.interface.name}


def this_node(environ: Mapping[str, str]) -> str:
    """This node as SLURM names it (what its node lists hold)."""
    return environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def _ipv4(name: str) -> str:
    try:
        return str(socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0])
    except (OSError, UnicodeError):
        return ""


def _via(address: str, interfaces: Sequence[Interface]) -> Interface | None:
    return route_interface(address, interfaces) if address else None


def describe_channels(
    master: str,
    master_from: str,
    environ: Mapping[str, str],
    interfaces: Sequence[Interface],
    choice: FabricChoice | None,
    *,
    fabric: str,
) -> tuple[str, str]:
    """(the start-up line naming the interface of each channel, a warning or "").

    The warning: on an InfiniBand fabric whose interface is known, the store's traffic goes
    through another interface (its address is a name on the management network).
    """
    store_ip = _ipv4(master.rpartition(":")[0])
    store = _via(store_ip, interfaces)
    parts = [
        f"rendezvous store {master} ({master_from})"
        + (f" via {store.name} {store.address}" if store else "")
    ]
    gloo = environ.get(GLOO_INTERFACE_ENV, "")
    if gloo:
        ours = choice is not None and gloo == choice.interface.name
        why = f"the fabric's interface: {choice.source}" if ours and choice else "yours"
        parts.append(f"gloo via {gloo} ({GLOO_INTERFACE_ENV}, {why})")
    else:
        own = _via(_ipv4(socket.gethostname()), interfaces)
        parts.append(
            "gloo via the address of this host's name"
            + (f" ({own.name} {own.address})" if own else "")
        )
    nccl = environ.get("NCCL_SOCKET_IFNAME", "")
    parts.append(f"NCCL bootstrap via {f'NCCL_SOCKET_IFNAME={nccl}' if nccl else 'its own choice'}")
    line = "channels: " + "; ".join(parts)
    warning = ""
    if fabric == "infiniband":
        if choice is None:
            line += "; no InfiniBand interface with an IPv4 address found (IPoIB): the side channels use the default route"
        elif store is not None and store.name != choice.interface.name:
            warning = (
                f"the rendezvous store {master} is reached through {store.name} "
                f"({store.address}), not the fabric's {choice.interface.name} "
                f"({choice.interface.address}): the health probe records each node's fabric "
                "address (slurm.probe=true) and the job script hands the first node's to the "
                "ranks; a MASTER_ADDR of your own overrides it"
            )
    return line, warning


__all__ = [
    "FABRIC_INTERFACE_ENV",
    "FabricChoice",
    "FabricInterfaceError",
    "Interface",
    "describe_channels",
    "fabric_interface",
    "gloo_interface",
    "hca_devices",
    "local_interfaces",
    "route_interface",
    "this_node",
]
