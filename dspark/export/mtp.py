"""MTP drafts <-> serving sidecar folders: what every MTP family's adapter shares (HY V4: hy_v4_mtp.py, DeepSeek-V4
native: dsv4_mtp.py).

A sidecar folder holds model.safetensors (or shards + index, dspark.export._io) with the serving names and
`mtp_config.json`: the target-config keys the serving side builds the MTP layers from (HF key names), `dspark_format`
(the adapter's format, what the verifier dispatches on) and `draft_config` (the draft's own config, every field) for
import. The embedding and LM head are the target's and are not written. Import casts every tensor to the draft's own
parameter dtype. `merge_mtp_into_target` writes the draft into a copy of a target checkpoint instead (`mtp_merged`).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import ClassVar

import torch

from dspark.export._io import (DEFAULT_MAX_SHARD_BYTES, INDEX_NAME, SINGLE_NAME, check_if_sealed, load_into,
                              merge_shard_into_copy, sealed, write_tensors)
from dspark.export.adapter import SAFETENSORS_DTYPES, ServingAdapter, adapters, dtype_name
from dspark.export.marker import Marker
from dspark.io import atomic_write_json
from dspark.models import registry

CONFIG_NAME = "mtp_config.json"
MERGED_SHARD = "model-mtp-draft.safetensors"
LAYER_NAMES = ("mtp_layers", "layers")
_NOT_SERVED = ("num_steps", "initializer_range", "learnable_sink_init")  # training-only draft fields


def need(c: dict, *keys: str) -> list:
    """c[key] for each key; ValueError naming the missing ones."""
    missing = [k for k in keys if k not in c]
    if missing:
        raise ValueError(f"{CONFIG_NAME}: missing keys {missing}")
    return [c[k] for k in keys]


def num_mtp_layers(c: dict, *keys: str) -> int:
    """The config's MTP layer count (the first of `keys` present)."""
    n = next((c[k] for k in keys if c.get(k)), None)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{CONFIG_NAME}: num_nextn_predict_layers must be a positive int, got {n!r}")
    return n


def mtp_marker(fmt: str) -> Marker:
    """An MTP format's folder: mtp_config.json with dspark_format `fmt`."""
    return Marker(CONFIG_NAME, "dspark_format", (fmt,))


class MTPAdapter(ServingAdapter):
    """An MTP family's sidecar / merged format. A family sets `kind`, `format` (mtp_config.json's dspark_format),
    `markers` (mtp_marker(format)), `target_model_type`, and implements the names (to_serving / from_serving),
    `family_json` (its target-config keys), `served_config`, `expected`, `serving_problems` and `is_draft_tensor`."""

    target_model_type: ClassVar[str]
    cli = "mtp"
    vllm_reads_merged = True
    what = "MTP (hyv4_mtp / dsv4_mtp)"
    cli_help = ("export a training run's MTP draft (HY V4 model.mtp_layers.{i}.* / DeepSeek-V4 mtp.{i}.*) as a "
                "sidecar")

    @classmethod
    def add_cli_args(cls, p) -> None:
        p.add_argument("--merge-into", type=Path, default=None,
                       help="a target checkpoint folder: OUT becomes a copy of it with the MTP tensors added (its own "
                            "MTP tensors replaced, config.json num_nextn_predict_layers updated)")
        p.add_argument("--layer-names", choices=("mtp_layers", "layers"), default="mtp_layers",
                       help="HY V4: model.mtp_layers.{i}.* (default) or model.layers.{N+i}.* (N = target layers)")
        p.add_argument("--split-experts", action="store_true",
                       help="HY V4: routed experts per expert (mlp.experts.{e}.{gate,up,down}_proj.weight), not "
                            "fused")

    @classmethod
    def cli_writer(cls, target, draft, args):
        writer = export_mtp if args.merge_into is None else merge_mtp_into_target
        return writer, {"layer_names": args.layer_names, "split_experts": args.split_experts}

    @classmethod
    def served_folder_config(cls, folder: Path, c: dict) -> dict:
        """mtp_config.json of this format; a merged folder's target config.json keys win (vLLM reads them)."""
        if c.get("mtp_merged") is True and (folder / "config.json").is_file():
            served = json.loads((folder / "config.json").read_text())
            c = {**c, **{k: v for k, v in served.items() if k not in ("torch_dtype", "dtype")}}
        if c.get("torch_dtype") not in SAFETENSORS_DTYPES:
            raise ValueError(f"{CONFIG_NAME}: torch_dtype {c.get('torch_dtype')!r} is not one of "
                             f"{sorted(SAFETENSORS_DTYPES)}")
        return c

    def label(self, config: dict) -> str:
        return self.format

    def to_serving(self, draft, dtype: torch.dtype, layer_names: str = "mtp_layers",
                   split_experts: bool = False) -> dict[str, torch.Tensor]:
        """{serving name: tensor (cpu, contiguous)}: parameters and persistent buffers under the family's names
        (`layer_names` / `split_experts`: the naming options a family offers), in `dtype` except the family's
        float32 set."""
        state = {k: v.detach().to("cpu") for k, v in draft.state_dict().items()}
        serving = self.serving_names(state, draft, layer_names, split_experts)
        return {k: v.to(torch.float32 if self.keeps_float32(k) else dtype).contiguous() for k, v in serving.items()}

    def serving_names(self, state: dict[str, torch.Tensor], draft, layer_names: str,
                      split_experts: bool) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def keeps_float32(self, name: str) -> bool:
        raise NotImplementedError

    def config_json(self, draft, dtype: torch.dtype, layer_names: str = "mtp_layers",
                    split_experts: bool = False) -> dict:
        """mtp_config.json: dspark_format, the family's target-config keys, torch_dtype, draft_config."""
        return {"dspark_format": self.format, "model_type": self.target_model_type,
                **self.family_json(draft.config, layer_names, split_experts),
                "torch_dtype": dtype_name(dtype), "draft_config": dataclasses.asdict(draft.config)}

    def family_json(self, cfg, layer_names: str, split_experts: bool) -> dict:
        raise NotImplementedError

    def draft_config(self, config: dict):
        """The draft config recorded in mtp_config.json (`draft_config`)."""
        if not isinstance(config.get("draft_config"), dict):
            raise ValueError(f"{CONFIG_NAME}: draft_config missing (needed to rebuild the draft)")
        return registry.family(self.kind).config.from_dict(config["draft_config"]).validate()

    def served_config(self, target_config: dict, draft):
        """The draft config vLLM would build from a target config.json (block sizes from the target)."""
        raise NotImplementedError

    def merged_target_config(self, target_config: dict, draft) -> dict:
        """The target config.json of a merge: num_nextn_predict_layers = the draft's layer count."""
        return {**target_config, "num_nextn_predict_layers": draft.config.num_layers}

    def notes(self, config: dict) -> list[str]:
        n = config.get("num_nextn_predict_layers")
        if isinstance(n, int) and n >= 2:
            return [f"num_nextn_predict_layers={n}: with num_speculative_tokens >= 2 vLLM runs its multi-module MTP "
                    "speculator (config/speculative.py:2188-2194), a recursion dspark neither trains nor evaluates; "
                    "eval.py's numbers hold for num_speculative_tokens 1"]
        return []


