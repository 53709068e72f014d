"""Train a draft model: `python train.py experiment=dspark_v4` (Hydra; see configs/)."""
import os
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads make every
# small op 10x slower. Set OMP_WAIT_POLICY=ACTIVE to override on a dedicated box.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from dspark.console import quiet_console
    from dspark.errors import one_line_errors
    from dspark.training.callbacks import print_lightning_logs_once
    from dspark.training.run import run_training

    quiet_console()  # Lightning tips, foreign deprecation warnings, weight-loading progress bars
    print_lightning_logs_once()  # Hydra's job logging prints them (and writes the run's train.log)
    with one_line_errors("train.py"):
        run_training(cfg)


def _check(cfg, overrides) -> None:
    from dspark.preflight import check_training_config

    check_training_config(cfg, overrides)


def refuse_unwritable_run_dir(argv: list[str]) -> None:
    """Hydra opens <run_dir>/train.log before main runs: an unwritable run_dir would end in a logging traceback.
    One line naming the folder instead (exit 2). The run_dir= given on the command line (the last one), else
    runs/, where the default run dir goes."""
    import sys

    from dspark.io import unwritable

    if any(a in ("-h", "--help", "--hydra-help", "-c", "--cfg", "--info") for a in argv):
        return
    run_dir = "runs"
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "run_dir":
            run_dir = value
    if "${" in run_dir:  # an interpolation: Hydra resolves it
        return
    why = unwritable(Path(run_dir))
    if why is not None:
        print(f"train.py: error: run_dir={run_dir}: {why} (the run writes train.log, .hydra/ and checkpoints/ "
              "there); choose another run_dir=", file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    import sys

    from dspark.cli import precheck

    precheck("config", "train.py", _check)  # --help; a bad command line or config: one line, exit 2, nothing loaded
    refuse_unwritable_run_dir(sys.argv[1:])
    main()
