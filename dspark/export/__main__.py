"""python -m dspark.export verify PATH | FORMAT --run-dir RUN --out OUT   (--help lists the formats)

Each subcommand is a serving adapter's (dspark/export/adapter.py): the options, out folder, writer call, quant report
and next-step line every export shares are the base adapter's, a family's adapter declares what differs (`cli`,
`cli_help`, `add_cli_args`, `cli_writer`); this module names no family. A draft with a confidence head also gets
SGLang's STS calibration file from the run's eval (dspark/export/sts.py). Every export ends with the independent
verifier unless --no-verify. OUT must be new or empty unless --overwrite (checked before any model loads); the folder
is written whole or not at all (dspark.export._io.sealed).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark import factory
from dspark.errors import ConfigError, UserError, one_line_errors
from dspark.export.adapter import cli_commands, cli_kinds, primary_adapter
from dspark.export.sts import SGLANG_FLAG, export_sts
from dspark.export.verify import main_verify
from dspark.models import registry
from dspark.targets.source import target_folder
from dspark.training import draft_dir as run_draft
from dspark.training.draft_dir import CONFIG_FILE, DRAFT_DIR, TARGET_FILE


def _load_run_draft(run_dir: Path, target_kind: str, target_path: str | None):
    """Target + draft built by dspark.factory from RUN/draft/draft_config.json, with the trained weights."""
    import torch
    from omegaconf import OmegaConf

    draft_dir = run_dir / run_draft.DRAFT_DIR
    if not (draft_dir / run_draft.CONFIG_FILE).is_file():
        raise SystemExit(f"{draft_dir}/draft_config.json not found (is {run_dir} a finished training run?)")
    state = run_draft.load_state(draft_dir)  # checked against its manifest before any model loads
    cfg = OmegaConf.create({
        "target": {"kind": target_kind, "path": target_path, "dtype": "float32"},
        "draft": {**json.loads((draft_dir / "draft_config.json").read_text()), "init_from_target": False},
    })  # the trained weights overwrite any start from the target's layers: it is not made again
    target = factory.build_target(cfg.target, cfg.draft)
    draft = factory.build_draft(cfg.draft, target)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"trained weights do not fit the draft: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():  # keep the trained dtypes (the fp32 set of a V4 draft stays fp32)
        for name, p in draft.named_parameters():
            p.data = state[name].to(p.device)
    return target, draft, cfg


def check_run_dir(run_dir: Path) -> None:
    """ConfigError (one line) unless RUN holds a trained draft: a folder that does not exist, or one without draft/
    (a run stopped before its end writes none)."""
    if not run_dir.is_dir():
        raise ConfigError(f"--run-dir: {run_dir} does not exist (a training run folder, runs/<experiment>/<stamp>)")
    if not (run_dir / DRAFT_DIR / CONFIG_FILE).is_file():
        missing = f"{DRAFT_DIR}/ missing" if not (run_dir / DRAFT_DIR).is_dir() else f"{DRAFT_DIR}/{CONFIG_FILE} missing"
        raise ConfigError(f"--run-dir: {run_dir} holds no trained draft ({missing}): train.py writes it when training "
                          f"ends; finish the run (python train.py <its overrides> run_dir={run_dir} resume=last, "
                          "the command in its resume.json) or pass a finished run's folder")


def _recorded_target(run_dir: Path) -> tuple[str, str | None] | None:
    """(kind, path) of the target the run was trained against (RUN/draft/target.json), None for older runs."""
    path = run_dir / DRAFT_DIR / TARGET_FILE
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    return str(rec["kind"]), rec.get("path")


def resolve_target(args: argparse.Namespace) -> tuple[str, str | None]:
    """--target / --target-path when given, else the run's draft/target.json, else the format's default kind."""
    if args.target is not None:
        return args.target, args.target_path
    recorded = _recorded_target(args.run_dir)
    if recorded is not None:
        return recorded[0], args.target_path or recorded[1]
    return cli_commands()[args.cmd].cli_default_target or _default_target(args.run_dir), args.target_path


def _default_target(run_dir: Path) -> str:
    path = run_dir / "draft" / "draft_config.json"
    kind = json.loads(path.read_text()).get("kind") if path.is_file() else None
    default = registry.families()[kind].default_target if kind in registry.kinds() else None
    if default is None:
        raise SystemExit(f"{path}: draft kind {kind!r} has no default target; pass --target")
    return default


def _target_checkpoint(kind: str, path: str | None) -> str | None:
    """The local folder of the run's target (what --merge-into takes), None when it is not one here."""
    try:
        folder = target_folder({"kind": kind, "path": path})
    except Exception:  # noqa: BLE001 (only a hint: the next step then names the placeholder)
        return None
    return folder if Path(folder).is_dir() else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="check an exported folder against its config (exit 1 with a list)")
    v.add_argument("path")
    commands = cli_commands()  # one subcommand per serving format family (its adapter in dspark/export/)
    for name, adapter in commands.items():
        adapter.add_cli_parser(sub, name)  # the options every export shares, then the format's own
    args = ap.parse_args(argv)

    if args.cmd == "verify":
        return main_verify(args.path)
    adapter = commands[args.cmd]
    with one_line_errors("python -m dspark.export"):
        adapter.check_out(args)  # before any model loads
        check_run_dir(args.run_dir)
        target_kind, target_path = resolve_target(args)
        target, draft, _ = _load_run_draft(args.run_dir, target_kind, target_path)
        args.target_checkpoint = _target_checkpoint(target_kind, target_path)
        if getattr(type(draft), "family_kind", None) not in cli_kinds(args.cmd):
            raise SystemExit(f"{args.run_dir}: the draft is {type(draft).__name__}, not a {adapter.what} draft")
        try:
            adapter.run_cli(target, draft, args)
        except UserError:
            raise
        except ValueError as err:  # a refused export (vLLM's rules, sizes): its message, exit 1
            raise SystemExit(str(err)) from None
    print(f"wrote {args.out}")
    sts_path, sts_line = export_sts(args.run_dir, args.out, draft)  # a confidence head: SGLang's STS file, or how to
    if sts_line:  # get one (eval.py's calibration)
        print(sts_line)
    status = 0 if args.no_verify else main_verify(args.out)
    if status == 0:
        print(primary_adapter(type(draft).family_kind).next_step(args, draft)
              + (f"; SGLang reads the confidence calibration with {SGLANG_FLAG} {sts_path}" if sts_path else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