def mtp_adapter(draft) -> MTPAdapter:
    """The MTP adapter of a draft's family."""
    kind = getattr(type(draft), "family_kind", None)
    for cls in adapters():
        if issubclass(cls, MTPAdapter) and cls.kind == kind:
            return cls()
    raise TypeError(f"mtp export: {type(draft).__name__} is not an MTP draft (HYV4MTPDraft / DSV4MTPDraft)")


def mtp_formats() -> tuple[str, ...]:
    return tuple(cls.format for cls in adapters() if issubclass(cls, MTPAdapter))


def mtp_tensors(draft, dtype: torch.dtype = torch.bfloat16, *, layer_names: str = "mtp_layers",
                split_experts: bool = False) -> dict[str, torch.Tensor]:
    """{serving name: tensor (cpu, contiguous, export dtype)} of an MTP draft (parameters + the HY router bias buffer)."""
    return mtp_adapter(draft).to_serving(draft, dtype, layer_names=layer_names, split_experts=split_experts)


@sealed
def export_mtp(draft, out_dir, dtype: torch.dtype = torch.bfloat16, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
               layer_names: str = "mtp_layers", split_experts: bool = False) -> Path:
    """Write an MTP draft as a sidecar folder (serving-named safetensors + mtp_config.json); returns the folder."""
    adapter, out_dir = mtp_adapter(draft), Path(out_dir)
    tensors = adapter.to_serving(draft, dtype, layer_names=layer_names, split_experts=split_experts)
    write_tensors(tensors, out_dir, max_shard_bytes, metadata={"dspark_format": adapter.format})
    atomic_write_json(out_dir / CONFIG_NAME, adapter.config_json(draft, dtype, layer_names, split_experts))
    return out_dir


def _check_merge(adapter: MTPAdapter, config: dict, draft, target_dir: Path) -> None:
    if config.get("model_type") != adapter.target_model_type:
        raise ValueError(f"merge: {target_dir}/config.json model_type {config.get('model_type')!r} is not "
                         f"{adapter.target_model_type!r} ({type(draft).__name__})")
    if config.get("quantization_config"):
        raise ValueError(f"merge: {target_dir}/config.json is quantised; MTP merges are unquantised only")
    try:
        served = adapter.served_config(config, draft)
    except (TypeError, ValueError) as err:
        raise ValueError(f"merge: {target_dir}/config.json does not describe the draft's target: {err}") from err
    adapter.merged_target_config(config, draft)  # a family's refusals of the target config, before any file is written
    own = draft.config
    diff = [f"{f.name}: draft {getattr(own, f.name)!r} vs target {getattr(served, f.name)!r}"
            for f in dataclasses.fields(own) if f.name not in _NOT_SERVED and getattr(own, f.name) != getattr(served, f.name)]
    if diff:
        raise ValueError(f"merge: vLLM builds the MTP layers from {target_dir}/config.json, whose values differ "
                         "from the draft's:\n  " + "\n  ".join(diff))


