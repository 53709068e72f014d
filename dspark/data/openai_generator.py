"""Regeneration through an OpenAI-compatible server the user already runs (vLLM, SGLang, llama.cpp ...).

HTTP and retries are urllib3's (``urllib3.util.Retry``): the ``http`` extra, ``pip install 'dspark[http]'``
(already present wherever ``requests`` is). It is imported when a client is made, so the rest of the
regeneration code works without it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
from collections.abc import Sequence

from dspark.data.generator import (
    BatchPartialFailure,
    Completion,
    GenerationError,
    GeneratorUnavailable,
    Message,
    SamplingParams,
    prompt_seed,
)

logger = logging.getLogger(__name__)

# Retried (then GeneratorUnavailable): request timeout, conflict, too early, rate limit, every 5xx.
RETRY_STATUS = frozenset({408, 409, 425, 429, *range(500, 600)})
# Wrong key, URL or model: nothing a retry or another record fixes -> GeneratorUnavailable at once.
FATAL_STATUS = frozenset({401, 403, 404, 405})
MAX_BACKOFF_S = 30.0
MISSING_URLLIB3 = "OpenAIChatGenerator needs urllib3: pip install 'dspark[http]' (or pip install urllib3)"


def _urllib3():
    try:
        import urllib3  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(MISSING_URLLIB3) from exc
    return urllib3


def retry_policy(max_retries: int, backoff_s: float):
    """The client's retry rule as a ``urllib3.util.Retry``.

    Up to ``max_retries`` retries in all (connection errors, read timeouts, :data:`RETRY_STATUS`), for
    POST too. Waits: none before the first retry, ``backoff_s * 2**(k-1)`` before retry k >= 2 (at most
    :data:`MAX_BACKOFF_S`), or the server's Retry-After on 429/503. Once the retries are spent a
    retryable status is returned, not raised, so the caller can quote the server's message.
    """
    urllib3 = _urllib3()

    class _LoggedRetry(urllib3.util.Retry):
        """urllib3 warns about retried connection errors itself, about retried statuses only at debug level."""

        def increment(self, method=None, url=None, response=None, error=None, _pool=None, _stacktrace=None):
            new = super().increment(method, url, response, error, _pool, _stacktrace)
            if response is not None:
                logger.warning("HTTP %d from %s: %s; retry %d/%d", response.status, url, server_message(response.data),
                               len(new.history), len(new.history) + new.total)
            return new

    return _LoggedRetry(total=max_retries, connect=None, read=None, redirect=None, status=None, other=None,
                        allowed_methods=None, status_forcelist=RETRY_STATUS, backoff_factor=backoff_s,
                        backoff_max=MAX_BACKOFF_S, raise_on_status=False, respect_retry_after_header=True)


def server_message(raw: bytes | None) -> str:
    """The error text of a response body: OpenAI's ``{"error": {"message": ...}}``, else the body itself."""
    raw = raw or b""
    try:
        payload = json.loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace")
    detail = payload.get("error", payload) if isinstance(payload, dict) else payload
    if isinstance(detail, dict):
        detail = detail.get("message", detail)
    return str(detail)[:500]


class OpenAIChatGenerator:
    """Client for ``POST {base_url}/chat/completions`` of an OpenAI-compatible server.

    ``base_url`` is the API root, e.g. ``http://127.0.0.1:8000/v1``. Rows of a batch are sent as
    concurrent requests (``concurrency`` at a time; the server batches them). Connection errors,
    timeouts and status 408/409/425/429/5xx are retried ``max_retries`` times with exponential
    backoff (:func:`retry_policy`), then raise :class:`GeneratorUnavailable`; 401/403/404/405 raise
    it at once (wrong key, URL or model). Other 4xx (e.g. a prompt longer than the context) raise
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
        urllib3 = _urllib3()
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
        self._retries = retry_policy(max_retries, backoff_s)
        self._http = urllib3.PoolManager(maxsize=concurrency, timeout=urllib3.Timeout(connect=timeout, read=timeout))

    def request_body(self, messages: Sequence[Message], sampling: SamplingParams) -> dict:
        """The JSON body sent for one conversation."""
        body = {
            "model": self.model,
            "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.request_top_p,
            "seed": prompt_seed(sampling.seed, messages),
            "n": 1,
            "stream": False,
        }
        body.update(self.extra_body)
        return body

    def complete(self, messages: Sequence[Message], sampling: SamplingParams | None = None) -> Completion:
        """One chat completion, with retries (see the class docstring for the error policy)."""
        urllib3 = _urllib3()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        body = json.dumps(self.request_body(messages, sampling or self.sampling)).encode("utf-8")
        attempts = self.max_retries + 1
        try:
            response = self._http.request("POST", self.url, body=body, headers=headers, retries=self._retries)
        except urllib3.exceptions.MaxRetryError as exc:
            raise GeneratorUnavailable(f"giving up after {attempts} attempts: cannot reach {self.url}: "
                                       f"{exc.reason!r}") from exc
        except urllib3.exceptions.HTTPError as exc:  # not retryable (e.g. a TLS error)
            raise GeneratorUnavailable(f"cannot reach {self.url}: {exc!r}") from exc
        status, raw = response.status, response.data
        if status < 300:
            return self._parse(raw)
        last = f"HTTP {status} from {self.url}: {server_message(raw)}"
        if status in FATAL_STATUS:
            raise GeneratorUnavailable(f"{last} (check --openai-base-url, the model name {self.model!r} and the API key)")
        if status in RETRY_STATUS:  # returned only once the retries are spent
            raise GeneratorUnavailable(f"giving up after {attempts} attempts: {last}")
        raise GenerationError(last)

    def _parse(self, raw: bytes) -> Completion:
        try:
            payload = json.loads(raw)
        except ValueError as exc:
            raise GenerationError(f"{self.url} returned invalid JSON: {raw[:200]!r}") from exc
        try:
            choice = payload["choices"][0]
            content = choice["message"].get("content")
        except (KeyError, IndexError, TypeError, AttributeError) as exc:
            raise GenerationError(f"unexpected response shape from {self.url}: {str(payload)[:300]}") from exc
        usage = payload.get("usage") if isinstance(payload, dict) else None
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return Completion(content or "", choice.get("finish_reason"), tokens if isinstance(tokens, int) else None)

    def _complete_or_error(self, messages: Sequence[Message], sampling: SamplingParams):
        try:
            return self.complete(messages, sampling)
        except GenerationError as exc:
            return exc

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[Completion]:
        sampling = sampling or self.sampling
        if len(batch) <= 1 or self.concurrency == 1:
            results = [self._complete_or_error(messages, sampling) for messages in batch]
        else:
            with concurrent.futures.ThreadPoolExecutor(min(self.concurrency, len(batch))) as pool:
                results = list(pool.map(lambda messages: self._complete_or_error(messages, sampling), batch))
        if any(isinstance(r, BaseException) for r in results):
            raise BatchPartialFailure(results)
        return results

    def close(self) -> None:
        self._http.clear()
