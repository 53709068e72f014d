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


_SHARED_MERGED = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight")


def expected_unloaded(name: str, tensors: list[str], folder: Path | None, merged: bool = False) -> str | None:
    """Why vLLM may leave parameter `name` unloaded for this export (None: it should have been loaded).
    `merged`: the draft was read from a target copy; its embedding / head come from the target model at serve time."""
    if merged and name.endswith(_SHARED_MERGED):
        return "shared from the target model by vLLM's proposer"
    for suffix, fragment in _SHARED.items():
        if name.endswith(suffix) and not any(fragment in t for t in tensors):
            return "shared from the target (not in the export)"
    for fragment, filename in _OPTIONAL_FILES.items():
        if name.rsplit(".", 1)[-1] == fragment and (folder is None or not (folder / filename).is_file()):
            return f"read from {filename} only (none shipped)"
    return None


def judge(audit: dict, folder: str | Path | None = None, merged: bool = False) -> dict:
    """{"ok", "unloaded" (unexpected), "partial", "skipped", "expected_unloaded": {name: reason}, "class"}."""
    folder = None if folder is None else Path(folder)
    tensors = list(audit.get("tensors") or [])
    expected, unexpected = {}, []
    for name in audit.get("unloaded") or []:
        why = expected_unloaded(name, tensors, folder, merged)
        if why:
            expected[name] = why
        else:
            unexpected.append(name)
    partial, expected_partial = {}, {}
    for name, frac in (audit.get("partial") or {}).items():
        if name.endswith("attn_sink"):  # DeepSeek-V4: heads padded to 64 / 128 for the FP8 FlashMLA kernel
            expected_partial[name] = f"{frac:.4f} written: vLLM pads the attention heads (the padded sinks are unused)"
        else:
            partial[name] = frac
    # t2d is training-only: vLLM's dense loaders drop it (qwen3_dflash.py:861, qwen3_dspark.py:320 in 0.33.0); we
    # write it for our own import
    skipped = [n for n in audit.get("skipped") or [] if n != "t2d"]
    return {"ok": not (unexpected or partial or skipped), "class": audit.get("class"), "unloaded": unexpected,
            "partial": partial, "skipped": skipped, "expected_unloaded": expected, "expected_partial": expected_partial,
            "num_tensors": len(tensors), "num_parameters": len(audit.get("parameters") or {})}


def describe(verdict: dict) -> str:
    """One line: what vLLM's loader did with the export."""
    if verdict["ok"]:
        shared = ", ".join(sorted(verdict["expected_unloaded"])) or "none"
        padded = ", ".join(sorted(verdict.get("expected_partial") or {}))
        return (f"{verdict['class']}: all {verdict['num_tensors']} exported tensors loaded, every parameter filled "
                f"(left to vLLM: {shared}" + (f"; head padding: {padded}" if padded else "") + ")")
    parts = []
    if verdict["unloaded"]:
        parts.append(f"parameters left unloaded: {verdict['unloaded']}")
    if verdict["partial"]:
        parts.append(f"partly loaded: {verdict['partial']}")
    if verdict["skipped"]:
        parts.append(f"exported tensors vLLM skipped: {verdict['skipped']}")
    return f"{verdict['class']}: " + "; ".join(parts)