@sealed
def merge_mtp_into_target(draft, target_dir, out_dir, dtype: torch.dtype = torch.bfloat16, *,
                          layer_names: str = "mtp_layers", split_experts: bool = False) -> Path:
    """A copy of a target checkpoint folder with the draft's MTP tensors added in their own shard.

    Files are hard-linked when possible (copied otherwise). MTP tensors the target already holds (its own MTP
    layers: `mtp.*`, or HY V4 `model.mtp_layers.*` / `model.layers.{N+i}.*`) are removed from the copy (their
    shards rewritten, the originals untouched); the draft goes into `model-mtp-draft.safetensors`; the index
    gains its names (a single-file target gets an index); config.json gets num_nextn_predict_layers (and
    n_mtp_layers for DeepSeek-V4) = the draft's layer count. mtp_config.json (with `mtp_merged: true`) is
    written too, so the verifier and import_mtp read the folder. The target config must yield the draft's own
    sizes (vLLM builds the MTP layers from it); quantised targets are refused.
    """
    adapter = mtp_adapter(draft)
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.resolve() == target_dir.resolve():
        raise ValueError("merge: out_dir must differ from target_dir (the target stays untouched)")
    config = json.loads((target_dir / "config.json").read_text())
    _check_merge(adapter, config, draft, target_dir)
    tensors = adapter.to_serving(draft, dtype, layer_names=layer_names, split_experts=split_experts)
    side = adapter.config_json(draft, dtype, layer_names, split_experts)
    merge_shard_into_copy(target_dir, out_dir, tensors, shard=MERGED_SHARD, skip=(CONFIG_NAME,),
                          is_draft_name=lambda k: adapter.is_draft_tensor(side, k))
    atomic_write_json(out_dir / "config.json", adapter.merged_target_config(config, draft))
    atomic_write_json(out_dir / CONFIG_NAME, side | {"mtp_merged": True})
    return out_dir


def _read_tensors(folder: Path, keep) -> dict[str, torch.Tensor]:
    """{name: tensor} for the names `keep(name)` accepts, reading only the shards that hold them."""
    from safetensors import safe_open

    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({f for name, f in weight_map.items() if keep(name)})
    else:
        files = [SINGLE_NAME]
    out = {}
    for fname in files:
        with safe_open(str(folder / fname), framework="pt") as fh:
            out.update({name: fh.get_tensor(name) for name in fh.keys() if keep(name)})
    return out


def read_mtp_config(folder) -> tuple[MTPAdapter, dict]:
    """(adapter, mtp_config.json) of an MTP sidecar / merged folder."""
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{folder}: no {CONFIG_NAME} (not an MTP sidecar folder)")
    c = json.loads(path.read_text())
    for cls in adapters():
        if issubclass(cls, MTPAdapter) and c.get("dspark_format") == cls.format:
            return cls(), c
    raise ValueError(f"{path}: dspark_format {c.get('dspark_format')!r} is not one of {mtp_formats()}")


def mtp_config_from_folder(folder):
    """The draft config recorded in the folder's mtp_config.json (`draft_config`)."""
    adapter, c = read_mtp_config(folder)
    return adapter.draft_config(c)


def import_mtp(folder, draft=None):
    """Load an MTP sidecar into `draft` (built from the folder's draft_config when None); strict both ways.

    Tensors are cast to the draft's own parameter / buffer dtypes. The caller shares the target's embedding and
    LM head (`draft.share_target_weights`) before running it.
    """
    folder = Path(folder)
    check_if_sealed(folder)
    adapter, c = read_mtp_config(folder)
    if draft is None:
        draft = registry.family(adapter.kind).draft(adapter.draft_config(c))
    if getattr(type(draft), "family_kind", None) != adapter.kind:
        raise ValueError(f"import_mtp({folder}): a {c['dspark_format']} folder cannot load into {type(draft).__name__}")
    merged = c.get("mtp_merged") is True  # a target checkpoint + the draft: read the MTP tensors only
    raw = _read_tensors(folder, (lambda n: adapter.is_draft_tensor(c, n)) if merged else (lambda n: True))
    mtp = {n: t for n, t in raw.items() if adapter.is_draft_tensor(c, n)}
    state = adapter.from_serving(mtp, draft)
    state.update({n: t for n, t in raw.items() if n not in mtp})  # not MTP names: reported as unexpected
    load_into(draft, state, f"import_mtp({folder})", buffers=True)
    return draft


__all__ = ["CONFIG_NAME", "MERGED_SHARD", "MTPAdapter", "export_mtp", "import_mtp", "merge_mtp_into_target",
           "mtp_adapter", "mtp_config_from_folder", "mtp_formats", "mtp_tensors", "read_mtp_config"]
