"""Worlds of torch processes for the Python peers of the tests (torch.multiprocessing.spawn).

The parent serves the world's TCPStore on a port the kernel picks when it binds (port 0), before
any rank starts, and hands the port to the ranks: no other process can take the port between
choosing it and binding it, as one could with a port found free and closed again. Works with
torch 1.13 and 2.x (Debian's torch 2.6 has no libuv: its stores are made without).

    store, port = serve()            # in the parent; keep `store` alive until the ranks end
    mp.spawn(worker, args=(port, ...), nprocs=N, join=True)
    def worker(rank, port, ...):
        join(rank, N, port)          # then dist.* as after init_process_group
"""
import os
from datetime import timedelta

import torch.distributed as dist

HOST = "127.0.0.1"
TIMEOUT = timedelta(seconds=300)


def _store(port, server):
    # torch 2.x takes use_libuv (and defaults it on: Debian's 2.6 refuses); torch 1.13 does not know it
    try:
        return dist.TCPStore(HOST, port, None, server, TIMEOUT, wait_for_workers=False, use_libuv=False)
    except TypeError:
        return dist.TCPStore(HOST, port, None, server, TIMEOUT, wait_for_workers=False)


def serve():
    """The world's TCPStore, served by this process on a port of the kernel's choosing."""
    store = _store(0, True)
    return store, store.port


def join(rank, world, port):
    """Joins the world as `rank` of `world` (a Gloo process group over the parent's store)."""
    os.environ.setdefault("USE_LIBUV", "0")
    os.environ.update(MASTER_ADDR=HOST, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    store = _store(port, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
