"""Regenerate the assistant answers of conversation records with the target (docs/CONTRACTS.md §3): the
resumable loop.

A draft is trained on text its target would write, so the original assistant turns of a prompt set
(ShareGPT, ...) are thrown away and rewritten by the target itself, non-thinking:

* :func:`regenerate` keeps the system and user turns of each record, drops its assistant turns,
  and generates one assistant answer after EVERY user turn, in order: the prompt of turn t holds
  the answers regenerated for turns < t (consecutive user turns, as in MT-Bench ``{"turns": [...]}``
  files, each get an answer). Records are processed in batches; within a batch all records advance
  one turn per generator call.
* Generators follow the small protocol of :mod:`dspark.data.generator`
  (``generate(batch_of_message_lists, sampling=None) -> list[str]`` plus a ``name``):
  :class:`dspark.data.hf_generator.HFGenerator` (local transformers model),
  :class:`dspark.serving.vllm_generator.VLLMGenerator` (vLLM's offline engine),
  :class:`dspark.data.openai_generator.OpenAIChatGenerator` (an OpenAI-compatible server the user
  already runs: vLLM, SGLang, llama.cpp...).

Output and resumption (the file is the state; nothing else is kept):

* ``out_path``: one JSON line per finished record, ``{"id", "messages", "meta"}`` with
  ``meta = {"generator", "sampling", "finish_reasons", "answer_tokens"}`` (per regenerated turn: its
  finish reason, "stop", "length" or null when the generator does not say, and its answer length in
  tokens, null when unknown), plus the input record's ``source`` and ``license`` when it carries them
  (where the prompt came from and under which terms). Lines are appended, flushed and fsynced once per
  batch.
* ``<out_path>.failed.jsonl``: one line per record that could not be regenerated (the generator
  raised for it, returned an empty answer, or the record has no user turn), with the error. Failed
  ids are skipped on later runs unless ``retry_failed=True``; the sidecar is compacted at the end of
  every run (last entry per id, ids that are now done removed).
* On restart, ids already in ``out_path`` (or failed, see above) are skipped and counted as
  skipped; a partial last line (a crash mid-write) is truncated away, and its record regenerated.
  Duplicate ids in the input are skipped after the first. So every id ends up exactly once in
  ``out_path`` or in the sidecar: no duplicates, no losses.

Progress: every ``progress_every`` records (and at the end) one INFO line: records in the output / the
expected total (``limit``), this run's done / failed / skipped, records per minute and answer tokens per
second over this run's generation time, and the ETA of the records not yet read (:class:`Progress`).

Failure classes: :class:`GenerationError` (and any other ``Exception`` from ``generate``) is
about one record and ends in the sidecar; :class:`GeneratorUnavailable` means the generator as a
whole is unusable (server down after retries, bad URL, wrong model or key) and aborts the run
instead of marking every remaining record failed. Rerun to resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

from dspark.data.generator import (
    BatchPartialFailure,
    GenerationError,
    Generator,
    GeneratorUnavailable,
    Message,
    SamplingParams,
)

logger = logging.getLogger(__name__)

PROVENANCE_KEYS = ("source", "license")  # input record fields copied into the output line's meta

# --------------------------------------------------------------------------------------------
# The resumable regeneration loop
# --------------------------------------------------------------------------------------------


@dataclass
class RegenStats:
    """Counts of one :func:`regenerate` run; ``done + failed + skipped == total``."""

    done: int = 0  # regenerated and written in this run
    failed: int = 0  # recorded in the sidecar in this run
    skipped: int = 0  # already done/failed in earlier runs, or a duplicate id
    total: int = 0  # records read from the input (at most ``limit``)

    def summary(self) -> str:
        return f"done={self.done} failed={self.failed} skipped={self.skipped} total={self.total}"


def failed_path_for(out_path: str | os.PathLike) -> Path:
    """The failure sidecar of an output file: ``<out>.failed.jsonl``."""
    out_path = Path(out_path)
    return out_path.with_name(out_path.name + ".failed.jsonl")


def read_jsonl_state(path: Path, *, repair: bool, fields: Sequence[str] | None = None) -> list[dict]:
    """Complete JSON lines of an output/sidecar file; a partial last line is truncated away.

    Writes are appends of whole lines, so only the tail can be damaged: text after the last
    newline (a crash mid-write), or a last line that does not parse (garbage flushed by a crash).
    Both are dropped (the file is truncated to the last good line when ``repair``) and their
    record is simply regenerated. A malformed line anywhere else means the file was edited or
    damaged otherwise, and raises ValueError naming the line instead of guessing.
    The file is streamed; ``fields`` keeps only those keys of each row (e.g. ``("id",)``).
    """
    if not path.exists():
        return []
    rows, good_end, bad = [], 0, None
    with open(path, "rb") as handle:
        for lineno, line in enumerate(handle, start=1):
            if bad is not None:  # a malformed line with more text after it
                raise bad
            if not line.endswith(b"\n"):
                break  # partial tail
            try:
                row = json.loads(line) if line.strip() else None
                if row is not None and not (isinstance(row, dict) and isinstance(row.get("id"), str)):
                    raise ValueError("not an object with a string 'id'")
            except ValueError as exc:
                bad = ValueError(f"{path}:{lineno}: malformed line before the end of the file ({exc}); "
                                 "fix or remove it by hand")
                continue
            if row is not None:
                rows.append(row if fields is None else {k: row.get(k) for k in fields})
            good_end += len(line)
        size = handle.seek(0, os.SEEK_END)
    if good_end < size:
        logger.warning("%s: %s a partial last line (%d bytes) left by an interrupted write",
                       path, "truncating" if repair else "ignoring", size - good_end)
        if repair:
            with open(path, "r+b") as handle:
                handle.truncate(good_end)
                handle.flush()
                os.fsync(handle.fileno())
    return rows


def _append_lines(handle, rows: list[dict]) -> None:
    """Append rows as JSON lines in one write, then flush and fsync."""
    if not rows:
        return
    handle.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    handle.flush()
    os.fsync(handle.fileno())


def _rewrite_atomically(path: Path, rows: list[dict]) -> None:
    """Replace ``path`` by ``rows`` (temp file + fsync + rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        _append_lines(handle, rows)
    os.replace(tmp, path)


def _compact_failed(failed_path: Path, done_ids: set[str]) -> None:
    """Keep one entry (the last) per failed id, and none for ids that are done."""
    rows = read_jsonl_state(failed_path, repair=True)
    latest = {}
    for row in rows:
        if row["id"] not in done_ids:
            latest.pop(row["id"], None)
            latest[row["id"]] = row
    if len(latest) != len(rows):
        _rewrite_atomically(failed_path, list(latest.values()))


@dataclass
class ResumeState:
    """What the output files say is settled, and the ids this run has taken on."""

    done: set[str]  # ids in out_path
    failed_before: set[str]  # ids in the sidecar when the run started
    seen: set[str] = field(default_factory=set)  # ids taken on in this run

    @classmethod
    def load(cls, out_path: Path, failed_path: Path) -> "ResumeState":
        """Read both files (repairing a partial last line) and compact the sidecar."""
        done = {row["id"] for row in read_jsonl_state(out_path, repair=True, fields=("id",))}
        _compact_failed(failed_path, done)
        return cls(done, {row["id"] for row in read_jsonl_state(failed_path, repair=True, fields=("id",))})

    def take(self, rid: str, retry_failed: bool) -> bool:
        """True if this run should regenerate ``rid`` (and note it); False to skip it."""
        if rid in self.seen:
            logger.warning("duplicate id %r in the input: skipped", rid)
            return False
        if rid in self.done or (rid in self.failed_before and not retry_failed):
            return False
        self.seen.add(rid)
        return True


@dataclass
class _Job:
    """One record in flight: the plan (messages with None where an answer goes) and progress."""

    rid: str
    plan: list[Message | None]
    cursor: int = 0  # index into plan
    turn: int = 0  # answers generated so far
    messages: list[Message] = field(default_factory=list)  # the conversation being rebuilt
    finish_reasons: list[str | None] = field(default_factory=list)
    answer_tokens: list[int | None] = field(default_factory=list)
    error: str | None = None
    provenance: dict = field(default_factory=dict)  # the record's "source" / "license", if any

    @classmethod
    def start(cls, rid: str, record: dict) -> "_Job":
        """A job for a record; an invalid record gives a job that is failed from the start."""
        provenance = {k: record[k] for k in PROVENANCE_KEYS if isinstance(record.get(k), str)}
        try:
            return cls(rid, plan_record(record), provenance=provenance)
        except ValueError as exc:
            return cls(rid, [], error=f"invalid record: {exc}", provenance=provenance)

    def next_prompt(self) -> list[Message] | None:
        """Advance over kept turns; the prompt for the next answer, or None when finished."""
        while self.cursor < len(self.plan):
            item = self.plan[self.cursor]
            if item is None:
                return list(self.messages)
            self.messages.append(item)
            self.cursor += 1
        return None

    def add_answer(self, text: str, finish_reason: str | None, num_tokens: int | None = None) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.finish_reasons.append(finish_reason)
        self.answer_tokens.append(num_tokens)
        self.cursor += 1
        self.turn += 1


def plan_record(record: dict) -> list[Message | None]:
    """Kept system/user messages with ``None`` after every user turn (where an answer goes).

    Raises ValueError for a record the loop cannot regenerate (bad shape, unknown role, no user
    turn); the caller records it as failed.
    """
    messages = record.get("messages")
    if not isinstance(messages, list):
        raise ValueError("record has no 'messages' list")
    plan: list[Message | None] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"messages[{i}] is not {{'role': str, 'content': str}}")
        role = message.get("role")
        if role == "assistant":
            continue
        if role not in ("system", "user"):
            raise ValueError(f"messages[{i}] has unknown role {role!r}")
        plan.append({"role": role, "content": message["content"]})
        if role == "user":
            plan.append(None)
    if None not in plan:
        raise ValueError("record has no user turn to answer")
    return plan


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


