"""Acceptance-rate evaluation of a trained draft: `python eval.py run_dir=runs/<experiment>/<stamp>` (Hydra;
see configs/eval.yaml). Real speculative decoding on benchmark prompts, acceptance counted as vLLM does."""
import os

# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine spinning threads make every
# small op 10x slower. Set OMP_WAIT_POLICY=ACTIVE to override on a dedicated box.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="configs", config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from dspark.errors import one_line_errors
    from dspark.evaluation.run_eval import run_eval

    with one_line_errors("eval.py"):
        run_eval(cfg)


if __name__ == "__main__":
    main()
