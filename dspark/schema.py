"""The typed schema of a run config: one dataclass per config group, one owner per key.

Hydra composes the yaml files of configs/ (which hold every default, once); this module says which keys exist,
their types and ranges, and refuses anything else with one line naming the key and the nearest valid name:

    train.lrr: unknown key (did you mean train.lr?)

What owns which key:
  * the run's own keys (`RunKeys`), `train` (`TrainKeys`: optimisation, shared by every objective), `data`
    (`DataKeys`), `target` (`TargetKeys`), eval.py's keys (`EvalKeys`) and serve_check's (`ServeCheckKeys`): here;
  * the objective's `train.*` keys: dspark.objective_keys (a dataclass per objective, e.g. BlockKeys, which its
    LightningModule is built from); the train group's schema is TrainKeys + every objective's keys, and the
    active objective's values are checked by its `check`;
  * `draft.*`: the draft family (dspark.models.registry): `kind`, `init_from_target`, `arch` + its Config's
    GROUP_KEYS at the top level, every other Config field under `arch`;
  * `trainer.*`: lightning.pytorch.Trainer's own arguments (its signature); `callbacks.*` / `logger.*`: free names of
    `{_target_: ..., ...}` nodes or null.

Cross-field checks (anchors vs sequence length, taps vs target depth, ...) live in dspark.preflight, which calls
`check_run_keys` first.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import logging
import math
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from dspark.cpu import resolve_target_dtype
from dspark.draft_resolve import resolve_draft
from dspark.errors import ConfigError
from dspark.models import registry
from dspark.objective_keys import OBJECTIVE_KEYS
from dspark.targets.source import TARGET_KINDS  # the kinds live with their folders


# ---- value checks ---------------------------------------------------------------------------------
def _range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """field metadata: the value must lie in the range (bounds inclusive unless *_open)."""
    def check(v) -> str | None:
        if v is None or isinstance(v, str):  # a word (e.g. "auto") is checked by its Literal
            return None
        if lo is not None and (v <= lo if lo_open else v < lo):
            return f"must be {'>' if lo_open else '>='} {lo}"
        if hi is not None and (v >= hi if hi_open else v > hi):
            return f"must be {'<' if hi_open else '<='} {hi}"
        return None
    return {"check": check}


POSITIVE = _range(0, lo_open=True)
AT_LEAST_1 = _range(1)
NON_NEGATIVE = _range(0)
UNIT = _range(0, 1)


# other tools' names for a key (key -> (ours, whose name it is)): an unknown key with one of these names points to ours
ALIASES = {"num_speculative_tokens": ("num_drafts", "vLLM's speculative_config")}


def nearest(key: str, valid: Iterable[str]) -> str | None:
    valid = list(valid)
    alias = ALIASES.get(key)
    if alias is not None and alias[0] in valid:
        return alias[0]
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    return match[0] if match else None


def unknown_key_error(prefix: str, key: str, valid: Iterable[str]) -> ConfigError:
    full = f"{prefix}.{key}" if prefix else key
    near = nearest(key, valid)
    hint = f"did you mean {prefix + '.' if prefix else ''}{near}?" if near else \
        f"valid keys: {', '.join(sorted(valid))}"
    if near is not None and ALIASES.get(key, (None,))[0] == near:
        hint += f" {ALIASES[key][1]} calls it {key}"
    return ConfigError(f"{full}: unknown key ({hint})")


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return f"a mapping of {_type_name(typing.get_args(tp)[1])}"
    return {float: "a number", int: "an integer", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _matches(value, tp) -> bool:
    """Is a plain (resolved) config value of annotation `tp`? ints pass as floats; bools are not numbers."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return isinstance(value, (list, tuple)) and (not args or all(_matches(v, args[0]) for v in value))
    if origin is dict:
        k, v = typing.get_args(tp)
        return isinstance(value, Mapping) and all(_matches(x, v) for x in value.values())
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, Mapping)
    return isinstance(value, tp)


