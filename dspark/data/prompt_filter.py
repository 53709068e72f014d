"""Which prompt records a training set may hold: none that copies a shipped eval prompt, none twice.

* eval overlap: a user turn equal to a shipped eval prompt (dspark/assets/eval/*.jsonl, every turn) after
  whitespace / case normalisation, or sharing a run of :data:`NGRAM` words with one (a near copy: the prompt
  pasted inside a longer message, or with a few words changed elsewhere);
* duplicates: a record whose user turns, normalised, equal an earlier record's.

:class:`PromptFilter` keeps the counts of what it dropped; ``reason(record)`` says why a record is dropped
(None: keep it) and remembers the kept ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dspark.data.reasoning_gym_source import EVAL_DIR, eval_prompts, normalise_prompt

NGRAM = 13  # words: the contamination window of GPT-3's and later data cards


def _ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@dataclass
class PromptFilter:
    eval_dir: str | Path | None = EVAL_DIR
    dropped_eval_overlap: int = 0
    dropped_duplicate: int = 0
    kept: int = 0
    _banned: set[str] = field(default_factory=set)
    _banned_ngrams: set[tuple[str, ...]] = field(default_factory=set)
    _seen: set[tuple[str, ...]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.eval_dir is not None:
            self._banned = eval_prompts(self.eval_dir)
            for prompt in self._banned:
                self._banned_ngrams |= _ngrams(prompt)

    def overlaps_eval(self, text: str) -> bool:
        key = normalise_prompt(text)
        return key in self._banned or not self._banned_ngrams.isdisjoint(_ngrams(key))

    def reason(self, record: dict) -> str | None:
        """"eval overlap", "duplicate" or None (kept, and remembered as seen)."""
        turns = [m.get("content", "") for m in record.get("messages", []) if m.get("role") == "user"]
        if any(isinstance(t, str) and self.overlaps_eval(t) for t in turns):
            self.dropped_eval_overlap += 1
            return "eval overlap"
        key = tuple(normalise_prompt(t) for t in turns if isinstance(t, str))
        if key in self._seen:
            self.dropped_duplicate += 1
            return "duplicate"
        self._seen.add(key)
        self.kept += 1
        return None

    def apply(self, records: Iterable[dict]) -> Iterator[dict]:
        for record in records:
            if self.reason(record) is None:
                yield record

    def summary(self) -> str:
        return (f"prompt filter: kept {self.kept}, dropped {self.dropped_eval_overlap} overlapping a shipped eval "
                f"prompt (equal or sharing {NGRAM} words) and {self.dropped_duplicate} duplicates")
