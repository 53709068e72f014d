"""target.path as a Hub id: loaded through the Hugging Face cache with from_pretrained, offline (HF_HUB_OFFLINE=1),
from a cache laid out from the shipped tiny target; a missing id fails before anything loads, naming target.path."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import REPO
from dspark.targets.tiny_v4 import TINY_V4_DIR

REPO_ID = "dspark-test/tiny-v4"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

SCRIPT = """
import sys
from conftest import compose
from dspark import factory
try:
    cfg = compose(["target=hf", f"target.path={sys.argv[1]}", "target.dtype=float32"])
    t = factory.build_target(cfg.target, cfg.draft)
except FileNotFoundError as e:
    print("ERROR", e)
else:
    print("FINGERPRINT", t.fingerprint(), type(t.model).__name__, t.tokenizer.convert_tokens_to_ids("<|mask|>"))
"""


def _hf_cache(home):
    """HF_HOME/hub/models--<org>--<name>/{refs/main, snapshots/<commit>/...}: the layout huggingface_hub writes."""
    repo = home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in TINY_V4_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)


def _load(path: str, home) -> str:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"}
    env.pop("HF_HUB_CACHE", None)
    r = subprocess.run([sys.executable, "-c", SCRIPT, path], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


def test_hub_id_loads_from_the_cache_offline(tmp_path):
    from dspark.targets.hf_target import load_hf_target

    _hf_cache(tmp_path / "hf")
    got = _load(REPO_ID, tmp_path / "hf").split()
    local = load_hf_target(str(TINY_V4_DIR), [1], "float32")
    assert got == ["FINGERPRINT", local.fingerprint(), "DeepseekV4ForCausalLM", "4"]  # same weights, tokenizer


def test_missing_hub_id_or_folder_is_refused_naming_target_path(tmp_path):
    (tmp_path / "hf").mkdir()
    msg = _load("nobody/missing-model", tmp_path / "hf")
    assert msg.startswith("ERROR target.path='nobody/missing-model' is neither a local folder nor a model in the "
                          "Hugging Face cache") and "HF_HUB_OFFLINE" in msg
    msg = _load(str(tmp_path / "no" / "such" / "folder"), tmp_path / "hf")
    assert msg.startswith("ERROR target.path=") and "is not a folder" in msg
