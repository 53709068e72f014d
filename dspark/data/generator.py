"""What a regeneration generator is (the protocol :func:`dspark.data.regenerate.regenerate` calls).

A generator has a ``name`` (recorded in every output line's meta) and
``generate(batch_of_message_lists, sampling=None) -> list[str]``: one assistant answer per conversation,
each conversation ending with a user turn. Answers are usually :class:`Completion` (a ``str`` that also
carries its finish reason). Failures are told apart by class:

* :class:`GenerationError` (or any other ``Exception``): about the request at hand; the record is marked
  failed. :class:`BatchPartialFailure` says which rows of a batch failed and keeps the others' answers.
* :class:`GeneratorUnavailable`: the generator as a whole is unusable (server down after retries, bad URL,
  wrong model or key, dead worker); the run stops instead of failing every remaining record.

The generators: :class:`dspark.data.hf_generator.HFGenerator` (local transformers model),
:class:`dspark.serving.vllm_generator.VLLMGenerator` (vLLM's offline engine in its own venv),
:class:`dspark.data.openai_generator.OpenAIChatGenerator` (an OpenAI-compatible server).
This module imports neither torch nor an HTTP library.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

Message = dict  # {"role": "system"|"user"|"assistant", "content": str}


@dataclass(frozen=True)
class SamplingParams:
    """How answers are sampled. ``temperature == 0`` means greedy (``top_p`` is then ignored).

    ``seed`` makes runs repeatable: HF generation seeds each call from (seed, the batch's
    prompts); the OpenAI client and vLLM use a per-request seed derived from (seed, that prompt).
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

    @property
    def request_top_p(self) -> float:
        """The top-p to send to an engine: 1.0 when greedy (so it cannot matter)."""
        return 1.0 if self.greedy else self.top_p


class Completion(str):
    """A generated answer: a ``str`` carrying ``finish_reason`` ("stop", "length" or None) and
    ``num_tokens`` (answer tokens the engine generated and kept, end token excluded; None when unknown)."""

    finish_reason: str | None
    num_tokens: int | None

    def __new__(cls, text: str, finish_reason: str | None = None, num_tokens: int | None = None) -> "Completion":
        obj = super().__new__(cls, text)
        obj.finish_reason = finish_reason
        obj.num_tokens = num_tokens
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
    """What :func:`dspark.data.regenerate.regenerate` needs from a generator."""

    name: str

    def generate(self, batch: Sequence[Sequence[Message]], sampling: SamplingParams | None = None) -> list[str]:
        """One assistant answer per message list (each ends with a user turn)."""
        ...


def derived_seed(seed: int, payload: object) -> int:
    """A 31-bit seed from the user seed and some JSON-able content (stable across runs and machines)."""
    text = json.dumps([seed, payload], ensure_ascii=False, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:4], "big") & 0x7FFFFFFF


def prompt_seed(seed: int, messages: Sequence[Message]) -> int:
    """The per-request seed of one conversation: depends on (seed, roles and texts), not on its batch."""
    return derived_seed(seed, [[m["role"], m["content"]] for m in messages])
