"""Judging a vLLM load audit (dspark/serving/vllm_load_audit.py) of an exported draft.

vLLM leaves some draft parameters unloaded on purpose: it shares the embedding and the LM head from the target
when the export has none (`embed_tokens`, `lm_head`), and DFlash's `mask_embedding` is only read from a
`mask_embedding.pt` file. Anything else unloaded, partly loaded, or an exported tensor that writes nothing is
a broken export (or a loader that does not know our names): `judge` lists it and says not ok.
"""
from __future__ import annotations

from pathlib import Path

# parameter-name suffix -> exported tensor-name fragment whose absence makes vLLM fill the parameter itself
_SHARED = {"embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
_OPTIONAL_FILES = {"mask_embedding": "mask_embedding.pt"}


def expected_unloaded(name: str, tensors: list[str], folder: Path | None) -> str | None:
    """Why vLLM may leave parameter `name` unloaded for this export (None: it should have been loaded)."""
    for suffix, fragment in _SHARED.items():
        if name.endswith(suffix) and not any(fragment in t for t in tensors):
            return "shared from the target (not in the export)"
    for fragment, filename in _OPTIONAL_FILES.items():
        if name.rsplit(".", 1)[-1] == fragment and (folder is None or not (folder / filename).is_file()):
            return f"read from {filename} only (none shipped)"
    return None


def judge(audit: dict, folder: str | Path | None = None) -> dict:
    """{"ok", "unloaded" (unexpected), "partial", "skipped", "expected_unloaded": {name: reason}, "class"}."""
    folder = None if folder is None else Path(folder)
    tensors = list(audit.get("tensors") or [])
    expected, unexpected = {}, []
    for name in audit.get("unloaded") or []:
        why = expected_unloaded(name, tensors, folder)
        if why:
            expected[name] = why
        else:
            unexpected.append(name)
    partial = dict(audit.get("partial") or {})
    skipped = list(audit.get("skipped") or [])
    return {"ok": not (unexpected or partial or skipped), "class": audit.get("class"), "unloaded": unexpected,
            "partial": partial, "skipped": skipped, "expected_unloaded": expected,
            "num_tensors": len(tensors), "num_parameters": len(audit.get("parameters") or {})}


def describe(verdict: dict) -> str:
    """One line: what vLLM's loader did with the export."""
    if verdict["ok"]:
        shared = ", ".join(sorted(verdict["expected_unloaded"])) or "none"
        return (f"{verdict['class']}: all {verdict['num_tensors']} exported tensors loaded, every parameter filled "
                f"(left to vLLM: {shared})")
    parts = []
    if verdict["unloaded"]:
        parts.append(f"parameters left unloaded: {verdict['unloaded']}")
    if verdict["partial"]:
        parts.append(f"partly loaded: {verdict['partial']}")
    if verdict["skipped"]:
        parts.append(f"exported tensors vLLM skipped: {verdict['skipped']}")
    return f"{verdict['class']}: " + "; ".join(parts)
