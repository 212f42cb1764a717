"""The environment contract between a launcher and the workers it starts (same for local and Slurm)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

RUN_DIR = "SLURM_RLHF_RUN_DIR"
CONTROL = "SLURM_RLHF_CONTROL"          # tcp://host:port of the coordinator
SECRET_FILE = "SLURM_RLHF_SECRET_FILE"  # file (mode 600) with the per-run secret
GROUP = "SLURM_RLHF_GROUP"              # worker group (node group) name
RANK = "SLURM_RLHF_RANK"                # rank in the group (default: SLURM_PROCID)
BIND_HOST = "SLURM_RLHF_BIND_HOST"      # address to bind sockets to (default: this node's address)


@dataclass
class WorkerEnv:
    run_dir: str
    control: str
    secret_file: str
    group: str
    rank: int
    bind_host: str

    @property
    def worker_id(self) -> str:
        return f"{self.group}:{self.rank}"

    @classmethod
    def from_environ(cls, environ=os.environ) -> "WorkerEnv":
        missing = [k for k in (RUN_DIR, CONTROL, SECRET_FILE, GROUP) if k not in environ]
        if missing:
            raise RuntimeError(f"not started by a slurm-rlhf launcher: {', '.join(missing)} unset")
        rank = environ.get(RANK, environ.get("SLURM_PROCID"))
        if rank is None:
            raise RuntimeError(f"{RANK} and SLURM_PROCID are both unset")
        return cls(environ[RUN_DIR], environ[CONTROL], environ[SECRET_FILE], environ[GROUP], int(rank),
                   environ.get(BIND_HOST) or node_address())


def node_address() -> str:
    """This node's address as other nodes reach it (its hostname resolved), else loopback."""
    name = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        return socket.gethostbyname(name)
    except OSError:
        return "127.0.0.1"


def node_name() -> str:
    """The Slurm node name (virtual nodes share a hostname), or the hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
