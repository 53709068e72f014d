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
    from hydra.core.hydra_config import HydraConfig

    from dspark.console import quiet_console
    from dspark.errors import one_line_errors
    from dspark.evaluation.run_eval import run_eval, target_given

    quiet_console()

    with one_line_errors("eval.py"):  # the run's own target (draft/target.json) unless the command line names one
        run_eval(cfg, target_from_run=not target_given(HydraConfig.get().overrides.task))


def _check(cfg, overrides) -> None:
    from dspark.schema import check_eval_keys

    check_eval_keys(cfg)


if __name__ == "__main__":
    from dspark.cli import precheck

    precheck("eval", "eval.py", _check)  # --help; a bad command line or key: one line, exit 2, nothing loaded
    main()
