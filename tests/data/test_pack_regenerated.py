"""scripts/pack_regenerated.py: pack a regenerated .jsonl (partial tail left out) with a sha256 manifest, unpack it
back byte for byte, refuse damage and never drop records a run added since packing; resuming from an unpacked file
regenerates only the rest."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json

import pytest
from conftest import REPO

from dspark.data.generator import Completion
from dspark.data.regenerate import regenerate

spec = importlib.util.spec_from_file_location("pack_regenerated", REPO / "scripts" / "pack_regenerated.py")
packer = importlib.util.module_from_spec(spec)
spec.loader.exec_module(packer)


class Echo:
    name = "echo"

    def __init__(self):
        self.prompts = []

    def generate(self, batch, sampling=None):
        self.prompts += [m[-1]["content"] for m in batch]
        return [Completion(f"ans({m[-1]['content']})", "stop") for m in batch]


def records(n):
    return [{"id": f"r{i}", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(n)]


def test_pack_unpack_round_trip_then_resume(tmp_path):
    data, packs = tmp_path / "data", tmp_path / "packs"
    out = data / "set.jsonl"
    regenerate(records(5), Echo(), out, batch_size=2)
    out.with_name("set.jsonl.failed.jsonl").write_text(json.dumps({"id": "bad", "error": "x"}) + "\n")
    full = out.read_bytes()
    with open(out, "ab") as fh:  # a run appending right now: its partial line is not packed
        fh.write(b'{"id": "r5", "mess')
    entries = {e["file"]: e for e in packer.pack([out], packs)}
    assert set(entries) == {"set.jsonl.gz", "set.jsonl.failed.jsonl.gz"}
    assert entries["set.jsonl.gz"]["lines"] == 5
    blob = (packs / "set.jsonl.gz").read_bytes()
    assert gzip.decompress(blob) == full
    assert hashlib.sha256(blob).hexdigest() == entries["set.jsonl.gz"]["sha256"]
    assert f"{entries['set.jsonl.gz']['sha256']}  set.jsonl.gz" in (packs / "SHA256SUMS").read_text()
    assert packer.pack([out], packs)[0]["sha256"] == entries["set.jsonl.gz"]["sha256"]  # same lines, same bytes

    fresh = tmp_path / "fresh"  # another machine: unpack, then the same command resumes
    written = packer.unpack("set", packs, fresh)
    assert [p.name for p in written] == ["set.jsonl", "set.jsonl.failed.jsonl"]
    assert (fresh / "set.jsonl").read_bytes() == full
    gen = Echo()
    stats = regenerate(records(8), gen, fresh / "set.jsonl", batch_size=2)
    assert (stats.done, stats.skipped) == (3, 5) and gen.prompts == ["q5", "q6", "q7"]
    assert packer.check(packs) == {"set.jsonl.gz": 5, "set.jsonl.failed.jsonl.gz": 1}


def test_unpack_refuses_damage_and_never_drops_newer_records(tmp_path):
    data, packs = tmp_path / "data", tmp_path / "packs"
    regenerate(records(4), Echo(), data / "s.jsonl", batch_size=2)
    packer.pack([data / "s.jsonl"], packs)
    packer.unpack("s.jsonl", packs, data)  # the same file (a prefix of itself): fine
    regenerate(records(6), Echo(), data / "s.jsonl", batch_size=2)  # the run went on after packing
    with pytest.raises(FileExistsError, match="not a prefix"):
        packer.unpack("s", packs, data)
    assert (data / "s.jsonl").read_bytes().count(b"\n") == 6
    packer.unpack("s", packs, data, force=True)
    assert (data / "s.jsonl").read_bytes().count(b"\n") == 4

    blob = bytearray((packs / "s.jsonl.gz").read_bytes())
    blob[-9] ^= 1
    (packs / "s.jsonl.gz").write_bytes(bytes(blob))
    with pytest.raises(ValueError, match="sha256"):
        packer.unpack("s", packs, tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="not in"):
        packer.unpack("missing", packs, data)


def test_pack_refuses_a_malformed_line(tmp_path):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"id": "a", "messages": []}\n[1, 2]\n')
    with pytest.raises(ValueError, match="b.jsonl:2"):
        packer.pack([bad], tmp_path / "packs")


def test_shards_are_append_only_and_unpack_to_the_whole_file(tmp_path):
    data, packs = tmp_path / "data", tmp_path / "packs"
    out = data / "big.jsonl"
    regenerate(records(3), Echo(), out, batch_size=2)
    first = {e["file"] for e in packer.shard(out, packs)}
    assert first == {"big.part0000.jsonl.gz"}
    blob0 = (packs / "big.part0000.jsonl.gz").read_bytes()
    assert packer.shard(out, packs) == []  # nothing new: no shard
    regenerate(records(7), Echo(), out, batch_size=2)  # resumes: 4 more records
    with open(out, "ab") as fh:  # a run appending right now: its partial line stays out
        fh.write(b'{"id": "r7", "mess')
    entries = packer.shard(out, packs)
    assert [(e["file"], e["lines"], e["first_line"]) for e in entries] == [("big.part0001.jsonl.gz", 4, 3)]
    assert (packs / "big.part0000.jsonl.gz").read_bytes() == blob0  # the earlier shard is never rewritten
    whole = out.read_bytes()[: out.read_bytes().rfind(b"\n") + 1]
    restored = tmp_path / "fresh"
    [dest] = packer.unpack("big", packs, restored)
    assert dest.read_bytes() == whole
    assert packer.check(packs) == {"big.part0000.jsonl.gz": 3, "big.part0001.jsonl.gz": 4}


def test_a_shard_refuses_a_file_that_does_not_continue_its_shards(tmp_path):
    data, packs = tmp_path / "data", tmp_path / "packs"
    out = data / "big.jsonl"
    regenerate(records(3), Echo(), out, batch_size=2)
    packer.shard(out, packs)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[1] + lines[0] + lines[2])  # same records, edited order
    with pytest.raises(ValueError, match="does not continue its 1 packed shards"):
        packer.shard(out, packs)


def test_a_damaged_shard_is_refused_on_unpack(tmp_path):
    data, packs = tmp_path / "data", tmp_path / "packs"
    out = data / "big.jsonl"
    regenerate(records(3), Echo(), out, batch_size=2)
    packer.shard(out, packs)
    regenerate(records(5), Echo(), out, batch_size=2)
    packer.shard(out, packs)
    (packs / "big.part0001.jsonl.gz").write_bytes(gzip.compress(b'{"id": "x"}\n'))
    with pytest.raises(ValueError, match="sha256 differs"):
        packer.unpack("big", packs, tmp_path / "fresh")


def test_the_shipped_sets_verify_and_the_30k_shards_unpack_to_unique_regenerated_conversations(tmp_path):
    lines = packer.check()  # every packed file of benchmarks/data against its manifest digests
    shards = packer.shard_names(packer.load_manifest(packer.PACK_DIR), "smollm2_30k_sharegpt")
    assert shards and all(lines[s] > 0 for s in shards)
    [dest] = [p for p in packer.unpack("smollm2_30k_sharegpt", data_dir=tmp_path) if p.name.endswith("sharegpt.jsonl")]
    rows = [json.loads(x) for x in dest.read_text(encoding="utf-8").split("\n") if x.strip()]
    assert len(rows) == sum(lines[s] for s in shards) == len({r["id"] for r in rows})
    for r in rows[:50]:
        roles = [m["role"] for m in r["messages"]]
        assert roles[-1] == "assistant" and roles.count("assistant") == len(r["meta"]["finish_reasons"])
        assert r["meta"]["generator"].startswith("native:") and r["meta"]["sampling"]["temperature"] == 0.7
