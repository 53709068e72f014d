"""The feature stream's producer process, `python -m dspark.produce_features SPEC` (started by
dspark.data.feature_stream, which names this module in its command line and never imports it): it builds SPEC's
feature cache in SPEC's order with the project's dataset builder (dspark.factory.build_dataset), from the plan the
training layer makes of SPEC's run config (dspark.training.cache_plan). An entry point, like train.py: it sits above
data/, the factory and training, so data/ never imports them."""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from dspark.data import feature_stream
from dspark.data.feature_cache import production_plan
from dspark.data.feature_cache_build import produce_feature_cache
from dspark.factory import build_dataset
from dspark.io import remove_stale_tmp
from dspark.schema import run_config
from dspark.training.cache_plan import feature_cache_plan

log = logging.getLogger("dspark.feature_stream")


# ---- the producer process --------------------------------------------------------------
def _exit_with_parent(parent: int) -> None:
    """The child ends when the trainer that started it is gone (killed with SIGKILL included)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(3)

    if os.getppid() != parent:
        os._exit(3)
    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def main(argv: list[str]) -> int:
    """`python -m dspark.produce_features SPEC`: the build of SPEC's cache in SPEC's order. The producer lock came
    with the process (descriptor SPEC["lock_fd"], kept open until the process ends)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    _exit_with_parent(int(spec["parent"]))
    folder = Path(spec["path"])
    remove_stale_tmp(folder)  # a killed producer's torn write (no other writer while this process holds the lock)
    log.info("producer: %s, %d shards of %d examples, order %s...", folder, len(spec["order"]), spec["shard_size"],
             spec["order"][:8])
    with production_plan(spec["order"], spec["key"]):
        run = run_config(spec["config"])
        produce_feature_cache(feature_cache_plan(run), run.data, build_dataset, int(spec["shard_size"]))
    (folder / feature_stream.LOCK_NAME).unlink(missing_ok=True)  # complete: an ordinary offline cache
    log.info("producer: %s complete", folder)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
