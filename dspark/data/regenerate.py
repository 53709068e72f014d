"""Regenerate the assistant answers of conversation records with the target (SPEC.md section 3).

A draft is trained on text its target would write, so the original assistant turns of a prompt set
(ShareGPT, ...) are thrown away and rewritten by the target itself, non-thinking:

* :func:`regenerate` keeps the system and user turns of each record, drops its assistant turns,
  and generates one assistant answer after EVERY user turn, in order: the prompt of turn t holds
  the answers regenerated for turns < t (consecutive user turns, as in MT-Bench ``{"turns": [...]}``
  files, each get an answer). Records are processed in batches; within a batch all records advance
  one turn per generator call.
* Generators share a small protocol, ``generate(batch_of_message_lists, sampling=None) -> list[str]``
  (plus a ``name``): :class:`HFGenerator` runs a local transformers model (batched, left padding,
  the tokenizer's chat template with ``add_generation_prompt=True``), :class:`OpenAIChatGenerator`
  talks to an OpenAI-compatible server the user already runs (vLLM, SGLang, llama.cpp...).

Output and resumption (the file is the state; nothing else is kept):

* ``out_path``: one JSON line per finished record, ``{"id", "messages", "meta"}`` with
  ``meta = {"generator", "sampling", "finish_reasons"}`` (one finish reason per regenerated turn:
  "stop", "length" or null when the generator does not say). Lines are appended, flushed and
  fsynced once per batch.
* ``<out_path>.failed.jsonl``: one line per record that could not be regenerated (the generator
  raised for it, returned an empty answer, or the record has no user turn), with the error. Failed
  ids are skipped on later runs unless ``retry_failed=True``; the sidecar is compacted at the end of
  every run (last entry per id, ids that are now done removed).
* On restart, ids already in ``out_path`` (or failed, see above) are skipped and counted as
  skipped; a partial last line (a crash mid-write) is truncated away, and its record regenerated.
  Duplicate ids in the input are skipped after the first. So every id ends up exactly once in
  ``out_path`` or in the sidecar: no duplicates, no losses.

Failure classes: :class:`GenerationError` (and any other ``Exception`` from ``generate``) is
about one record and ends in the sidecar; :class:`GeneratorUnavailable` means the generator as a
whole is unusable (server down after retries, bad URL, wrong model or key) and aborts the run
instead of marking every remaining record failed. Rerun to resume.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import hashlib
import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Protocol

logger = logging.getLogger(__name__)

Message = dict  # {"role": "system"|"user"|"assistant", "content": str}

# --------------------------------------------------------------------------------------------
# Protocol, sampling parameters, results, errors
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """How answers are sampled. ``temperature == 0`` means greedy (``top_p`` is then ignored).

    ``seed`` makes runs repeatable: HF generation seeds each call from (seed, the batch's
    prompts); the OpenAI client sends a per-request seed derived from (seed, that prompt).
    """

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Completion(str):
    """A generated answer: a ``str`` carrying ``finish_reason`` ("stop", "length" or None)."""

    finish_reason: str | None

    def __new__(cls, text: str, finish_reason: str | None = None) -> "Completion":
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        return obj


class GenerationError(RuntimeError):
    """Generation failed for a particular request; the record is marked failed."""


class BatchPartialFailure(GenerationError):
    """Some rows of a batch failed: ``results[i]`` is a Completion or the row's exception."""

    def __init__(self, results: list):
        self.results = results
        errors = [r for r in results if isinstance(r, BaseException)]
        super().__init__(f"{len(errors)} of {len(results)} rows failed; first: {errors[0]!r}")


class GeneratorUnavailable(RuntimeError):
    """The generator as a whole cannot work (unreachable server, bad URL/model/key): abort the run."""


class Generator(Protocol):
    """What :func:`regenerate` needs from a generator."""

    name: str

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[str]:
        """One assistant answer per message list (each ends with a user turn)."""
        ...


