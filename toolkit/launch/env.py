"""The environment contract between a launcher and the workers it starts (same for local and Slurm)."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

from toolkit.errors import ConfigError

RUN_DIR = "SLURM_RLHF_RUN_DIR"
CONTROL = "SLURM_RLHF_CONTROL"          # tcp://host:port of the coordinator
SECRET_FILE = "SLURM_RLHF_SECRET_FILE"  # file (mode 600) with the per-run secret
ATTEMPT = "SLURM_RLHF_ATTEMPT"          # random, new each time a driver starts the workers: with the secret,
                                        # the attempt's key (transport/wire.py attempt_secret)
GROUP = "SLURM_RLHF_GROUP"              # worker group (node group) name
RANK = "SLURM_RLHF_RANK"                # rank in the group (default: SLURM_PROCID)
BIND_HOST = "SLURM_RLHF_BIND_HOST"      # transport.bind_host as given (address, interface or network),
                                        # resolved on each node (default: this node's address)
ALLOCATOR = "SLURM_RLHF_ALLOCATOR"      # run.allocator: the worker starts itself again with it preloaded
FAST_MKL_ON_AMD = "SLURM_RLHF_FAST_MKL_ON_AMD"  # run.fast_mkl_on_amd ("1"): the same, with MKL's library
INBOX_PORT = "SLURM_RLHF_INBOX_PORT"    # workers started again listen where the ones they replace did, so
                                        # their peers' sockets reconnect by themselves: `rank:port,...`


@dataclass
class WorkerEnv:
    run_dir: str
    control: str
    secret_file: str
    attempt: str
    group: str
    rank: int
    bind_host: str
    inbox_port: int | None = None

    @property
    def worker_id(self) -> str:
        return f"{self.group}:{self.rank}"

    @classmethod
    def from_environ(cls, environ=os.environ) -> "WorkerEnv":
        missing = [k for k in (RUN_DIR, CONTROL, SECRET_FILE, ATTEMPT, GROUP) if k not in environ]
        if missing:
            raise RuntimeError(f"not started by a slurm-rlhf launcher: {', '.join(missing)} unset")
        rank = environ.get(RANK, environ.get("SLURM_PROCID"))
        if rank is None:
            raise RuntimeError(f"{RANK} and SLURM_PROCID are both unset")
        ports = dict(entry.split(":") for entry in environ.get(INBOX_PORT, "").split(",") if entry)
        port = ports.get(str(int(rank)))
        return cls(environ[RUN_DIR], environ[CONTROL], environ[SECRET_FILE], environ[ATTEMPT], environ[GROUP],
                   int(rank), resolve_bind_host(environ.get(BIND_HOST)), int(port) if port else None)


def inbox_ports(ports: dict[int, int]) -> dict[str, str]:
    """The environment that has workers started again listen where those they replace did: {rank: port}
    (one worker's, or those of a Slurm step's tasks, each taking its rank's)."""
    return {INBOX_PORT: ",".join(f"{rank}:{port}" for rank, port in sorted(ports.items()))} if ports else {}


def resolve_bind_host(spec: str | None) -> str:
    """This node's address to bind to, from `transport.bind_host`: an address as given, an interface name
    (e.g. `ib0`: its IPv4 address) or a network (`10.1.0.0/16`: this node's address in it); one value
    serves every node of a multi-node job. None or empty: `node_address()`."""
    if not spec:
        return node_address()
    addresses = interface_addresses()
    if spec in addresses:
        if not addresses[spec]:
            raise ConfigError(f"transport.bind_host {spec!r}: that interface of node {node_name()} has no IPv4 address")
        return addresses[spec][0]
    if "/" in spec:
        try:
            network = ipaddress.ip_network(spec, strict=False)
        except ValueError:
            raise ConfigError(f"transport.bind_host {spec!r} is not a network (e.g. 10.1.0.0/16)") from None
        for name, addrs in addresses.items():
            for address in addrs:
                if ipaddress.ip_address(address) in network:
                    return address
        raise ConfigError(f"transport.bind_host {spec}: no address of node {node_name()} is in that network "
                         f"(its interfaces: {_describe(addresses)})")
    try:
        address = socket.gethostbyname(spec)  # (an address, or a name for one of this node's)
    except OSError:
        address = None
    if address is None or not any(address in addrs for addrs in addresses.values()):
        raise ConfigError(f"transport.bind_host {spec!r} is not an interface, an address or a network of node "
                          f"{node_name()} (its interfaces: {_describe(addresses)}); ZeroMQ could not listen there")
    return address


def node_address() -> str:
    """This node's address as other nodes reach it: its name resolved, unless that gives a loopback
    address (Debian maps the hostname to 127.0.1.1), then the first interface's non-loopback IPv4
    address; loopback only when the node has no other."""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = "127.0.0.1"
    if not ipaddress.ip_address(address).is_loopback:
        return address
    for addrs in interface_addresses().values():
        for candidate in addrs:
            if not ipaddress.ip_address(candidate).is_loopback:
                return candidate
    return address


def interface_of(address: str) -> str | None:
    """The name of the interface that holds `address` (for GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)."""
    for name, addrs in interface_addresses().items():
        if address in addrs:
            return name
    return None


def interface_addresses() -> dict[str, list[str]]:
    """{interface name: its IPv4 addresses}."""
    import psutil

    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def _describe(addresses: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} {'/'.join(addrs) or '-'}" for name, addrs in addresses.items())


def node_name() -> str:
    """The Slurm node name (virtual nodes share a hostname), or the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
