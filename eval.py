"""Acceptance-rate evaluation of a trained draft: `python eval.py run_dir=runs/<experiment>/<stamp>` (Hydra;
see configs/eval.yaml). Real speculative decoding on benchmark prompts, acceptance counted as vLLM does."""
import hydra
from omegaconf import DictConfig


@hydra.main(config_path="configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from dspark.evaluation.run_eval import run_eval

    run_eval(cfg)


if __name__ == "__main__":
    main()