def _derived_seed(seed: int, payload: object) -> int:
    """A 31-bit seed from the user seed and some JSON-able content (stable across runs)."""
    text = json.dumps([seed, payload], ensure_ascii=False, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------
# Local transformers generator
# --------------------------------------------------------------------------------------------


class HFGenerator:
    """Batched generation with a local transformers causal LM (left padding, chat template).

    Prompts are rendered with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
    **chat_template_kwargs)``; ``chat_template_kwargs`` defaults to ``{"enable_thinking": False}``
    (non-thinking answers for templates that know the switch, ignored by the others). Rendered text
    is tokenized WITHOUT extra special tokens (the template already has them) and left-padded, so
    every row's last prompt token is at the same column and generation continues all rows at once.
    Each answer stops at the first end token (``generation_config.eos_token_id`` and the
    tokenizer's eos); special tokens are removed from the decoded text.
    """

    def __init__(self, model, tokenizer, device=None, sampling: SamplingParams | None = None, *,
                 chat_template_kwargs: dict | None = None, name: str | None = None):
        import torch  # noqa: PLC0415 (keep the OpenAI path free of torch)

        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("HFGenerator needs a tokenizer with a chat template (tokenizer.chat_template is empty)")
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.sampling = sampling or SamplingParams()
        self.chat_template_kwargs = {"enable_thinking": False} if chat_template_kwargs is None else chat_template_kwargs
        self.stop_ids = self._stop_ids(model, tokenizer)
        if not self.stop_ids:
            raise ValueError("no end-of-turn token: set tokenizer.eos_token or generation_config.eos_token_id")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.name = name or f"hf:{getattr(model.config, '_name_or_path', '') or type(model).__name__}"

    @staticmethod
    def _stop_ids(model, tokenizer) -> list[int]:
        ids = set()
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return sorted(ids)

    def render(self, messages: Sequence[Message]) -> str:
        """The prompt text for one conversation (ending with the assistant header)."""
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=True, **self.chat_template_kwargs
        )

    def _generation_config(self, sampling: SamplingParams):
        from transformers import GenerationConfig  # noqa: PLC0415

        base = getattr(self.model, "generation_config", None)
        config = copy.deepcopy(base) if base is not None else GenerationConfig()
        # Exactly the requested sampling: no top-k, no penalties inherited from the checkpoint.
        config.update(
            max_new_tokens=sampling.max_new_tokens, max_length=None, min_new_tokens=None, min_length=0,
            do_sample=not sampling.greedy, num_beams=1, top_k=None if sampling.greedy else 0, repetition_penalty=1.0,
            temperature=None if sampling.greedy else sampling.temperature,
            top_p=None if sampling.greedy else sampling.top_p,
            pad_token_id=self.pad_id, eos_token_id=list(self.stop_ids),
        )
        return config

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[Completion]:
        import torch  # noqa: PLC0415

        sampling = sampling or self.sampling
        if not batch:
            return []
        texts = [self.render(messages) for messages in batch]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                             add_special_tokens=False)
        input_ids = enc["input_ids"].to(self.device)  # [B, S] left-padded
        attention_mask = enc["attention_mask"].to(self.device)  # [B, S] 0 on padding
        fork_devices = [self.device] if self.device.type == "cuda" else []
        with torch.inference_mode(), torch.random.fork_rng(devices=fork_devices):
            torch.manual_seed(_derived_seed(sampling.seed, texts))
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask,
                generation_config=self._generation_config(sampling),
            )  # [B, S + n_new]
        new_tokens = out[:, input_ids.shape[1]:].tolist()  # B lists of n_new ids
        stop = set(self.stop_ids)
        results = []
        for row in new_tokens:
            end = next((i for i, tok in enumerate(row) if tok in stop), None)
            kept = row if end is None else row[:end]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            results.append(Completion(text, "length" if end is None else "stop"))
        return results


# --------------------------------------------------------------------------------------------
# OpenAI-compatible HTTP client (standard library only)
# --------------------------------------------------------------------------------------------

_RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
_FATAL_STATUS = {401, 403, 404, 405}  # wrong key, URL or model: nothing a retry or another record fixes


