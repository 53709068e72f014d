"""Read prompt files in JSON Lines into conversation records (docs/CONTRACTS.md).

Accepted line shapes (one JSON object per line, blank lines ignored; a UTF-8 BOM opening the file is dropped):

- ``{"turns": ["first user turn", "second user turn", ...]}`` (MT-Bench / eval prompt files such as
  ``dspark/assets/eval/*.jsonl``): every turn becomes a ``user`` message, in order. The
  assistant answers between them are not part of the file; whoever consumes a multi-turn
  record generates them turn by turn.
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}``: copied as is.

Either shape may carry ``"id"`` (string or number); otherwise the id is ``"<file stem>-<line>"``.

Malformed lines (not valid UTF-8, invalid JSON, not an object, neither key, empty turn list, wrong
types, unknown role) are handled in one of two ways, chosen by ``strict``:

- ``strict=False`` (default): the line is skipped; :class:`JsonlStats` counts the skipped lines and
  keeps the first few line numbers, and one warning naming the file, the count and those line
  numbers is logged at the end. Eval prompt sets are usually hand-edited, and dropping one bad
  prompt should not kill a long run, but it must never be silent.
- ``strict=True``: the first malformed line raises :class:`JsonlFormatError` whose message names
  the file and the 1-based line number (a :class:`dspark.errors.UserError`: train.py / eval.py print it as one
  line and exit 2).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dspark.errors import ConfigError, UserError

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")
MAX_REPORTED_LINES = 5


class JsonlFormatError(UserError):
    """A malformed line in a prompt file read with strict=True (a ValueError, like every UserError)."""


def _undecodable(line: str) -> str | None:
    """Where a line read with errors="surrogateescape" held bytes that are not UTF-8 (each became one U+DC80-U+DCFF
    character), or None for a clean line. Reading this way keeps the file's line splitting and numbering."""
    for col, ch in enumerate(line, start=1):
        if "\udc80" <= ch <= "\udcff":
            return f"not valid UTF-8 (byte 0x{ord(ch) - 0xDC00:02x} at column {col})"
    return None


@dataclass
class JsonlStats:
    """What :func:`iter_jsonl_records` read: records kept, lines skipped, first bad line numbers."""

    records: int = 0
    skipped: int = 0
    bad_lines: list[int] = field(default_factory=list)  # first MAX_REPORTED_LINES, 1-based
    first_error: str | None = None


def parse_prompt_line(obj: object, default_id: str) -> dict:
    """Turn one decoded JSON line into a conversation record; raises ValueError if malformed."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    rec_id = obj.get("id", default_id)
    if not isinstance(rec_id, (str, int)):
        raise ValueError("'id' must be a string or a number")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}")
            out.append({"role": m["role"], "content": m["content"]})
    elif "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("'turns' must be a non-empty list")
        if not all(isinstance(t, str) for t in turns):
            raise ValueError("every entry of 'turns' must be a string")
        out = [{"role": "user", "content": t} for t in turns]
    else:
        raise ValueError("line has neither 'turns' nor 'messages'")
    return {"id": str(rec_id), "messages": out}


def iter_jsonl_records(
    path: str | os.PathLike,
    *,
    strict: bool = False,
    stats: JsonlStats | None = None,
    warn: bool = True,
) -> Iterator[dict]:
    """Yield conversation records from a JSON Lines prompt file (see the module docstring).

    Args:
        path: the .jsonl file.
        strict: raise :class:`JsonlFormatError` on the first malformed line instead of skipping it.
        stats: a :class:`JsonlStats` to fill in (records, skipped count, first bad line numbers).
        warn: log the skipped lines once the file is read (off for a caller that reports them itself).
    """
    path = Path(path)
    stats = stats if stats is not None else JsonlStats()
    # utf-8-sig: a leading BOM (Windows editors, some exporters) is dropped, not read as part of line 1
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                bad_bytes = _undecodable(line)
                if bad_bytes is not None:
                    raise ValueError(bad_bytes)
                record = parse_prompt_line(json.loads(line), default_id=f"{path.stem}-{lineno}")
            except ValueError as exc:  # json.JSONDecodeError is a ValueError
                if strict:
                    raise JsonlFormatError(f"{path}:{lineno}: malformed prompt line: {exc}") from exc
                stats.skipped += 1
                if len(stats.bad_lines) < MAX_REPORTED_LINES:
                    stats.bad_lines.append(lineno)
                if stats.first_error is None:
                    stats.first_error = f"line {lineno}: {exc}"
                continue
            stats.records += 1
            yield record
    if stats.skipped and warn:
        more = ", ..." if stats.skipped > len(stats.bad_lines) else ""
        logger.warning(
            "%s: skipped %d malformed line(s) (lines %s%s; first error: %s)",
            path, stats.skipped, ", ".join(map(str, stats.bad_lines)), more, stats.first_error,
        )


def read_jsonl_records(
    path: str | os.PathLike,
    *,
    strict: bool = False,
    stats: JsonlStats | None = None,
) -> list[dict]:
    """All records of a prompt file as a list; same rules as :func:`iter_jsonl_records`."""
    return list(iter_jsonl_records(path, strict=strict, stats=stats))


def looks_like_sharegpt(path: str | os.PathLike) -> bool:
    """Is the file's first non-empty line a ShareGPT record ({"conversations": [{"from": ..., "value": ...}]})?"""
    with open(path, encoding="utf-8-sig", errors="replace") as fh:
        line = next((ln for ln in fh if ln.strip()), "")
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    conv = obj.get("conversations") if isinstance(obj, dict) else None
    return isinstance(conv, list) and bool(conv) and isinstance(conv[0], dict) and "from" in conv[0]


def require_usable_records(path: str | os.PathLike, strict: bool) -> None:
    """ConfigError (one line) unless the file yields at least one conversation: how many lines were skipped, the
    first reason, and data.source=sharegpt when the lines are ShareGPT records. Reads up to the first usable line."""
    stats = JsonlStats()
    if next(iter_jsonl_records(path, strict=strict, stats=stats, warn=False), None) is not None:
        return
    hint = ("; the lines are ShareGPT records ({\"conversations\": [{\"from\", \"value\"}]}): use data.source=sharegpt"
            if looks_like_sharegpt(path) else "; each line needs 'messages' (role / content) or 'turns'")
    raise ConfigError(f"data.path: {path} has 0 usable conversations ({stats.skipped} line(s) skipped; first: "
                      f"{stats.first_error or 'the file is empty'}){hint}")