def check_section(schema: type, values: Mapping[str, Any], prefix: str, *, extra: Iterable[str] = (),
                  required: bool = True) -> None:
    """Refuses unknown keys (nearest valid name), missing keys, wrong types and out-of-range values of one group.
    `extra`: further valid keys checked elsewhere (e.g. another objective's)."""
    hints = typing.get_type_hints(schema)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    valid = set(fields) | set(extra)
    for key in values:
        if key not in valid:
            raise unknown_key_error(prefix, str(key), valid)
    for name, f in fields.items():
        full = f"{prefix}.{name}" if prefix else name
        if name not in values:
            if required:
                raise ConfigError(f"{full}: missing (every key of the group has a default in configs/; "
                                  f"was it set to an empty node?)")
            continue
        value, tp = values[name], hints[name]
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            check_section(tp, value, full)
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{full}: must be finite, got {value!r}")
        if not _matches(value, tp):
            raise ConfigError(f"{full}: must be {_type_name(tp)}, got {value!r}")
        why = f.metadata.get("check", lambda v: None)(value)
        if why:
            raise ConfigError(f"{full}: {why}, got {value!r}")


def doc(text: str, **meta) -> dict:
    return {"doc": text, **meta}


def keys_of(schema: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(schema))


# ---- groups ---------------------------------------------------------------------------------------
DATA_SOURCES = ("sharegpt", "jsonl", "regenerated")
FEATURE_PRODUCERS = ("hf", "vllm")


