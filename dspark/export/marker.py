"""What identifies a serving format in a folder: a marker each serving adapter declares (dspark.export.adapter).

A marker names one JSON file of the folder and what that file carries: `key` with one of `values` (for a list value,
as `architectures`, its first entry), every key of `with_keys` and none of `without_keys`. A marker says what its own
format is, never what another format is not: detection (adapter.adapter_for_folder) asks every format's markers and
refuses a folder more than one format claims, so no format needs to know another's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Marker:
    file: str  # the JSON file of the folder that carries the marker (config.json, dspark_config.json, ...)
    key: str  # the key whose value identifies the format
    values: tuple[Any, ...]  # the values that do (the first entry of a list value)
    with_keys: tuple[str, ...] = ()  # keys the file must also hold
    without_keys: tuple[str, ...] = ()  # keys the file must not hold

    def matches(self, config: dict) -> bool:
        value = config.get(self.key)
        if isinstance(value, list):
            value = value[0] if value else None
        return (value in self.values and all(k in config for k in self.with_keys)
                and not any(k in config for k in self.without_keys))

    def read(self, folder: Path) -> dict | None:
        """The file's config when the folder carries this marker, else None (ValueError on a file that is not JSON)."""
        path = Path(folder) / self.file
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        return config if isinstance(config, dict) and self.matches(config) else None

    def __str__(self) -> str:
        values = self.values[0] if len(self.values) == 1 else list(self.values)
        return (f"{self.file} {self.key}={values!r}" + "".join(f" +{k}" for k in self.with_keys)
                + "".join(f" -{k}" for k in self.without_keys))


def vllm_arch_marker(*archs: str) -> Marker:
    """vLLM's own draft-model format of these architectures: config.json's architectures[0], not a speculators config
    (which names an architecture too, beside speculators_model_type)."""
    return Marker("config.json", "architectures", archs, without_keys=("speculators_model_type",))


__all__ = ["Marker", "vllm_arch_marker"]
