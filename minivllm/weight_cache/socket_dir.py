"""Where a weight-cache daemon listens: a private directory, one socket per (host, NUMA node, rank).

    $TMPDIR/minivllm_weight_cache_<uid>/                      0700, owned by the user
        minivllm_weight_cache_<host>_numa<node>_tp<rank>.sock  0600, the daemon's socket
        minivllm_weight_cache_<host>_numa<node>_tp<rank>.lock  held (flock) while it lives

The default directory is checked strictly (not a symlink, owned by this uid, no
group/other bits); a directory the user names gets the ownership and symlink checks
only. The lock makes a second daemon for the same socket fail instead of stealing it,
and tells a dead daemon's socket (lock free) from a live one.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import socket
import stat
import tempfile

_PREFIX = "minivllm_weight_cache"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the NUL


class SocketDirError(ValueError):
    """The socket directory is unsafe to use (symlink, another owner, open permissions)."""


def default_socket_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"{_PREFIX}_{os.getuid()}")


def ensure_socket_dir(path: str | None) -> str:
    """The checked socket directory: `path`, or the default one (created 0700 if missing)."""
    strict = path is None
    path = os.path.abspath(path or default_socket_dir())
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_socket_dir(path, strict)
    return path


def check_socket_dir(path: str, strict: bool) -> None:
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise SocketDirError(f"weight cache socket directory {path} is a symlink; refusing it")
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"weight cache socket directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise SocketDirError(
            f"weight cache socket directory {path} belongs to uid {st.st_uid}, not to this "
            f"user ({os.getuid()}); refusing it"
        )
    if strict and st.st_mode & 0o077:
        raise SocketDirError(
            f"weight cache socket directory {path} has mode {stat.S_IMODE(st.st_mode):o}; "
            "it must be 0700 (no group or other permissions): chmod 700 it, or remove it"
        )


def host_identity() -> str:
    """A stable name for this host (machine-id, else boot id, else hostname), hashed short."""
    for source in ("/etc/machine-id", "/proc/sys/kernel/random/boot_id"):
        try:
            with open(source) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return hashlib.sha256(text.encode()).hexdigest()[:12]
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:12]


def numa_node() -> int:
    """The NUMA node of the first CPU this process may run on (0 where there is no NUMA)."""
    try:
        cpu = min(os.sched_getaffinity(0))
    except (AttributeError, ValueError):
        return 0
    root = "/sys/devices/system/node"
    try:
        nodes = sorted(n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit())
    except OSError:
        return 0
    for node in nodes:
        try:
            with open(os.path.join(root, node, "cpulist")) as f:
                if cpu in _parse_cpulist(f.read()):
                    return int(node[4:])
        except OSError:
            continue
    return 0


def _parse_cpulist(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def socket_path(socket_dir: str, tp_rank: int = 0) -> str:
    name = f"{_PREFIX}_{host_identity()}_numa{numa_node()}_tp{tp_rank}.sock"
    path = os.path.join(socket_dir, name)
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise SocketDirError(
            f"weight cache socket path {path} is longer than the {_MAX_SOCKET_PATH} bytes "
            "AF_UNIX allows; use a shorter socket directory"
        )
    return path


def lock_path(sock_path: str) -> str:
    return sock_path.removesuffix(".sock") + ".lock"


class SocketLock:
    """The exclusive lock a daemon holds on its socket for as long as it serves it."""

    def __init__(self, sock_path: str) -> None:
        self.path = lock_path(sock_path)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise naming the socket; retried when a dying daemon unlinked
        the file between our open and our lock (then the path names a new file)."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RuntimeError(
                    f"another weight cache daemon already owns {self.path.removesuffix('.lock')}"
                    ".sock; stop it first"
                ) from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                os.write(fd, f"{os.getpid()}\n".encode())
                self.fd = fd
                return
            os.close(fd)

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self.fd)
        self.fd = None


def is_lock_free(sock_path: str) -> bool:
    """True when no live daemon holds the socket's lock (its socket, if any, is stale)."""
    try:
        fd = os.open(lock_path(sock_path), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_stale_socket(sock_path: str) -> bool:
    """Unlink a dead daemon's socket file; call only while holding its lock. True if one was there."""
    try:
        os.unlink(sock_path)
    except FileNotFoundError:
        return False
    return True