class OpenAIChatGenerator:
    """Client for ``POST {base_url}/chat/completions`` of an OpenAI-compatible server.

    ``base_url`` is the API root, e.g. ``http://127.0.0.1:8000/v1``. Rows of a batch are sent as
    concurrent requests (``concurrency`` at a time; the server batches them). Connection errors,
    timeouts and status 408/409/425/429/5xx are retried ``max_retries`` times with exponential
    backoff, then raise :class:`GeneratorUnavailable`; 401/403/404/405 raise it at once (wrong
    key, URL or model). Other 4xx (e.g. a prompt longer than the context) raise
    :class:`GenerationError` for that row only. Errors quote the server's own message.

    ``disable_thinking`` adds ``"chat_template_kwargs": {"enable_thinking": false}`` to requests
    (understood by vLLM, SGLang and llama.cpp; turn it off for servers that reject unknown
    fields); ``extra_body`` is merged into every request body.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None, timeout: float = 300.0,
                 max_retries: int = 3, sampling: SamplingParams | None = None, *, backoff_s: float = 1.0,
                 concurrency: int = 8, disable_thinking: bool = True, extra_body: dict | None = None):
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if max_retries < 0 or concurrency < 1:
            raise ValueError("max_retries must be >= 0 and concurrency >= 1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.concurrency = concurrency
        self.sampling = sampling or SamplingParams()
        self.extra_body = dict(extra_body or {})
        if disable_thinking:
            self.extra_body.setdefault("chat_template_kwargs", {"enable_thinking": False})
        self.name = f"openai:{model}@{base_url.rstrip('/')}"

    def request_body(self, messages: Sequence[Message], sampling: SamplingParams) -> dict:
        """The JSON body sent for one conversation."""
        body = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": 1.0 if sampling.greedy else sampling.top_p,
            "seed": _derived_seed(sampling.seed, body_messages_key(messages)),
            "n": 1,
            "stream": False,
        }
        body.update(self.extra_body)
        return body

    def _post(self, body: dict) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=json.dumps(body).encode("utf-8"), headers=headers,
                                         method="POST")
        with urllib.request.urlopen(request, timeout=self.timeout) as response:
            raw = response.read()
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise GenerationError(f"{self.url} returned invalid JSON: {raw[:200]!r}") from exc

    @staticmethod
    def _server_message(error: urllib.error.HTTPError) -> str:
        try:
            raw = error.read()
        except OSError:
            return ""
        try:
            payload = json.loads(raw)
            detail = payload.get("error", payload) if isinstance(payload, dict) else payload
            if isinstance(detail, dict):
                detail = detail.get("message", detail)
            return str(detail)[:500]
        except ValueError:
            return raw[:500].decode("utf-8", "replace")

    def complete(self, messages: Sequence[Message], sampling: SamplingParams | None = None) -> Completion:
        """One chat completion, with retries (see the class docstring for the error policy)."""
        sampling = sampling or self.sampling
        body = self.request_body(messages, sampling)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), 30.0))
            try:
                payload = self._post(body)
            except urllib.error.HTTPError as exc:
                detail = self._server_message(exc)
                last = f"HTTP {exc.code} from {self.url}: {detail}"
                if exc.code in _FATAL_STATUS:
                    raise GeneratorUnavailable(
                        f"{last} (check --openai-base-url, the model name {self.model!r} and the API key)"
                    ) from exc
                if exc.code in _RETRY_STATUS or exc.code >= 500:
                    logger.warning("%s; retry %d/%d", last, attempt + 1, self.max_retries)
                    continue
                raise GenerationError(last) from exc
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError,
                    socket.timeout) as exc:
                reason = getattr(exc, "reason", exc)
                last = f"cannot reach {self.url}: {reason!r}"
                logger.warning("%s; retry %d/%d", last, attempt + 1, self.max_retries)
                continue
            return self._parse(payload)
        raise GeneratorUnavailable(f"giving up after {self.max_retries + 1} attempts: {last}")

    def _parse(self, payload: dict) -> Completion:
        try:
            choice = payload["choices"][0]
            content = choice["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise GenerationError(f"unexpected response shape from {self.url}: {str(payload)[:300]}") from exc
        return Completion(content or "", choice.get("finish_reason"))

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[Completion]:
        sampling = sampling or self.sampling
        if len(batch) == 1 or self.concurrency == 1:
            results = []
            for messages in batch:
                try:
                    results.append(self.complete(messages, sampling))
                except GenerationError as exc:
                    results.append(exc)
        else:
            with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(batch))) as pool:
                futures = [pool.submit(self.complete, messages, sampling) for messages in batch]
                results = []
                for future in futures:
                    try:
                        results.append(future.result())
                    except GenerationError as exc:
                        results.append(exc)
        if any(isinstance(r, BaseException) for r in results):
            raise BatchPartialFailure(results)
        return results


def body_messages_key(messages: Sequence[Message]) -> list:
    """The part of a conversation that identifies a prompt (for per-prompt seeds)."""
    return [[m["role"], m["content"]] for m in messages]


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
class _Job:
    """One record in flight: the plan (messages with None where an answer goes) and progress."""

    rid: str
    plan: list[Message | None]
    cursor: int = 0  # index into plan
    turn: int = 0  # answers generated so far
    messages: list[Message] = field(default_factory=list)  # the conversation being rebuilt
    finish_reasons: list[str | None] = field(default_factory=list)
    error: str | None = None

    def next_prompt(self) -> list[Message] | None:
        """Advance over kept turns; the prompt for the next answer, or None when finished."""
        while self.cursor < len(self.plan):
            item = self.plan[self.cursor]
            if item is None:
                return list(self.messages)
            self.messages.append(item)
            self.cursor += 1
        return None

    def add_answer(self, text: str, finish_reason: str | None) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.finish_reasons.append(finish_reason)
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


def _process_batch(generator, jobs: list[_Job], sampling: SamplingParams) -> None:
    """Advance every job of the batch turn by turn until each is finished or failed."""
    while True:
        active = [(job, prompt) for job in jobs if job.error is None
                  for prompt in [job.next_prompt()] if prompt is not None]
        if not active:
            return
        outputs = _run_rows(generator, [prompt for _, prompt in active], sampling)
        for (job, _), output in zip(active, outputs):
            if isinstance(output, BaseException):
                job.error = f"turn {job.turn}: {_error_text(output)}"
            elif not isinstance(output, str):
                job.error = f"turn {job.turn}: generator returned {type(output).__name__}, not str"
            elif not output.strip():
                job.error = f"turn {job.turn}: empty output"
            else:
                job.add_answer(str(output), getattr(output, "finish_reason", None))


def regenerate(records: Iterable[dict], generator: Generator, out_path: str | os.PathLike, *,
               batch_size: int = 8, max_new_tokens: int = 512, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, limit: int | None = None, retry_failed: bool = False) -> RegenStats:
    """Regenerate the assistant turns of ``records`` with ``generator`` into ``out_path`` (resumable).

    Args:
        records: conversation records ``{"id", "messages"}`` (any iterable; read lazily).
        generator: see :class:`Generator`; called with batches of up to ``batch_size`` prompts.
        out_path: JSON Lines output, appended to; its sidecar is ``<out_path>.failed.jsonl``.
        batch_size, max_new_tokens, temperature, top_p, seed: generation settings (see
            :class:`SamplingParams`); recorded in every output line's ``meta``.
        limit: consider only the first ``limit`` input records (the same set again on resume).
        retry_failed: regenerate records that failed in earlier runs instead of skipping them.

    Returns the :class:`RegenStats` of this run (also logged). See the module docstring for the
    file formats and the failure policy.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    failed_path = failed_path_for(out_path)
    done_ids = {row["id"] for row in read_jsonl_state(out_path, repair=True, fields=("id",))}
    _compact_failed(failed_path, done_ids)
    failed_before = {row["id"] for row in read_jsonl_state(failed_path, repair=True)}
    name = getattr(generator, "name", type(generator).__name__)
    meta_base = {"generator": name, "sampling": asdict(sampling)}
    stats = RegenStats()
    seen: set[str] = set()
    started = time.perf_counter()

    with open(out_path, "a", encoding="utf-8") as out, open(failed_path, "a", encoding="utf-8") as failed:

        def flush(batch: list[tuple[str, Exception | list]]) -> None:
            jobs = []
            for rid, plan in batch:
                job = _Job(rid, plan if isinstance(plan, list) else [])
                if isinstance(plan, Exception):
                    job.error = f"invalid record: {plan}"
                jobs.append(job)
            _process_batch(generator, jobs, sampling)
            good = [{"id": j.rid, "messages": j.messages,
                     "meta": {**meta_base, "finish_reasons": j.finish_reasons}} for j in jobs if j.error is None]
            bad = [{"id": j.rid, "error": j.error, "generator": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
                   for j in jobs if j.error is not None]
            _append_lines(out, good)  # finished records first: a crash between the two loses nothing
            _append_lines(failed, bad)
            done_ids.update(row["id"] for row in good)
            stats.done += len(good)
            stats.failed += len(bad)
            logger.info("regenerate: %s (%.1f s)", stats.summary(), time.perf_counter() - started)

        try:
            pending: list[tuple[str, Exception | list]] = []
            for record in islice(records, limit) if limit is not None else records:
                stats.total += 1
                if not isinstance(record, dict) or not isinstance(record.get("id"), (str, int)):
                    raise ValueError(f"input record #{stats.total} has no 'id' (str): resumption needs one")
                rid = str(record["id"])
                if rid in seen or rid in done_ids or (rid in failed_before and not retry_failed):
                    if rid in seen:
                        logger.warning("duplicate id %r in the input: skipped", rid)
                    stats.skipped += 1
                    continue
                seen.add(rid)
                try:
                    pending.append((rid, plan_record(record)))
                except ValueError as exc:
                    pending.append((rid, exc))
                if len(pending) == batch_size:
                    flush(pending)
                    pending = []
            if pending:
                flush(pending)
        finally:
            with contextlib.suppress(OSError, ValueError):
                failed.flush()
                _compact_failed(failed_path, done_ids)
    logger.info("regenerate finished: %s -> %s", stats.summary(), out_path)
    return stats
