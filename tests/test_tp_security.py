"""The tensor-parallel control plane's trust boundary: where its store listens, and that a
rank unpickles only messages sealed with the group's secret."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.server_utils import REPO_ROOT

# Two ranks on loopback; rank 0 broadcasts a pickle that, unpickled, would create a file.
RANK = textwrap.dedent(
    """
    import os, socket, sys
    from minivllm.distributed import parallel_state as ps

    rank, port, secret, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]

    class Payload:
        def __reduce__(self):
            return (open, (marker, "w"))

    ps.init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", secret.encode())
    if rank == 0:
        # the store listens on the address the init method names, not on every interface
        probe = socket.socket()
        probe.settimeout(5)
        print("other-address:", probe.connect_ex(("127.0.0.2", port)), flush=True)
        probe.close()
        reached = socket.create_connection(("127.0.0.1", port)) is not None
        print("named-address:", reached, flush=True)
        ps.broadcast_object({"step": 1})
        ps.broadcast_object(Payload())
    else:
        print("first:", ps.broadcast_object(None), flush=True)
        try:
            ps.broadcast_object(None)
            print("second: unpickled", flush=True)
        except ps.ControlPlaneError as exc:
            print("second: refused:", exc, flush=True)
    ps.destroy_tensor_parallel()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(secrets: tuple[str, str], marker: Path) -> tuple[str, str]:
    port = _free_port()
    env = {"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(port), secret, str(marker)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for rank, secret in enumerate(secrets)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return outs[0], outs[1]


def test_store_listens_on_the_named_address_only_and_sealed_messages_pass(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "pwned"
    rank0, rank1 = _run_ranks(("same secret", "same secret"), marker)
    assert "named-address: True" in rank0, rank0
    assert "other-address: 0" not in rank0, rank0  # refused on 127.0.0.2
    assert "first: {'step': 1}" in rank1, rank1
    # sealed by the true rank 0, the payload is trusted: this is the boundary's other side
    assert "second: unpickled" in rank1 and marker.exists()


def test_a_rank_with_another_secret_unpickles_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _, rank1 = _run_ranks(("rank 0's secret", "a stranger's secret"), marker)
    assert "failed its HMAC check" in rank1, rank1
    assert "first:" not in rank1 and not marker.exists()
