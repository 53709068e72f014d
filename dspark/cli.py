"""What train.py / eval.py do before handing the command line to Hydra: `--help` in the project's words, Hydra's own
composition errors (an unknown key without `+`, a missing group option) as one line with the nearest valid name, and
the schema check of the composed config, all in exit status 2 before Hydra creates a run dir or any model loads."""
from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from dspark import schema
from dspark.errors import UserError
from dspark.schema import unknown_key_error

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

EXAMPLES = {
    "config": [
        "python train.py experiment=dspark_v4                       # the tiny default (2 CPU cores, minutes)",
        "python train.py experiment=dspark_v4 trainer.max_steps=50 train.lr=1e-3",
        "python train.py experiment=dspark_smollm2 data.limit=500 trainer.accumulate_grad_batches=2",
        "python train.py target=hf target.path=Qwen/Qwen3-8B draft=dspark_smollm2 trainer=gpu",
        "python train.py run_dir=runs/dspark_v4/<stamp> resume=last trainer.max_steps=600",
        "python train.py run_dir=runs/dspark_v4/<stamp> resume=last resume_override=[train.lr] train.lr=5e-4",
    ],
    "eval": [
        "python eval.py run_dir=runs/dspark_v4/<stamp>                # MT-Bench, GSM8K, HumanEval",
        "python eval.py run_dir=RUN temperature=1.0 num_prompts=16 max_new_tokens=128",
        "python eval.py run_dir=RUN benchmarks=[gsm8k] draft_sample_method=probabilistic",
        "python eval.py draft_ckpt=RUN/checkpoints/last.ckpt target=smollm2",
    ],
}
COMMON = {
    "config": ("trainer.max_steps", "trainer.accumulate_grad_batches", "trainer.val_check_interval",
               "trainer.precision", "trainer.devices", "train.lr", "train.batch_size", "train.num_anchors",
               "data.limit", "data.max_length", "data.feature_cache", "draft.block_size", "draft.num_layers",
               "draft.markov_rank", "draft.num_steps", "run_dir", "resume", "resume_override", "seed"),
}


def _groups() -> dict[str, list[str]]:
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(CONFIGS.iterdir()) if d.is_dir()}


def help_text(config_name: str, prog: str) -> str:
    lines = [f"usage: python {prog} [group=option ...] [key=value ...]", ""]
    if config_name == "config":
        lines += ["Trains a draft head against a frozen target (Hydra config: configs/config.yaml).", "",
                  "groups (group=option):"]
        lines += [f"  {g:<11} {', '.join(opts)}" for g, opts in _groups().items() if g != "hydra"]
        docs = dict(schema.describe(schema.RunKeys, "") + schema.describe(schema.TrainKeys, "train")
                    + schema.describe(schema.DataKeys, "data"))
        docs.update({"trainer.max_steps": "optimizer steps (the data length and the LR schedule follow it)",
                     "trainer.accumulate_grad_batches": "batches per optimizer step",
                     "trainer.val_check_interval": "held-out validation every N batches",
                     "trainer.precision": "32-true | bf16-mixed | ...", "trainer.devices": "devices per node",
                     "draft.block_size": "drafts per block (block drafts)", "draft.num_layers": "draft layers",
                     "draft.markov_rank": "Markov head rank (0: none, DFlash)",
                     "draft.num_steps": "MTP chain depth (MTP drafts)"})
        lines += ["", "common keys:"] + [f"  {k:<34} {docs.get(k, '')}" for k in COMMON["config"]]
        lines += ["", "Every lightning.pytorch.Trainer argument is a trainer.* key; callbacks.<name> / logger.<name> are",
                  "{_target_: ...} nodes. Unknown keys, also with +, are refused naming the nearest valid key."]
    else:
        schema_cls = schema.ServeCheckKeys if config_name == "serve_check" else schema.EvalKeys
        lines += ["Measures acceptance with real speculative decoding (configs/eval.yaml).", "",
                  f"target group: {', '.join(_groups()['target'])} (default: the run's draft/target.json)", "",
                  "keys:"] + [f"  {k:<22} {d}" for k, d in schema.describe(schema_cls, "")]
    lines += ["", "examples:"] + [f"  {e}" for e in EXAMPLES.get(config_name, EXAMPLES["eval"])]
    lines += ["", "Hydra's own flags (--cfg job, --info, -m) still work; docs: README.md, docs/design.md."]
    return "\n".join(lines)


def _one_line(exc: Exception) -> str:
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _nearest_for(bad: str, config_name: str, overrides: list[str]) -> str:
    """'trainer.max_stpes: unknown key (did you mean trainer.max_steps?)' from the config composed without it."""
    from hydra import compose
    from omegaconf import OmegaConf

    rest = [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != bad]
    try:
        node = compose(config_name, overrides=rest)
    except Exception:  # noqa: BLE001 (another bad override: report the first one plainly)
        return f"{bad}: unknown key"
    *parents, leaf = bad.split(".")
    for p in parents:
        node = node.get(p) if OmegaConf.is_dict(node) else None
        if node is None:
            return f"{bad}: unknown key ({'.'.join(parents)} does not exist)"
    valid = list(node.keys()) if OmegaConf.is_dict(node) else []
    return str(unknown_key_error(".".join(parents), leaf, valid))


def precheck(config_name: str, prog: str, check: Callable, argv: list[str] | None = None) -> None:
    """Runs before hydra.main; exits 0 after --help, 2 with one line on a bad command line or config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("--help", "-h") for a in argv):
        print(help_text(config_name, prog))
        raise SystemExit(0)
    if any(a.startswith("-") for a in argv):  # Hydra's own flags: let Hydra run them
        return
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = [a for a in argv if not a.lstrip("+~").startswith("hydra.")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            try:
                cfg = compose(config_name, overrides=overrides)
            except Exception as e:  # noqa: BLE001 (Hydra's composition / parse errors, reported in one line)
                m = re.search(r"Could not override '([^']+)'", str(e))
                missing = re.search(r"Could not find '([^'/]+)/([^']+)'", str(e))
                if m:
                    msg = _nearest_for(m.group(1), config_name, overrides)
                elif missing and missing.group(1) in _groups():
                    group, option = missing.groups()
                    options = _groups()[group]
                    near = difflib.get_close_matches(option, options, n=1, cutoff=0.5)
                    msg = (f"{group}={option}: no such option (configs/{group}/)"
                           + (f"; did you mean {group}={near[0]}?" if near else "") + f" options: {', '.join(options)}")
                else:
                    msg = _one_line(e)
                print(f"{prog}: error: {msg}", file=sys.stderr)
                raise SystemExit(2) from None
            try:
                check(cfg, overrides)
            except UserError as e:
                print(f"{prog}: error: {e}", file=sys.stderr)
                raise SystemExit(2) from None
    finally:
        GlobalHydra.instance().clear()
