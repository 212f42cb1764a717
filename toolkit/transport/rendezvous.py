"""Rendezvous for torch.distributed groups: a TCPStore hosted by trainer rank 0, on the job's own address.

torch's TCPStore listens on every interface unless it is handed a socket; `serve_store` binds one to
the given address first, so on a shared node the store is not reachable from other networks.
The store itself is not authenticated (a torch.distributed limitation); it only carries rendezvous keys.
"""

from __future__ import annotations

import datetime
import socket


def serve_store(host: str, timeout_s: float):
    """A master TCPStore listening on `host` only, on a free port (read it from `.port`)."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    # detach: the store's server owns the descriptor from now on (Python must not close it)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=listener.detach(),
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect_store(host: str, port: int, timeout_s: float):
    """A client of the store at host:port."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
