"""Build the offline feature cache with vLLM as a job of its own, before training (the target is not loaded in this
process; vLLM runs it in its venv, tensor parallel per data.vllm_producer.tensor_parallel_size). Takes train.py's
overrides; the cache lands where train.py looks for it, so the training run reuses it:

    python scripts/build_feature_cache.py experiment=dspark_smollm2 data.feature_producer=vllm
    python train.py experiment=dspark_smollm2 data.feature_producer=vllm
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def main(argv: list[str]) -> int:
    from hydra import compose, initialize_config_dir

    from dspark.data.feature_cache import FeatureCache
    from dspark.data.feature_cache_build import build_feature_cache_offline
    from dspark.errors import UserError
    from dspark.factory import build_dataset
    from dspark.preflight import check_training_config
    from dspark.training.cache_plan import feature_cache_plan

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        cfg = compose(config_name="config", overrides=argv)
    try:
        run = check_training_config(cfg)  # the final run config (dspark.schema.RunConfig)
        path = build_feature_cache_offline(feature_cache_plan(run), run.data, build_dataset)
    except (UserError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    meta = FeatureCache(path).meta
    print(json.dumps({"path": str(path), "key": meta["key"], "examples": meta["num_examples"], "bytes": meta["bytes"],
                      "producer": meta.get("producer"), "layout": meta.get("layout", "plain")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
