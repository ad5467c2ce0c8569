"""The tensor-parallel group: rank, size and the collectives the layers use.

With one process (the default) every collective is the identity. A TP rank
(`minivllm.worker.worker`) joins two groups over torch.distributed:

    cpu_group     gloo           the driver's calls, as pickled objects; waits for
                                 the next step without a deadline (an idle server)
    device_group  gloo on CPU,   activations: the all-reduce of row-parallel
                  NCCL on CUDA   layers, the logits all-gather, sampled tokens

Trust boundary (docs/tensor-parallel.md): the rendezvous store listens only on
the address the init method names (torch's own binds every interface), and on
loopback gloo's pairs do too. Every object sent over the control group is a
pickle sealed with an HMAC of the group's shared secret, a nonce of the run (every rank adds to it) and a
sequence number;
a rank checks the seal before it unpickles anything, so a stranger who reaches a
port (or hijacks the rendezvous) cannot make a rank run code, nor replay a call.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

# How long a rank waits for the driver's next call: an idle server waits for good.
_NO_DEADLINE = timedelta(days=3650)
_RENDEZVOUS_TIMEOUT = timedelta(minutes=30)  # how long ranks may take to join
_MAC_BYTES = 32
_NONCE_BYTES = 16
_MAX_CONTROL_BYTES = 1 << 30  # a driver's call or the engine config is far smaller


class ControlPlaneError(RuntimeError):
    """A control message failed its HMAC check: not from this group's rank 0."""


@dataclass(slots=True)
class _TensorParallelState:
    rank: int = 0
    size: int = 1
    cpu_group: Any = None
    device_group: Any = None
    secret: bytes = b""
    sequence: int = 0  # control messages sent (rank 0) or received (others)
    nonce: bytes = b""  # this run's, from every rank


_tp = _TensorParallelState()


def init_tensor_parallel(rank: int, size: int, init_method: str, secret: bytes) -> None:
    """Join the world (`init_method` is `tcp://host:port`); only the control group exists yet.

    Rank 0 hosts the rendezvous store on a socket bound to `host` alone. `secret`
    (the same on every rank) seals the control messages. The device group comes
    with `init_device_group`, once the rank knows its device.
    """
    if not secret:
        raise ValueError("tensor parallelism needs a shared secret for its control plane")
    url = urlsplit(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init method must be tcp://host:port, got {init_method!r}")
    host, port = url.hostname, url.port
    if _is_loopback(host):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs: loopback only
    # the store takes the descriptor over (it closes it with the process group)
    listen_fd = _listen(host, port).detach() if rank == 0 else None
    store = dist.TCPStore(
        host, port, size, rank == 0, _RENDEZVOUS_TIMEOUT, master_listen_fd=listen_fd
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=_NO_DEADLINE)
    _tp.rank, _tp.size, _tp.cpu_group = rank, size, dist.group.WORLD
    _tp.secret, _tp.sequence = secret, 0
    # every rank adds random bytes to this run's nonce, which every seal covers: no
    # rank (nor a hijacked rendezvous) can make a frame of an earlier run valid again
    mine = torch.frombuffer(bytearray(os.urandom(_NONCE_BYTES)), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=_tp.cpu_group)
    _tp.nonce = b"".join(p.numpy().tobytes() for p in parts)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def init_device_group(device: str) -> None:
    _tp.device_group = dist.new_group(backend="nccl" if device == "cuda" else "gloo")


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _tp.rank, _tp.size, _tp.cpu_group, _tp.device_group = 0, 1, None, None
    _tp.secret, _tp.sequence, _tp.nonce = b"", 0, b""


def get_tp_rank() -> int:
    return _tp.rank


def get_tp_size() -> int:
    return _tp.size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp.size > 1:
        dist.all_reduce(x, group=_tp.device_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    if _tp.size == 1:
        return x
    if x.numel() == 0:  # a step with no logits rows: same shape on every rank, nothing to send
        return torch.cat([x] * _tp.size, dim=dim)
    parts = [torch.empty_like(x) for _ in range(_tp.size)]
    dist.all_gather(parts, x.contiguous(), group=_tp.device_group)
    return torch.cat(parts, dim=dim)


def tp_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Every rank gets rank 0's `x` (same shape and dtype on all ranks)."""
    if _tp.size > 1:
        dist.broadcast(x, src=0, group=_tp.device_group)
    return x


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` (any picklable value) on every rank; others pass anything.

    The pickle travels sealed: HMAC-SHA256 over (sequence number, pickle) with the
    group's secret; a receiver unpickles only what it has checked."""
    if _tp.size == 1:
        return obj
    if _tp.rank == 0:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        _tp.sequence += 1
        frame = _seal(_tp.sequence, payload) + payload
        length = torch.tensor([len(frame)], dtype=torch.int64)
        dist.broadcast(length, src=0, group=_tp.cpu_group)
        dist.broadcast(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0, _tp.cpu_group)
        return obj
    _tp.sequence += 1
    length = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(length, src=0, group=_tp.cpu_group)
    if not _MAC_BYTES <= int(length.item()) <= _MAX_CONTROL_BYTES:
        raise ControlPlaneError(f"a control message of {int(length.item())} bytes")
    frame_tensor = torch.empty(int(length.item()), dtype=torch.uint8)
    dist.broadcast(frame_tensor, src=0, group=_tp.cpu_group)
    frame = frame_tensor.numpy().tobytes()
    mac, payload = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
    if not hmac.compare_digest(mac, _seal(_tp.sequence, payload)):
        raise ControlPlaneError(
            "a control message failed its HMAC check (wrong MINIVLLM_TP_SECRET, or not "
            "from this group's rank 0); nothing was unpickled"
        )
    return pickle.loads(payload)


def _seal(sequence: int, payload: bytes) -> bytes:
    mac = hmac.new(_tp.secret, _tp.nonce + sequence.to_bytes(8, "little"), hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def all_reduce_min(value: int) -> int:
    """The smallest `value` over all ranks (control group)."""
    if _tp.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_tp.cpu_group)
    return int(t.item())
