"""`draft.init_from=FOLDER`: start a draft from trained weights.

FOLDER is a trained draft of the same target: a run's `RUN/draft/` (dspark.pretrained) or a serving export any
adapter reads (dense DSpark / DFlash, DFlash2, EAGLE-3, V4 / V4.1, ...). Two cases:
  * the family's own serving checkpoint where the family imports it whole (an adapter with `import_into`, e.g. a
    shipped DeepSeek-V4.1 drafter): imported strictly, every tensor;
  * anything else, e.g. a DSpark, DFlash2 or XPress draft from a trained DFlash: every tensor whose name and shape
    are the new draft's is copied (the backbone a DFlash draft shares with them: fc, hidden_norm, layers.*, norm),
    the rest keeps its fresh initialisation (a Markov head, a confidence head, DFlash2's selector); speculators'
    warm start from DFlash maps the same way, by name. The vocabulary mapping (d2t / t2d) is not copied: a reduced
    draft takes its ids from its own training data (dspark.training.draft_vocab).
Copied and fresh names are logged and returned. Refused (ConfigError naming draft.init_from): a folder sharing no
tensor with the draft, and one whose tensors of the draft's names have other shapes (a draft of other sizes: copying
only the tensors that happen to fit would start a mix of two drafts). A RUN/draft folder records its target
(draft/target.json): a draft trained against a target with other weights (another fingerprint) is refused unless
`draft.init_from_any_target=true`, which starts from it with a warning (an export records no target: not checked).
"""
from __future__ import annotations

import logging
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.errors import ConfigError
from dspark.export._io import iter_tensors
from dspark.export.adapter import adapter_for_folder, primary_adapter
from dspark.models.registry import family_of
from dspark.pretrained import load_draft
from dspark.training.draft_dir import CONFIG_FILE, TARGET_FILE, WEIGHTS_FILE

log = logging.getLogger(__name__)
NOT_COPIED = ("d2t", "t2d")  # the vocabulary mapping comes from the run's own data


@dataclass
class WarmStart:
    source: str  # what the folder held ("dspark_dense draft", the adapter's format)
    copied: list[str] = field(default_factory=list)
    fresh: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # the folder's tensors the draft has no place for

    def summary(self) -> str:
        return (f"draft.init_from: warm start from a {self.source}: {len(self.copied)} tensors copied, "
                f"{len(self.fresh)} fresh ({', '.join(sorted({n.split('.')[0] for n in self.fresh})) or 'none'}), "
                f"{len(self.skipped)} of the folder's not used")


def source_tensors(folder: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """(what the folder holds, its tensors under the draft module's own names)."""
    if (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file():
        draft, _ = load_draft(folder)
        return f"{type(draft).family_kind} draft", {k: v for k, v in draft.state_dict().items()}
    found = adapter_for_folder(folder)
    if found is None:
        raise ConfigError(f"draft.init_from: {folder} is neither a trained draft folder (RUN/draft: {CONFIG_FILE} + "
                          f"{WEIGHTS_FILE}) nor an export any serving adapter reads")
    adapter, _ = found
    try:
        return f"{adapter.format} export", adapter.from_serving(dict(iter_tensors(folder)), None)
    except (AttributeError, TypeError, ValueError) as e:  # a format whose names need the draft they go into
        raise ConfigError(f"draft.init_from: {folder} ({adapter.format}) is read only into a draft of its own "
                          f"family ({e})") from e


def _same_weights(target, recorded: str) -> bool:
    """Whether `recorded` (a draft/target.json fingerprint) is the target's, also in the older dtype-dependent
    scheme (FrozenTarget.legacy_fingerprint) when the target has it."""
    if recorded == target.fingerprint():
        return True
    legacy = getattr(target, "legacy_fingerprint", None)
    if legacy is None:
        return False
    try:
        return any(legacy(dtype) == recorded for dtype in (None, torch.bfloat16, torch.float32, torch.float16))
    except Exception:  # noqa: BLE001 (a target that cannot replay the older scheme: the current one decided)
        return False


def check_source_target(folder: Path, target, any_target: bool = False) -> None:
    """ConfigError unless FOLDER's draft was trained against `target` (the run's FrozenTarget: its fingerprint is the
    one FOLDER's draft/target.json records); with `any_target` a warning instead. Nothing to compare (no record, no
    fingerprint, no target): nothing checked."""
    record = Path(folder) / TARGET_FILE
    rec = json.loads(record.read_text()) if record.is_file() else {}
    theirs = rec.get("fingerprint")
    if target is None or theirs is None or _same_weights(target, str(theirs)):
        return
    msg = (f"draft.init_from: {folder} was trained against target kind={rec.get('kind')} path={rec.get('path')} "
           f"(fingerprint {str(theirs)[:12]}); this run's target has fingerprint {target.fingerprint()[:12]}: other "
           "weights")
    if not any_target:
        raise ConfigError(msg + "; start from a draft of this target, or set draft.init_from_any_target=true to "
                                "start from it anyway")
    log.warning("%s; draft.init_from_any_target=true: starting from another target's draft", msg)


def init_from(draft: torch.nn.Module, folder: str, target=None, any_target: bool = False) -> WarmStart:
    """Start `draft` from FOLDER (module docstring); ConfigError naming draft.init_from when it cannot.
    target: the run's target (its `fingerprint()` is compared with FOLDER's draft/target.json; None: not checked)."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise ConfigError(f"draft.init_from: {folder!r} is not a folder")
    check_source_target(path, target, any_target)
    adapter = primary_adapter(family_of(draft).kind)()
    if hasattr(adapter, "import_into") and adapter.read(path) is not None:
        try:
            adapter.import_into(path, draft)
        except ValueError as e:
            raise ConfigError(f"draft.init_from: {e}") from e
        names = list(draft.state_dict())
        return WarmStart(source=f"{adapter.format} checkpoint", copied=names)
    source, tensors = source_tensors(path)
    own = draft.state_dict()
    clash = [f"{k} {tuple(tensors[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
             if k in tensors and k not in NOT_COPIED and tuple(tensors[k].shape) != tuple(v.shape)]
    if clash:
        raise ConfigError(f"draft.init_from: {folder} (a {source}) holds tensors of this draft's names with other "
                          f"shapes ({'; '.join(clash[:3])}{'; ...' if len(clash) > 3 else ''}): a draft of other "
                          "sizes")
    out = WarmStart(source=source)
    with torch.no_grad():
        for name, value in own.items():
            src = tensors.get(name)
            if name in NOT_COPIED or src is None or tuple(src.shape) != tuple(value.shape):
                out.fresh.append(name)
                continue
            value.copy_(src.to(value.dtype))
            out.copied.append(name)
    out.skipped = sorted(set(tensors) - set(out.copied))
    if not out.copied:
        raise ConfigError(f"draft.init_from: {folder} (a {source}) shares no tensor (same name and shape) with this "
                          f"{family_of(draft).kind} draft")
    log.info(out.summary())
    return out


__all__ = ["WarmStart", "check_source_target", "init_from", "source_tensors"]
