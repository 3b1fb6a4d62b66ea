"""Who writes a corpus directory: writer ids, and the compaction lock with a lease (numpy-free, stdlib only).

Many processes (``redraft serve`` replicas, vLLM proposer engines) append to one tenant directory, each to its own
journal; exactly one of them at a time may fold the journals into the next generation. That one holds
``compact.lock``, a small JSON file ``{"writer", "host", "pid", "expires"}`` created with ``O_EXCL`` (atomic on a
local filesystem and on NFSv3+). A holder that dies leaves the file behind; it is taken over when its lease
expired (``expires``, Unix seconds) or, on the same host, when its process is gone. A takeover renames the stale
file away first (only one renamer can succeed), then creates a fresh one, so two processes never both believe they
hold it. The lease bounds how long a dead holder on another host blocks compaction; appends and lookups never wait
for the lock. The scheme is the classic lease-based lock file (as Git's ``index.lock`` plus an expiry).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import time

from .errors import CorpusError

LOCK_FILE = "compact.lock"
LEASE_SECONDS = 120.0  # a compaction takes well under this; a dead holder on another host blocks it this long
_UNREADABLE_GRACE = 10.0  # a lock file still empty or half-written this long after it was made is stale


def host_name() -> str:
    """This machine's name as it appears in writer ids (letters, digits, ``_.-``; at most 40 characters)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:40] or "host"


def writer_id() -> str:
    """A new writer id, unique per process start: ``host.pid.random``."""
    return f"{host_name()}.{os.getpid()}.{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CompactionLock:
    """The compaction lock of one tenant directory, held by ``writer``.

    Args:
        directory: the tenant directory. writer: this process's writer id (:func:`writer_id`).
        lease: seconds the lock stays valid after :meth:`acquire`.
        name: the lock file's name in ``directory`` (another name: another lock, e.g. the prefix KV store's
            eviction lock beside the corpora).
    """

    def __init__(self, directory, writer: str, lease: float = LEASE_SECONDS, name: str = LOCK_FILE) -> None:
        self.path = os.path.join(os.fspath(directory), name)
        self.writer, self.lease = writer, lease

    def holder(self) -> dict | None:
        """The lock file's content (None when there is none or it cannot be parsed)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                got = json.load(f)
        except (OSError, ValueError):
            return None
        return got if isinstance(got, dict) else None

    def _stale(self, holder: dict | None) -> bool:
        if holder is None:  # being written right now, or left half-written by a crash
            try:
                return time.time() - os.path.getmtime(self.path) > _UNREADABLE_GRACE
            except FileNotFoundError:
                return True
        if float(holder.get("expires", 0)) < time.time():
            return True
        return holder.get("host") == host_name() and not _pid_alive(int(holder.get("pid", -1)))

    def acquire(self) -> bool:
        """Take the lock (True), or leave it to its live holder (False). Raises OSError when the directory cannot
        be written."""
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if not self._stale(self.holder()):
                    return False
                try:  # take over: only one process can rename the stale file away
                    os.rename(self.path, f"{self.path}.stale-{self.writer}")
                    os.unlink(f"{self.path}.stale-{self.writer}")
                except FileNotFoundError:
                    pass  # another process took it over first: try to create it again
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"writer": self.writer, "host": host_name(), "pid": os.getpid(),
                           "expires": time.time() + self.lease}, f)
                f.flush()
                os.fsync(f.fileno())
            return True
        return False

    def held(self) -> bool:
        """Whether this writer still holds an unexpired lease (checked before a compaction commits)."""
        h = self.holder()
        return h is not None and h.get("writer") == self.writer and float(h.get("expires", 0)) > time.time()

    def release(self) -> None:
        """Remove the lock file if this writer holds it."""
        h = self.holder()
        if h is not None and h.get("writer") == self.writer:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def busy_error(self) -> CorpusError:
        """The error for a caller that needs the lock now and finds it held (names the file and the holder)."""
        h = self.holder() or {}
        until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(h.get("expires", 0))))
        where = "this host" if h.get("host") == host_name() else f"host {h.get('host')}"
        return CorpusError(f"{self.path} is held by writer {h.get('writer')} (pid {h.get('pid')} on {where}) until "
                           f"{until}: it is compacting this corpus now; retry after that, or, if that process is "
                           f"gone, once the lease expires")


__all__ = ["LEASE_SECONDS", "LOCK_FILE", "CompactionLock", "host_name", "writer_id"]
