"""Train a draft model: `python train.py experiment=dspark_v4` (Hydra; see configs/)."""
import hydra
from omegaconf import DictConfig


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from dspark.training.run import run_training

    run_training(cfg)


if __name__ == "__main__":
    main()