@dataclass
class TargetKeys:
    kind: Literal[TARGET_KINDS] = field(metadata=doc(" | ".join(TARGET_KINDS)))
    path: Optional[str] = field(metadata=doc("local HF folder or Hub id (kind hf); null: the kind's own"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(metadata=doc(
        "weights dtype of the frozen target; auto: bfloat16 on a GPU or a CPU with AMX / AVX512-BF16, else float32"))

    def __post_init__(self):
        if self.dtype == "auto":  # resolved once, here: everything downstream (and the run's record) sees the dtype
            self.dtype, why = resolve_target_dtype("auto")
            logging.getLogger("dspark").info("target.dtype auto -> %s (%s)", self.dtype, why)


@dataclass
class TrainKeys:
    batch_size: int = field(metadata=doc("sequences per device per step", **AT_LEAST_1))
    val_batch_size: int = field(metadata=doc("held-out sequences per batch", **AT_LEAST_1))
    num_anchors: int = field(metadata=doc("anchors sampled per sequence (block objectives)", **AT_LEAST_1))
    lr: float = field(metadata=doc("peak learning rate (AdamW)", **POSITIVE))
    weight_decay: float = field(metadata=doc("AdamW weight decay", **NON_NEGATIVE))
    betas: list[float] = field(metadata=doc("AdamW betas, two numbers in [0, 1)", check=lambda v: None if len(v) == 2
                                            and all(0 <= b < 1 for b in v) else "must be two numbers in [0, 1)"))
    warmup_ratio: float = field(metadata=doc("linear warmup, fraction of trainer.max_steps", **UNIT))
    min_lr_ratio: float = field(metadata=doc("cosine floor, fraction of lr", **UNIT))


@dataclass
class CacheLayoutKeys:
    encoding: Literal["plain", "fp8_e4m3"] = field(metadata=doc("storage of the cached rows"))
    teacher_rows: Literal["all", "assistant"] = field(metadata=doc("final hidden rows kept"))
    context_rows: Literal["all", "anchored"] = field(metadata=doc("tap rows kept (block objectives only)"))


@dataclass
class VLLMProducerKeys:
    tensor_parallel_size: int = field(metadata=AT_LEAST_1)
    batch_size: int = field(metadata=AT_LEAST_1)
    kv_cache_gib: int = field(metadata=AT_LEAST_1)
    python: Optional[str] = field(metadata=doc("vLLM's interpreter; null: $DSPARK_VLLM_PYTHON or .venv-vllm"))


@dataclass
class DataKeys:
    source: Literal[DATA_SOURCES] = field(metadata=doc("sharegpt | jsonl | regenerated"))
    path: Optional[str] = field(metadata=doc("jsonl file (jsonl / regenerated); sharegpt: the package's file"))
    limit: Optional[int] = field(metadata=doc("conversation records read; null: all", **AT_LEAST_1))
    english_only: bool = field(metadata=doc("keep English conversations only"))
    strict: bool = field(metadata=doc("jsonl: refuse the file at a malformed line (else skip and count)"))
    max_length: int = field(metadata=doc("tokens per training sequence", **_range(3)))
    min_loss_tokens: int = field(metadata=doc("drop sequences with fewer assistant tokens", **NON_NEGATIVE))
    val_examples: Union[int, Literal["auto"]] = field(metadata=doc(
        "held-out examples; auto: a tenth of the conversations, at most 64, at least 1", **AT_LEAST_1))
    num_workers: int = field(metadata=doc("DataLoader workers", **NON_NEGATIVE))
    group_by_length: bool = field(metadata=doc("training batches of similar lengths (less padding; the order is "
                                               "still fixed by the seed)"))
    feature_cache: Optional[str] = field(metadata=doc("null | auto | a folder: offline target features"))
    feature_cache_dtype: Literal["bfloat16", "float32"] = field(metadata=doc("cache storage dtype"))
    feature_cache_layout: CacheLayoutKeys = field(metadata=doc("compact cache layout"))
    feature_producer: Literal[FEATURE_PRODUCERS] = field(metadata=doc("who computes the cache: hf | vllm"))
    feature_stream: bool = field(metadata=doc("train while a child process writes the cache (online mode; the "
                                              "trainer loads the target's head only)"))
    vllm_producer: VLLMProducerKeys = field(metadata=doc("vLLM producer settings"))


@dataclass
class RunKeys:
    experiment_name: str = field(metadata=doc("names runs/<experiment_name>/<stamp>"))
    seed: int = field(metadata=doc("seeds Python, numpy, torch and the data order"))
    run_dir: str = field(metadata=doc("where checkpoints, logs, metrics.json and draft/ go"))
    resume: Optional[str] = field(metadata=doc("null | last | <path to a .ckpt>"))
    resume_override: list[str] = field(metadata=doc("keys allowed to change on resume, e.g. [train.lr]"))
    validate_at_start: bool = field(metadata=doc("held-out metrics at step 0 in metrics.json"))
    ops_backend: Literal["auto", "torch", "tilelang"] = field(metadata=doc("fused ops backend"))


RUN_GROUPS = ("train", "data", "target", "draft", "trainer", "callbacks", "logger")


@dataclass
class EvalKeys:
    target: TargetKeys = field(metadata=doc("the target group (target=...)"))
    run_dir: Optional[str] = field(metadata=doc("training run dir with draft/"))
    draft_ckpt: Optional[str] = field(metadata=doc("OR a Lightning .ckpt"))
    draft_config: Optional[str] = field(metadata=doc("explicit draft_config.json / config.yaml"))
    draft_cache: bool = field(metadata=doc("draft-side context KV cache between rounds (false: recompute)"))
    benchmarks: list[str] = field(metadata=doc("<data_dir>/<name>.jsonl sets"))
    data_dir: Optional[str] = field(metadata=doc("null: the shipped prompt sets"))
    num_prompts: int = field(metadata=doc("first N conversations per benchmark", **AT_LEAST_1))
    turns: Literal["all", "first"] = field(metadata=doc("all user turns | the first"))
    batch_size: int = field(metadata=doc("requests decoded together", **AT_LEAST_1))
    max_new_tokens: int = field(metadata=doc("tokens generated per turn", **AT_LEAST_1))
    temperature: float = field(metadata=doc("0: greedy verification; > 0: rejection sampling", **NON_NEGATIVE))
    num_drafts: Optional[int] = field(metadata=doc("gamma; null: the draft's drafts per step", **AT_LEAST_1))
    draft_sample_method: Literal["greedy", "probabilistic"] = field(metadata=doc("vLLM's draft_sample_method"))
    rejection_sample_method: Literal["standard", "block", "synthetic", "fly"] = field(
        metadata=doc("vLLM's rejection_sample_method: standard | block (synthetic, fly: refused)"))
    eos_token_id: Optional[Union[int, list[int]]] = field(metadata=doc("null: the target's eos ids"))
    compare_target: bool = field(metadata=doc("also decode with the plain target"))
    plots: bool = field(metadata=doc("write PNGs"))
    confidence: bool = field(metadata=doc("confidence-head analysis"))
    adaptive_verification: bool = field(
        metadata=doc("simulate vLLM's enable_adaptive_verification: confidence head vs online estimator"))
    sps_table: Optional[str] = field(metadata=doc("JSON of the target's verify steps/s"))
    sps_context: int = field(metadata=doc("context length while profiling SPS(B)", **AT_LEAST_1))
    device: str = field(metadata=doc("cpu | cuda"))
    allow_target_mismatch: bool = field(metadata=doc("accept a target with other weights than the run's"))
    seed: int = field(metadata=doc("sampling seed"))
    out: Optional[str] = field(metadata=doc("report folder; null: <run_dir>/eval"))


@dataclass
class ServeCheckKeys(EvalKeys):
    export: Optional[str] = field(metadata=doc("exported draft folder; null: export the run's"))
    method: Optional[str] = field(metadata=doc("vLLM speculative method; null: from the export"))
    vllm_python: Optional[str] = field(metadata=doc("interpreter with vLLM"))
    vllm_plain: bool = field(metadata=doc("also decode with vLLM without a draft"))
    kv_cache_gib: int = field(metadata=AT_LEAST_1)
    max_model_len: Optional[int] = field(metadata=AT_LEAST_1)
    al_tolerance: float = field(metadata=NON_NEGATIVE)
    al_z_max: float = field(metadata=POSITIVE)
    vllm_default_drafting: bool = field()
    vllm_fix_cpu_float_expand: bool = field()
    strict: bool = field(metadata=doc("exit 1 unless parity is shown; false: report only"))


# ---- whole configs --------------------------------------------------------------------------------
def plain(cfg) -> dict:
    """A DictConfig (or mapping) as plain containers, interpolations resolved."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)


def trainer_keys() -> set[str]:
    from lightning.pytorch import Trainer

    return set(inspect.signature(Trainer.__init__).parameters) - {"self", "callbacks", "logger", "plugins"}


def _check_target_nodes(group: str, node) -> None:
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"{group}: must map names to {{_target_: ..., ...}} nodes, got {node!r}")
    for name, spec in node.items():
        if spec is not None and not (isinstance(spec, Mapping) and "_target_" in spec):
            raise ConfigError(f"{group}.{name}: needs a _target_ (a class path) or null")


def check_trainer_keys(trainer: Mapping[str, Any]) -> None:
    valid = trainer_keys() | {"_target_"}
    for key in trainer:
        if key not in valid:
            raise unknown_key_error("trainer", str(key), valid)
    for key in ("callbacks", "logger", "plugins"):
        if key in trainer:
            raise ConfigError(f"trainer.{key}: comes from the {key} group / the run, not trainer")


def check_draft_keys(draft: Mapping[str, Any]) -> None:
    """draft.*: kind, init_from_target, arch + the family's GROUP_KEYS; arch keys are the family Config's fields."""
    if not isinstance(draft, Mapping) or "kind" not in draft:
        raise ConfigError("draft: needs a kind (choose a group: draft=dspark_v4_tiny, ...)")
    fam = registry.family(str(draft["kind"]))
    top = set(fam.group_keys) | set(registry.NOT_CONFIG_KEYS)
    for key in draft:
        if key not in top:
            raise unknown_key_error("draft", str(key), top)
    arch = draft.get("arch") or {}
    if not isinstance(arch, Mapping):
        raise ConfigError(f"draft.arch: must be a mapping of {fam.config.__name__} fields, got {arch!r}")
    fields = {f.name for f in dataclasses.fields(fam.config)} - {"kind"}
    for key in arch:
        if key not in fields:
            raise unknown_key_error("draft.arch", str(key), fields - set(fam.group_keys))
    depth_key = fam.drafts_key  # drafts per verify step: data.max_length is checked against it (dspark.preflight)
    depth = draft.get(depth_key)
    if not (isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1):
        raise ConfigError(f"draft.{depth_key}: must be an int >= 1, got {depth!r}")
    for key in ("init_from_target", "init_from_any_target"):
        if not isinstance(draft.get(key, False), bool):
            raise ConfigError(f"draft.{key}: must be bool, got {draft[key]!r}")
    if draft.get("init_from") is not None and not isinstance(draft["init_from"], str):
        raise ConfigError(f"draft.init_from: must be a folder path or null, got {draft['init_from']!r}")


def objective_keys(objective: str) -> type:
    return OBJECTIVE_KEYS[objective]


def check_run_keys(cfg, overrides: Iterable[str] = ()) -> dict:
    """Every key of a train.py config: known, typed and in range; returns the resolved plain config. `overrides`:
    the command line's (Hydra's task overrides): setting a key only another objective reads is refused."""
    values = plain(cfg)
    top = set(keys_of(RunKeys)) | set(RUN_GROUPS)
    for key in values:
        if key not in top:
            raise unknown_key_error("", str(key), top)
    check_section(RunKeys, {k: v for k, v in values.items() if k not in RUN_GROUPS}, "")
    for key in (k for k in values.get("resume_override") or []):
        if key.split(".")[0] not in top:
            raise unknown_key_error("resume_override", key, top)
    check_section(TargetKeys, values.get("target") or {}, "target")
    check_section(DataKeys, values.get("data") or {}, "data")
    check_draft_keys(values.get("draft"))
    check_trainer_keys(values.get("trainer") or {})
    for group in ("callbacks", "logger"):
        _check_target_nodes(group, values.get(group))
    objective = registry.family(str(values["draft"]["kind"])).objective
    train = values.get("train") or {}
    mine = set(keys_of(OBJECTIVE_KEYS[objective]))
    others = {k for name, keys in OBJECTIVE_KEYS.items() if name != objective for k in keys_of(keys)} - mine
    # shared keys + anything unknown (refused with the nearest name); another objective's keys keep their defaults
    check_section(TrainKeys, {k: v for k, v in train.items() if k not in mine | others}, "train", extra=mine | others)
    check_section(OBJECTIVE_KEYS[objective], {k: v for k, v in train.items() if k in mine}, "train")
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key.startswith("train.") and key.split(".")[1] in others:
            raise ConfigError(f"{key}: only another objective reads it; draft.kind={values['draft']['kind']} trains "
                              f"the {objective!r} objective (its keys: {', '.join(sorted(mine))})")
    OBJECTIVE_KEYS[objective].check(train)
    return values


def check_eval_keys(cfg, schema: type = EvalKeys) -> dict:
    """Every key of an eval.py / serve_check config (target group included); returns the plain values."""
    values = plain(cfg)
    check_section(schema, values, "")
    return values


def typed(schema: type, values: Mapping[str, Any]):
    """The schema's dataclass holding checked plain values (keys it does not have are left out), nested groups as
    their own dataclasses."""
    hints = typing.get_type_hints(schema)
    return schema(**{f.name: typed(hints[f.name], values[f.name]) if dataclasses.is_dataclass(hints[f.name])
                     else values[f.name] for f in dataclasses.fields(schema)})


def eval_config(cfg, schema: type = EvalKeys):
    """The typed config of eval.py (EvalKeys) or serve_check (ServeCheckKeys), built once from Hydra's DictConfig
    after every key is checked; what the evaluation reads, by attribute (cfg.num_prompts, cfg.target.kind)."""
    return cfg if isinstance(cfg, schema) else typed(schema, check_eval_keys(cfg, schema))


@dataclass(frozen=True)
class DraftStartKeys:
    """The draft group's keys that are not its family's Config: where a new run's draft starts (its fresh
    initialisation, the target's layers, or a trained draft's weights)."""

    init_from_target: bool = field(default=False, metadata={"doc": "start the draft from the target's layers"})
    init_from: Optional[str] = field(default=None, metadata={
        "doc": "a trained draft folder (RUN/draft or a serving export) a new run starts from (dspark.warm_start)"})
    init_from_any_target: bool = field(default=False, metadata={
        "doc": "init_from a draft trained against another target (draft/target.json), with a warning"})

    @classmethod
    def of_group(cls, group: Mapping[str, Any]) -> "DraftStartKeys":
        """The warm-start keys of a (checked) draft group, defaults where it leaves them out."""
        return cls(**{f.name: group[f.name] for f in dataclasses.fields(cls) if group.get(f.name) is not None})


@dataclass(kw_only=True)
class RunConfig(RunKeys):
    """train.py's config as one typed object, built once after every key is checked and the draft group is resolved
    against the target (`run_config`); each piece reads its own section by attribute: `target` (TargetKeys), `data`
    (DataKeys), `train` (TrainKeys, the keys every objective shares), `draft` (the family's Config, every size
    resolved against the target's config.json: what the draft is built from, dspark.draft_resolve) and
    `draft_start` (DraftStartKeys: draft.init_from_target / init_from / init_from_any_target). Typed by their owners:
    `objective` (the train.* keys the objectives own: the draft's objective types its own, dspark.objective_keys),
    `trainer` (lightning's Trainer arguments), `callbacks` / `logger` ({_target_: ...} nodes). The draft section
    becomes the draft group (a dict) only where it is saved: `values()`, `draft_group()`."""

    target: TargetKeys
    data: DataKeys
    train: TrainKeys
    objective: dict[str, Any]
    draft: Any
    draft_start: DraftStartKeys
    trainer: dict[str, Any]
    callbacks: Optional[dict[str, Any]]
    logger: Optional[dict[str, Any]]

    @property
    def draft_family(self):
        """The draft's family record (dspark.models.registry.Family): kind, objective, ..."""
        return registry.family_of_config(self.draft)

    @property
    def copies_target(self) -> str | None:
        """The draft's kind when draft.init_from_target starts it from the target's layers (what the target's loading
        must then read: dspark.data.feature_cache_build.target_loading), else None."""
        return self.draft_family.kind if self.draft_start.init_from_target else None

    def draft_group(self) -> dict[str, Any]:
        """The draft section as a draft group, every size resolved (draft/draft_config.json, hyper_parameters):
        kind, the family's group keys, the warm-start keys, every other Config field under `arch`."""
        kind = self.draft_family.kind
        group = registry.resolved_group(self.draft, kind, {"kind": kind})
        arch = group.pop("arch")
        return {**group, **dataclasses.asdict(self.draft_start), "arch": arch}

    def values(self) -> dict:
        """The plain config again (train.* whole, the draft group resolved), as checkpoints' hyper_parameters, the
        loggers and a feature stream's producer hold it."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "draft":
                out["draft"] = self.draft_group()
            elif f.name != "draft_start":
                out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
        out["train"] = {**out["train"], **out.pop("objective")}
        return out


def run_config(cfg, overrides: Iterable[str] = ()) -> RunConfig:
    """The typed config of train.py (RunConfig) from Hydra's DictConfig (or its plain values), every key checked
    (`overrides`: the command line's, as check_run_keys takes them) and the draft group resolved against the target's
    config.json (dspark.draft_resolve.resolve_draft: no weights load); a RunConfig is returned as it is. This is
    where a run's config becomes final: nothing changes it afterwards."""
    if isinstance(cfg, RunConfig):
        return cfg
    values = check_run_keys(cfg, overrides)
    train = values["train"]
    target = typed(TargetKeys, values["target"])
    return RunConfig(
        **{k: values[k] for k in keys_of(RunKeys)},
        target=target, data=typed(DataKeys, values["data"]), train=typed(TrainKeys, train),
        objective={k: v for k, v in train.items() if k not in keys_of(TrainKeys)},
        draft=resolve_draft(target, values["draft"]), draft_start=DraftStartKeys.of_group(values["draft"]),
        trainer=values["trainer"], callbacks=values.get("callbacks"), logger=values.get("logger"))


def describe(schema: type, prefix: str) -> list[tuple[str, str]]:
    """(key, doc) of a schema, nested groups flattened (for --help)."""
    hints = typing.get_type_hints(schema)
    out = []
    for f in dataclasses.fields(schema):
        full = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            out += describe(hints[f.name], full)
        else:
            out.append((full, f.metadata.get("doc", "")))
    return out
