"""One training run per run directory: a lock file that a second run refuses and a killed run's successor
recognises as stale, and the clean-up a restart needs (temp files of interrupted atomic writes)."""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

from dspark.errors import RunDirBusy
from dspark.io import remove_stale_tmp

log = logging.getLogger("dspark.train")

LOCK_NAME = ".dspark-run.lock"
# Folders of a run dir that dspark writes with atomic temp + rename.
ATOMIC_FOLDERS = ("", "checkpoints", "draft")


def is_launcher_process() -> bool:
    """True in the process that started the run (not a DDP/torchrun worker of rank > 0, nor another node)."""
    for var in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "0") not in ("", "0"):
            return False
    return True


def _process_start(pid: int) -> str | None:
    """The kernel's start time of `pid` (Linux /proc), to tell a live holder from a reused pid; None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22 (starttime), counted after the command name


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _process_start(pid)
    return start is None or now is None or now == start


class RunLock:
    """`<run_dir>/.dspark-run.lock` created with O_EXCL: {pid, host, process start time, started}."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half-written by a process killed while creating it: treated as stale

    def _is_stale(self, holder: dict) -> bool:
        if not holder or "pid" not in holder:
            return True
        if holder.get("host") != socket.gethostname():
            return False  # cannot see the process: only its owner (or a human) can say it is dead
        return not _alive(int(holder["pid"]), holder.get("start"))

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _process_start(os.getpid()),
              "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):
            try:
                fd = os.open(str(self.path), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released between our open and our read
                if not self._is_stale(holder):
                    where = f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
                    raise RunDirBusy(
                        f"run_dir {self.path.parent}: another run is using it ({where}); wait for it to end or "
                        f"choose another run_dir= (if that run is dead, delete {self.path})")
                log.warning("run_dir %s: removing the stale lock of a run that is no longer alive (%s)",
                            self.path.parent, holder or "unreadable lock file")
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
                fh.flush()
                os.fsync(fh.fileno())
            self.held = True
            return
        raise RunDirBusy(f"run_dir {self.path.parent}: could not take {self.path} (another run keeps creating it)")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False


@contextmanager
def claim_run_dir(run_dir: Path):
    """Holds the run dir's lock for the body (launcher process only) and clears stale temp files first."""
    run_dir = Path(run_dir)
    if not is_launcher_process():
        yield
        return
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        for sub in ATOMIC_FOLDERS:
            for p in remove_stale_tmp(run_dir / sub):
                log.info("removed %s (left by an interrupted write)", p)
        yield
    finally:
        lock.release()
