"""scripts/mix_regenerated.py: the frozen 3:1 data mix of the SmolLM2 scaling comparison."""
from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("mix_regenerated", REPO / "scripts" / "mix_regenerated.py")
mixer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mixer)


def write(path, prefix, n, partial=False):
    rows = [json.dumps({"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"{prefix} q{i}\u2028x\x85y"}]},
                       ensure_ascii=False) + "\n" for i in range(n)]
    path.write_text("".join(rows) + ('{"id": "half' if partial else ""), encoding="utf-8")


def ids(lines):
    return [json.loads(line)["id"] for line in lines]


def test_mix_is_three_to_one_and_a_larger_mix_starts_with_a_smaller(tmp_path):
    sg, rg = tmp_path / "sg.jsonl", tmp_path / "rg.jsonl"
    write(sg, "s", 9, partial=True)  # a regeneration still appending: its partial line is not a record
    write(rg, "r", 3)
    eight = mixer.mix(sg, rg, 8)
    assert ids(eight) == ["s0", "s1", "s2", "r0", "s3", "s4", "s5", "r1"]
    twelve = mixer.mix(sg, rg, 12)
    assert twelve[:8] == eight and len(twelve) == 12 and ids(twelve)[-1] == "r2"
    for line in twelve:  # raw U+2028 / U+0085 stay inside their record
        assert "\u2028" in json.loads(line)["messages"][0]["content"]


def test_too_few_records_is_refused(tmp_path):
    sg, rg = tmp_path / "sg.jsonl", tmp_path / "rg.jsonl"
    write(sg, "s", 9, partial=True)
    write(rg, "r", 3)
    with pytest.raises(SystemExit, match="9 complete records, 10 needed"):
        mixer.mix(sg, rg, 13)
    mixer.main([str(sg), str(rg), str(tmp_path / "m.jsonl"), "12"])
    assert ids((tmp_path / "m.jsonl").read_text(encoding="utf-8").split("\n")[:-1])[:4] == ["s0", "s1", "s2", "r0"]


def test_a_share_other_than_a_quarter_interleaves_evenly_and_keeps_the_prefix(tmp_path):
    sg, rg = tmp_path / "sg.jsonl", tmp_path / "rg.jsonl"
    write(sg, "s", 14)
    write(rg, "r", 16)
    share = mixer.Fraction(27, 50)
    thirty = mixer.mix(sg, rg, 30, share)
    order = ids(thirty)
    assert sum(i.startswith("r") for i in order) == 16 and len(set(order)) == 30  # floor(30 * 27/50) = 16
    for k in range(1, 31):  # every prefix holds floor(k s) reasoning-gym records: never a run of one source
        assert sum(i.startswith("r") for i in order[:k]) == (k * 27) // 50
    assert mixer.mix(sg, rg, 15, share) == thirty[:15]
    # the default share is the 3:1 of the earlier mixes, record for record
    assert mixer.mix(sg, rg, 8) == mixer.mix(sg, rg, 8, mixer.Fraction(1, 4))
    with pytest.raises(SystemExit, match="not within"):
        mixer.mix(sg, rg, 8, mixer.Fraction(3, 2))
