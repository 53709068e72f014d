"""A rank that dies mid-run: the surviving launcher process (rank 0) sees a collective fail (gloo: "Connection closed
by peer", NCCL: a watchdog or communicator error) and would end in a long traceback. Instead: one line naming the
lost rank (from the launcher's own child processes: which one ended, and how) and the command that resumes the
run (from its newest complete checkpoint)."""
from __future__ import annotations

import signal
import subprocess

import torch

from dspark.errors import UserError

# what a collective raises on the surviving ranks when a peer is gone
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed",
              "nccl communicator was aborted", "ncclremoteerror")


class RankLost(UserError):
    """Another rank of this job died; the message names it and the resume command."""


def is_peer_loss(err: BaseException) -> bool:
    """Is `err` (or what caused it) a failed collective because another rank is gone?"""
    dist_errors = tuple(getattr(torch.distributed, n) for n in ("DistError",) if hasattr(torch.distributed, n))
    while err is not None:
        text = str(err).lower()
        if isinstance(err, dist_errors) or (isinstance(err, RuntimeError) and any(k in text for k in _PEER_LOST)):
            return True
        err = err.__cause__ or err.__context__
    return False


def _how(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def dead_children(procs: list[subprocess.Popen], wait_s: float = 5.0) -> list[tuple[int, int, int]]:
    """(rank, pid, return code) of the launcher's rank processes that have ended with a failure; rank i + 1 is
    procs[i] (the launcher itself is rank 0). A peer's death is what made the collective fail, so it has ended or
    ends within moments: each is given up to `wait_s` (a safety net, not the signal)."""
    out = []
    for i, proc in enumerate(procs):
        try:
            rc = proc.wait(timeout=wait_s) if proc.poll() is None else proc.returncode
        except subprocess.TimeoutExpired:
            continue
        if rc:
            out.append((i + 1, proc.pid, rc))
    return out


def rank_lost_error(err: BaseException, trainer, resume: str) -> RankLost | None:
    """RankLost naming the dead rank(s) when `err` is a failed collective because a peer died, else None."""
    if not is_peer_loss(err) or int(getattr(trainer, "world_size", 1)) < 2:
        return None
    procs = list(getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or [])
    dead = dead_children(procs)
    world = trainer.world_size
    if dead:
        who = ", ".join(f"rank {r} of {world} (pid {pid}, {_how(rc)})" for r, pid, rc in dead)
    else:
        who = f"another rank of {world} (on another node, or its process is not this one's child)"
    return RankLost(f"{who} died during training ({type(err).__name__}: {str(err).splitlines()[0][:120]}); the run "
                    f"stopped; resume it from its newest complete checkpoint: {resume}")
