"""Train a draft model: `python train.py experiment=dspark_v4` (Hydra; see configs/)."""
import os

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads make every
# small op 10x slower. Set OMP_WAIT_POLICY=ACTIVE to override on a dedicated box.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from dspark.errors import one_line_errors
    from dspark.training.callbacks import print_lightning_logs_once
    from dspark.training.run import run_training

    print_lightning_logs_once()  # Hydra's job logging prints them (and writes the run's train.log)
    with one_line_errors("train.py"):
        run_training(cfg)


if __name__ == "__main__":
    main()