def _run_rows(generator, prompts: list[list[Message]], sampling: SamplingParams) -> list:
    """Generate for every prompt; each result is a Completion/str or the row's exception.

    A batch-level exception is retried row by row so one bad record cannot fail its neighbours.
    :class:`GeneratorUnavailable` (and non-Exception interrupts) propagate.
    """
    try:
        outputs = generator.generate(prompts, sampling=sampling)
        if not isinstance(outputs, list) or len(outputs) != len(prompts):
            raise GenerationError(f"generator returned {type(outputs).__name__} of length "
                                  f"{len(outputs) if hasattr(outputs, '__len__') else '?'} for {len(prompts)} prompts")
        return outputs
    except GeneratorUnavailable:
        raise
    except BatchPartialFailure as exc:
        if len(exc.results) == len(prompts):
            return exc.results
        error: Exception = exc
    except Exception as exc:  # noqa: BLE001 (isolate the failing row below)
        error = exc
    if len(prompts) == 1:
        return [error]
    logger.warning("batch of %d failed (%s); retrying row by row", len(prompts), _error_text(error))
    return [_run_rows(generator, [prompt], sampling)[0] for prompt in prompts]


def _take_output(job: _Job, output) -> None:
    """Record a generator result for the job's current turn: its answer, or the reason the job failed."""
    if isinstance(output, BaseException):
        job.error = f"turn {job.turn}: {_error_text(output)}"
    elif not isinstance(output, str):
        job.error = f"turn {job.turn}: generator returned {type(output).__name__}, not str"
    elif not output.strip():
        job.error = f"turn {job.turn}: empty output"
    else:
        job.add_answer(str(output), getattr(output, "finish_reason", None), getattr(output, "num_tokens", None))


