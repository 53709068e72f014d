"""Online feature mode (`data.feature_stream=true`): training reads the target features while a producer writes them.

The producer is the ordinary offline build (dspark.data.feature_cache.write_feature_cache: hf, or vLLM through
`build_feature_cache_offline`) run in a child process of the trainer (`python -m dspark.produce_features SPEC`),
so the trainer loads only the target's head (dspark.targets.head_only). Three things differ from an offline build:

* production order: the shards holding the held-out tail (validation) first, then the rest in index order
  (`production_order`), so validation never waits for more than those shards;
* progress: after every shard, `progress.json` lists the shards complete so far with their sha256 + size (written
  by write_feature_cache; removed when meta.json, written last as always, makes the folder an ordinary cache);
* liveness: the producer holds an exclusive flock on `<cache>/.producer.lock` from before it starts (the trainer takes
  it and hands the descriptor over) until it ends, however it ends (the kernel releases it), which any reading
  process can probe.

`FeatureStream` is the reading side (the FeatureCache interface AnchoredExamples uses): an example's read waits for
its shard to be listed in progress.json, then checks the file against the listed size and sha256 and its header
against this run's cache key and example range (refused, naming the file, otherwise: a shard of another build is
never read); a producer that is no longer alive ends the wait with its log's tail. Once meta.json exists, reads go to
the complete FeatureCache. The order training consumes (ChatDataModule's first pass, `first_pass_groups`) follows the
production order, so training starts once the shards of its first batch are written.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import torch

from dspark.data import feature_cache
from dspark.data.feature_cache import (META_NAME, PROGRESS_NAME, CacheLayout, FeatureCache, header_problem,
                                       read_example, shard_header, shard_name)
from dspark.errors import IntegrityError, UserError
from dspark.integrity import digest_file
from dspark.io import atomic_write_json

log = logging.getLogger("dspark.feature_stream")

SHARD_SIZE = feature_cache.SHARD_SIZE  # examples per shard the stream's producer writes (the offline default)
LOCK_NAME = ".producer.lock"
PRODUCER_DIR = "feature_producer"  # in the run dir: the child's spec.json and producer.log
POLL_S = 0.05  # how often a waiting read looks at progress.json / the producer's lock
LOG_EVERY_POLLS = 600  # a waiting read says so again after this many polls


class FeatureProducerError(UserError):
    """The feature producer ended without writing the shard a read waits for (the message has its log's tail)."""


# ---- order -------------------------------------------------------------------------------------------
def held_out_shards(num_examples: int, held_out: int, shard_size: int) -> list[int]:
    """The shards holding the last `held_out` examples (the validation rows, ChatDataModule's tail), ascending."""
    first = (num_examples - held_out) // shard_size
    return list(range(first, -(-num_examples // shard_size)))


def production_order(num_examples: int, held_out: int, shard_size: int) -> list[int]:
    """Shard indices in the order the stream's producer writes them: the held-out shards, then the rest ascending."""
    tail = held_out_shards(num_examples, held_out, shard_size)
    return tail + list(range(tail[0]))


def first_pass_groups(num_examples: int, held_out: int, shard_size: int) -> list[range]:
    """The training indices (0 .. num_examples - held_out - 1) of each shard in production order, empty ones left out:
    the groups ChatDataModule's first pass walks through one after the other (ResumableBatchSampler)."""
    n_train = num_examples - held_out
    groups = [range(k * shard_size, min(n_train, (k + 1) * shard_size))
              for k in production_order(num_examples, held_out, shard_size)]
    return [g for g in groups if len(g)]


# ---- liveness: the producer's lock -------------------------------------------------------------------
def take_producer_lock(folder: Path) -> int | None:
    """The cache's producer lock, taken without waiting -> its file descriptor, handed to the producer child, which
    holds it as long as it lives (so it is held from before the child starts: no moment where a reader could take
    a starting producer for a dead one); None when another producer holds it."""
    fd = os.open(Path(folder) / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def producer_alive(folder: Path) -> bool:
    """Whether a producer holds `folder`'s lock (from any process: a lock probe, never a pid)."""
    try:
        fd = os.open(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # (releases the probe's lock when it got one)
    return False


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None:
        return "(its log is with the process that started it)"
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# ---- reading side ------------------------------------------------------------------------------------
class FeatureStream:
    """A feature cache being written: `get(idx)` -> (aux [S_i, n*H], final [S_i, H]), waiting for the example's shard.

    `key`: this run's cache key (every shard read must carry it); `num_examples`, `shard_size`: the build's layout;
    `dtype`, `layout`: as in the cache's meta.json-to-be; `log_path`: the producer's log (for the error naming why
    it ended). Picklable (open shards are dropped), so DataLoader workers each open their own.
    """

    def __init__(self, path, key: str, num_examples: int, shard_size: int, dtype: torch.dtype,
                 layout: CacheLayout | None = None, log_path=None, poll_s: float = POLL_S):
        self.path, self.key = Path(path), str(key)
        self.num_examples, self.shard_size = int(num_examples), int(shard_size)
        self.dtype, self.layout = dtype, layout or CacheLayout()
        self.log_path = None if log_path is None else Path(log_path)
        self.poll_s = poll_s
        self.producer = None  # the launching process's Producer (finish / stop); None elsewhere
        self._cache: FeatureCache | None = None  # once meta.json exists
        self._open: OrderedDict[int, object] = OrderedDict()
        self._digests: dict[int, str] = {}  # shard -> sha256 this process checked

    def __len__(self) -> int:
        return self.num_examples

    @property
    def num_shards(self) -> int:
        return -(-self.num_examples // self.shard_size)

    def get(self, idx: int, dtype: torch.dtype | None = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Example `idx` of the dataset -> (aux [S_i, n*H], final [S_i, H]) in `dtype` (None: the stored dtype),
        once its shard is written."""
        idx = int(idx)
        if not 0 <= idx < self.num_examples:
            raise IndexError(f"feature stream {self.path}: index {idx} outside [0, {self.num_examples})")
        if self._cache is None:
            f = self._shard(idx // self.shard_size)
            if f is not None:
                return read_example(f, idx, self.layout, self.dtype, dtype)
        return self._cache.get(idx, dtype)

    # ---- shards ----
    def _shard(self, k: int):
        """Shard k opened (checked once per process), or None once the whole cache is complete (self._cache)."""
        f = self._open.get(k)
        if f is not None:
            self._open.move_to_end(k)
            return f
        entry = self._wait_for(k)
        if entry is None:
            return None
        f = self._checked_open(k, entry)
        self._open[k] = f
        while len(self._open) > 4:
            self._open.popitem(last=False)
        return f

    def _wait_for(self, k: int) -> dict | None:
        """Blocks until shard k is listed in progress.json (-> its {sha256, size}) or meta.json exists (-> None,
        self._cache set). Liveness is sampled before the files are looked at: a producer found dead has written
        everything it ever will, so finding nothing new then means it ended without this shard."""
        polls = 0
        while True:
            alive = self._producer_alive()
            if self._completed():
                return None
            entry = self._published().get(shard_name(k))
            if entry is not None:
                return entry
            if not alive:
                raise self._ended_error(k)
            if polls % LOG_EVERY_POLLS == 0:
                lo = k * self.shard_size
                log.info("feature stream: waiting for %s (examples %d-%d; %d of %d shards written)", shard_name(k),
                         lo, min(self.num_examples, lo + self.shard_size) - 1, len(self._published()),
                         self.num_shards)
            time.sleep(self.poll_s)
            polls += 1

    def _producer_alive(self) -> bool:
        """The lock probe; in the process that started the producer also its child process (so an exit in progress,
        lock released but not yet reaped, is reported with its exit status)."""
        return producer_alive(self.path) or (self.producer is not None and self.producer.returncode() is None)

    def _published(self) -> dict:
        """progress.json's shards when it is this build's (its key and shard size), else {} (another build's file
        is never trusted: its producer rewrites it when it starts)."""
        try:
            progress = json.loads((self.path / PROGRESS_NAME).read_text())
        except (OSError, ValueError):
            return {}
        if progress.get("key") != self.key or progress.get("shard_size") != self.shard_size:
            return {}
        return dict(progress.get("shards") or {})

    def _completed(self) -> bool:
        """meta.json exists: switch every later read to the complete cache (its key checked: this run's)."""
        if self._cache is not None:
            return True
        if not (self.path / META_NAME).is_file():
            return False
        cache = FeatureCache(self.path)
        if cache.meta["key"] != self.key:
            raise IntegrityError(f"feature stream {self.path}: the finished cache has key {cache.meta['key']}, this "
                                 f"run's is {self.key} (another build finished in this folder); use another folder")
        cache._verified |= {k for k, sha in self._digests.items()  # no second hash of what this process checked
                            if cache.meta["shards"].get(shard_name(k), {}).get("sha256") == sha}
        self._cache = cache
        self._open.clear()
        log.info("feature stream: the cache is complete (%s); reads go to it", self.path)
        return True

    def _checked_open(self, k: int, entry: dict):
        """Shard k's file against its progress.json entry (size, sha256) and its header against this run's key and
        example range -> an open safetensors handle; IntegrityError naming the file otherwise."""
        from safetensors import safe_open

        path = self.path / shard_name(k)
        hint = f"delete {path} and rerun: the producer writes it again"
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise IntegrityError(f"{path}: listed in {PROGRESS_NAME} but missing; {hint}") from None
        if size != entry["size"]:
            raise IntegrityError(f"{path}: {'truncated' if size < entry['size'] else 'grown'} ({size} bytes, "
                                 f"{PROGRESS_NAME} says {entry['size']}); {hint}")
        sha = digest_file(path)["sha256"]
        if sha != entry["sha256"]:
            raise IntegrityError(f"{path}: content altered (sha256 does not match {PROGRESS_NAME}); {hint}")
        lo = k * self.shard_size
        problem = header_problem(shard_header(path), self.key, lo, min(self.num_examples, lo + self.shard_size) - lo)
        if problem is not None:
            raise IntegrityError(f"{path}: refused, {problem}; {hint}")
        self._digests[k] = sha
        return safe_open(str(path), framework="pt")

    def _ended_error(self, k: int) -> FeatureProducerError:
        done = len(self._published())
        rc = self.producer.returncode() if self.producer is not None else None
        how = f" (exit status {rc})" if rc is not None else ""
        return FeatureProducerError(
            f"feature stream {self.path}: the producer ended{how} before writing {shard_name(k)} ({done} of "
            f"{self.num_shards} shards written). Rerun to resume: the producer keeps the complete shards and "
            f"training resumes from its checkpoint (or starts over, when it had none yet). The producer's log {self.log_path} ends with:\n"
            f"{_tail(self.log_path)}")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_open=OrderedDict(), producer=None, _cache=None, _digests={})
        return state


# ---- the producer process (launching side) ----------------------------------------------------------
def producer_command(spec_path: Path) -> list[str]:
    """The child's command line (tests wrap it to slow or break the producer)."""
    return [sys.executable, "-m", "dspark.produce_features", str(spec_path)]


def _child_env() -> dict:
    root = str(Path(__file__).resolve().parents[2])  # the checkout holding dspark/
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


class Producer:
    """The child process writing the stream's cache: started by `launch`, awaited by `finish`, ended by `stop`."""

    def __init__(self, proc: subprocess.Popen, folder: Path, log_path: Path):
        self.proc, self.folder, self.log_path = proc, Path(folder), Path(log_path)

    @classmethod
    def launch(cls, spec: dict, work_dir: Path, lock_fd: int) -> "Producer":
        """Writes `spec` to work_dir/spec.json and starts the child (output appended to work_dir/producer.log),
        handing it the producer lock's descriptor `lock_fd` (closed here: the lock is then the child's alone)."""
        work_dir.mkdir(parents=True, exist_ok=True)
        spec_path, log_path = work_dir / "spec.json", work_dir / "producer.log"
        try:
            atomic_write_json(spec_path, {**spec, "lock_fd": lock_fd})
            with open(log_path, "a") as fh:
                fh.write(f"---- producer for {spec['path']} (trainer pid {os.getpid()}) ----\n")
                fh.flush()
                proc = subprocess.Popen(producer_command(spec_path), stdout=fh, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=_child_env(), pass_fds=(lock_fd,))
        finally:
            os.close(lock_fd)
        return cls(proc, Path(spec["path"]), log_path)

    def returncode(self) -> int | None:
        return self.proc.poll()

    def finish(self) -> None:
        """Waits for the producer to complete the cache (training may end first); FeatureProducerError if it fails."""
        if self.proc.poll() is None:
            log.info("feature stream: training is done; waiting for the producer to complete %s (pid %d)",
                     self.folder, self.proc.pid)
        rc = self.proc.wait()
        if rc != 0 or not (self.folder / META_NAME).is_file():
            raise FeatureProducerError(f"feature stream: the producer of {self.folder} failed (exit status {rc}) "
                                       f"after training ended (the trained draft is complete; the cache resumes on "
                                       f"the next run). {self.log_path} ends with:\n{_tail(self.log_path)}")

    def stop(self) -> None:
        """Ends the child (training failed): the shards it completed stay, the next run resumes the build."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def producer_scope(features):
    """Around everything after the DataModule is built: on success waits for the stream's producer to complete the
    cache, on an error stops it. Nothing to do for an offline cache (or a stream another process started)."""
    producer = getattr(features, "producer", None)
    if producer is None:
        yield
        return
    try:
        yield
    except BaseException:
        producer.stop()
        raise
    producer.finish()