def _process_batch(generator, jobs: list[_Job], sampling: SamplingParams) -> None:
    """Advance every job of the batch turn by turn until each is finished or failed."""
    while True:
        active = [(job, prompt) for job in jobs if job.error is None
                  for prompt in [job.next_prompt()] if prompt is not None]
        if not active:
            return
        outputs = _run_rows(generator, [prompt for _, prompt in active], sampling)
        for (job, _), output in zip(active, outputs):
            _take_output(job, output)


@dataclass
class _Sink:
    """The two open files of a run and what each of their lines records besides the answers."""

    out: object  # text file, appended to
    failed: object  # text file, appended to
    generator_name: str
    meta: dict  # {"generator", "sampling"}

    def write(self, jobs: list[_Job]) -> tuple[list[str], int]:
        """Append finished jobs to the output, failed ones to the sidecar; (done ids, number failed)."""
        good = [{"id": j.rid, "messages": j.messages,
                 "meta": {**self.meta, "finish_reasons": j.finish_reasons, "answer_tokens": j.answer_tokens,
                          **j.provenance}}
                for j in jobs if j.error is None]
        bad = [{"id": j.rid, "error": j.error, "generator": self.generator_name,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S")} for j in jobs if j.error is not None]
        _append_lines(self.out, good)  # finished records first: a crash between the two loses nothing
        _append_lines(self.failed, bad)
        return [row["id"] for row in good], len(bad)


def _duration(seconds: float) -> str:
    """``3h05m``, ``12m30s`` or ``45s``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


@dataclass
class Progress:
    """Rate and ETA of one run. Time counts from the first generator call of the run (reading and
    skipping records done earlier is not generation); ``add`` is called after each batch."""

    expected_total: int | None  # records the run is meant to cover (``limit``), None when unknown
    every: int = 1  # report after at least this many newly settled records
    clock: object = time.perf_counter
    started: float | None = None
    settled: int = 0  # done + failed in this run
    tokens: int = 0  # answer tokens of this run's done records (those the generator counted)
    tokens_known: bool = True  # every answer so far came with a token count
    last_reported: int = 0

    def start(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def add(self, jobs: list[_Job]) -> None:
        self.settled += len(jobs)
        for job in jobs:
            if job.error is None:
                if any(t is None for t in job.answer_tokens):
                    self.tokens_known = False
                self.tokens += sum(t for t in job.answer_tokens if t is not None)

    def due(self) -> bool:
        return self.settled - self.last_reported >= max(1, self.every)

    def line(self, stats: RegenStats, in_output: int) -> str:
        """``1234/4000 records in the output (this run: done=.. failed=.. skipped=.. read=..), 15.3
        records/min, 41.0 answer tokens/s, ETA 3h01m``; ETA counts the records not read yet."""
        self.last_reported = self.settled
        elapsed = self.clock() - self.started if self.started is not None else 0.0
        total = f"/{self.expected_total}" if self.expected_total is not None else ""
        text = f"{in_output}{total} records in the output (this run: {stats.summary()})"
        if elapsed <= 0 or self.settled == 0:
            return text
        per_min = 60.0 * self.settled / elapsed
        text += f", {per_min:.1f} records/min"
        if self.tokens_known:
            text += f", {self.tokens / elapsed:.1f} answer tokens/s"
        if self.expected_total is not None:
            remaining = max(0, self.expected_total - stats.total)
            text += f", ETA {_duration(60.0 * remaining / per_min)} ({remaining} records not read yet)"
        return text


@dataclass
class _Run:
    """One :func:`regenerate` call in progress: its generator, files, resume state and counters."""

    generator: Generator
    sampling: SamplingParams
    sink: _Sink
    state: ResumeState
    progress: Progress
    stats: RegenStats = field(default_factory=RegenStats)

    def finish_batch(self, jobs: list[_Job]) -> None:
        """Generate every turn of a batch, then settle it."""
        self.progress.start()
        _process_batch(self.generator, jobs, self.sampling)
        self.settle(jobs)

    def stream(self, new_jobs: Iterable[_Job]) -> None:
        """Keep a streaming generator's rows full: a conversation's next turn, else the next record, goes in as
        soon as a row frees; each finished record is written at once (a kill loses only the rows in flight)."""
        ready: deque[tuple[_Job, list[Message]]] = deque()
        new_jobs = iter(new_jobs)

        def next_prompt():
            if ready:
                return ready.popleft()
            for job in new_jobs:
                prompt = job.next_prompt() if job.error is None else None
                if prompt is not None:
                    return job, prompt
                self.settle([job])  # invalid from the start
            return None

        self.progress.start()
        for job, output in self.generator.stream(next_prompt, self.sampling):
            _take_output(job, output)
            prompt = job.next_prompt() if job.error is None else None
            if prompt is not None:
                ready.append((job, prompt))
            else:
                self.settle([job])

    def settle(self, jobs: list[_Job]) -> None:
        """Write finished jobs, count them, report progress when due."""
        done_ids, n_failed = self.sink.write(jobs)
        self.state.done.update(done_ids)
        self.stats.done += len(done_ids)
        self.stats.failed += n_failed
        self.progress.add(jobs)
        if self.progress.due():
            self.report()

    def report(self) -> None:
        logger.info("regenerate: %s", self.progress.line(self.stats, len(self.state.done)))


def _new_jobs(records: Iterable[dict], state: ResumeState, stats: RegenStats, limit: int | None,
              retry_failed: bool) -> Iterator[_Job]:
    """A job per input record this run takes on (counting the read and the skipped ones in ``stats``)."""
    for record in islice(records, limit) if limit is not None else records:
        stats.total += 1
        if not isinstance(record, dict) or not isinstance(record.get("id"), (str, int)):
            raise ValueError(f"input record #{stats.total} has no 'id' (str): resumption needs one")
        rid = str(record["id"])
        if not state.take(rid, retry_failed):
            stats.skipped += 1
            continue
        yield _Job.start(rid, record)


class OutputBusy(RuntimeError):
    """Another regeneration is writing the same output (two writers would duplicate records)."""


@contextlib.contextmanager
def writing_alone(out_path: Path) -> Iterator[None]:
    """An exclusive lock on ``<out_path>.lock`` while a regeneration writes ``out_path`` (released when the process
    ends, however it ends); OutputBusy at once when another process holds it."""
    with open(out_path.with_name(out_path.name + ".lock"), "a+", encoding="utf-8") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            raise OutputBusy(f"{out_path}: {holder} is regenerating into it; wait for it to finish, or stop it (a "
                             "rerun resumes), or choose another --out") from None
        lock.seek(0)
        lock.truncate()
        lock.write(f"pid {os.getpid()}")
        lock.flush()
        yield


def regenerate(records: Iterable[dict], generator: Generator, out_path: str | os.PathLike, *,
               batch_size: int = 8, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, limit: int | None = None, retry_failed: bool = False,
               progress_every: int = 1, clock=time.perf_counter) -> RegenStats:
    """Regenerate the assistant turns of ``records`` with ``generator`` into ``out_path`` (resumable).

    Args:
        records: conversation records ``{"id", "messages"}`` (any iterable; read lazily).
        generator: see :class:`Generator`; called with batches of up to ``batch_size`` prompts, or, when it
            has ``stream(next_prompt, sampling)`` (the native engine), fed a prompt whenever a row frees.
        out_path: JSON Lines output, appended to; its sidecar is ``<out_path>.failed.jsonl``.
        batch_size, max_new_tokens, temperature, top_p, seed: generation settings (see
            :class:`SamplingParams`); recorded in every output line's ``meta``.
        limit: consider only the first ``limit`` input records (the same set again on resume).
        retry_failed: regenerate records that failed in earlier runs instead of skipping them.
        progress_every: log a progress line (rate, ETA against ``limit``) after at least this many
            newly settled records, and once at the end; ``clock``: its time source (tests).

    Returns the :class:`RegenStats` of this run (also logged). See the module docstring for the
    file formats and the failure policy.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    failed_path = failed_path_for(out_path)
    with writing_alone(out_path):
        return _regenerate(records, generator, out_path, failed_path, sampling, batch_size, limit, retry_failed,
                           Progress(limit, progress_every, clock))


def _regenerate(records: Iterable[dict], generator: Generator, out_path: Path, failed_path: Path,
                sampling: SamplingParams, batch_size: int, limit: int | None, retry_failed: bool,
                progress: Progress) -> RegenStats:
    state = ResumeState.load(out_path, failed_path)
    name = getattr(generator, "name", type(generator).__name__)

    with open(out_path, "a", encoding="utf-8") as out, open(failed_path, "a", encoding="utf-8") as failed:
        run = _Run(generator, sampling, _Sink(out, failed, name, {"generator": name, "sampling": asdict(sampling)}),
                   state, progress)
        stats = run.stats
        try:
            jobs = _new_jobs(records, state, stats, limit, retry_failed)
            if hasattr(generator, "stream"):
                run.stream(jobs)
            else:
                pending: list[_Job] = []
                for job in jobs:
                    pending.append(job)
                    if len(pending) == batch_size:
                        run.finish_batch(pending)
                        pending = []
                if pending:
                    run.finish_batch(pending)
            if run.progress.last_reported != run.progress.settled or run.progress.settled == 0:
                run.report()
        finally:
            with contextlib.suppress(OSError, ValueError):
                failed.flush()
                _compact_failed(failed_path, state.done)
    logger.info("regenerate finished: %s -> %s", stats.summary(), out_path)
    return stats
