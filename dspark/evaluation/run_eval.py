"""`eval.py` body: trained draft + target -> real speculative decoding on benchmark prompts -> reports.

For each benchmark (`<data_dir>/<name>.jsonl`, one {"turns": [...]} per line; data_dir null = the sets shipped
in dspark/assets/eval) the first `num_prompts`
conversations are decoded turn by turn (`turns=all`; MT-Bench has two): turn t is the chat-template render
of the user turns 1..t with the draft run's own answers to turns 1..t-1 in between (generation prompt
added). Requests are batched (`batch_size`) through the KV-cached target session. Every conversation is
decoded speculatively and, for the speed ratio (and at T=0 an exactness check), with plain cached decoding
of the same target in the same run. Acceptance is counted as vLLM counts it (dspark.evaluation.metrics).

Written to `out` (default <run_dir>/eval): <benchmark>.T<T>.g<gamma>.json, summary.T<T>.g<gamma>.json,
acceptance.T<T>.g<gamma>.png and, for drafts with a confidence head, confidence.T<T>.g<gamma>.json (STS,
ECE/AUC, threshold sweep, scheduler simulation; dspark.evaluation.analysis) + reliability.T<T>.g<gamma>.png.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dspark import factory
from dspark.errors import require
from dspark.evaluation import adaptive, analysis, plots
from dspark.evaluation.exactness import difference_line, greedy_difference
from dspark.evaluation.metrics import AcceptanceCounter
from dspark.evaluation.scheduler import SPSTable
from dspark.evaluation.verify import NOT_REPRODUCED, REJECTION_SAMPLE_METHODS
from dspark.evaluation.speculative import Decoded, Timing, acceptance_counter, plain_generate, \
    speculative_generate_batch
from dspark.integrity import check_file
from dspark.models import registry
from dspark.models.contract import optional
from dspark.models.registry import vllm_options
from dspark.schema import EvalKeys, TargetKeys, check_section, eval_config, typed
from dspark.io import atomic_write_json, remove_stale_tmp, unwritable
from dspark.targets import register_v41
from dspark.targets.health import degenerate_warning, output_health
from dspark.targets.hf_target import FrozenTarget
from dspark.targets.source import shipped_without_work
from dspark.training import draft_dir

log = logging.getLogger("dspark.eval")

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED_BENCHMARKS = Path(__file__).resolve().parents[1] / "assets" / "eval"  # data_dir: null (README there)
ENGINE = "dspark-reference"
STALE_TMP_S = 600  # a temp file of this folder older than this is a killed eval's (another eval may be writing now)


# ---- inputs -------------------------------------------------------------------------------------------
def resolve_path(path: str | Path) -> Path:
    """Absolute paths as given; relative ones against the repository root (not the shell's cwd)."""
    p = Path(str(path)).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def benchmark_dir(cfg: EvalKeys) -> Path:
    """data_dir, or the prompt sets shipped in dspark/assets/eval when it is null."""
    return SHIPPED_BENCHMARKS if cfg.data_dir in (None, "") else resolve_path(cfg.data_dir)


def read_benchmarks(cfg: EvalKeys) -> dict[str, list[list[str]]]:
    """name -> the first num_prompts conversations of <data_dir>/<name>.jsonl, every file checked (read before
    any model loads, so a wrong path or a malformed line fails in a second, not after the target loads)."""
    data_dir = benchmark_dir(cfg)
    out = {}
    for name in cfg.benchmarks:
        path = data_dir / f"{name}.jsonl"
        require(path.is_file(), "benchmarks", f"{name}: {str(path)!r} does not exist ({_benchmark_names(cfg)}; "
                f"data_dir={cfg.data_dir}: a folder of <name>.jsonl files, null = the shipped sets in "
                f"{SHIPPED_BENCHMARKS})")
        out[str(name)] = read_benchmark(path, int(cfg.num_prompts))
        require(len(out[str(name)]) > 0, "benchmarks", f"{name}: no prompts in {path}")
    return out


def _benchmark_names(cfg: EvalKeys) -> str:
    """The benchmark names there are, in words: the shipped sets, and data_dir's when it is another folder."""
    def names(folder: Path) -> str:
        found = sorted(p.stem for p in folder.glob("*.jsonl")) if folder.is_dir() else []
        return ", ".join(found) or "none"

    shipped = f"shipped benchmarks: {names(SHIPPED_BENCHMARKS)}"
    folder = benchmark_dir(cfg)
    return shipped if folder == SHIPPED_BENCHMARKS else f"{folder} holds: {names(folder)}; {shipped}"


def read_benchmark(path: Path, limit: int | None = None) -> list[list[str]]:
    """The user turns of each line of a {"turns": [str, ...]} jsonl file; malformed lines raise with the line number."""
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {str(path)!r} does not exist (check data_dir / benchmarks)")
    convs: list[list[str]] = []
    with path.open(encoding="utf-8-sig") as fh:  # a BOM (Windows editors) is not part of the first line
        for lineno, line in enumerate(fh, start=1):
            if limit is not None and len(convs) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            turns = rec.get("turns") if isinstance(rec, dict) else None
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f'{path}:{lineno}: expected {{"turns": [str, ...]}} with at least one turn')
            convs.append(list(turns))
    return convs


def render_conversation(tokenizer, user_turns: list[str], answers: list[str]) -> list[int]:
    """User turns 1..t with the assistant answers 1..t-1 in between -> token ids of the chat-template render
    with the assistant generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise factory.ConfigError("target: the target tokenizer has no chat_template; eval renders chat prompts")
    if len(answers) != len(user_turns) - 1:
        raise ValueError(f"{len(user_turns)} user turns need {len(user_turns) - 1} answers, got {len(answers)}")
    messages = []
    for i, text in enumerate(user_turns):
        messages.append({"role": "user", "content": text})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def render_prompt(tokenizer, text: str) -> list[int]:
    """One user turn -> token ids of the chat-template render with the assistant generation prompt."""
    return render_conversation(tokenizer, [text], [])


# ---- the draft under evaluation ------------------------------------------------------------------
def _load_draft_group(path: Path) -> DictConfig:
    """draft_config.json (the exported draft group) or a Hydra run config.yaml (its `draft` node)."""
    node = OmegaConf.load(str(path))
    if "kind" not in node and "draft" in node:
        node = node.draft
    require("kind" in node and str(node.kind) in registry.kinds()
            and registry.family(str(node.kind)).drafts_key in node, "draft_config", f"{str(path)!r} holds no draft group")
    return node


def _safe_torch_load(path: Path) -> dict:
    """Lightning .ckpt with weights_only=True (dspark checkpoints hold only tensors and plain types)."""
    return torch.load(str(path), map_location="cpu", weights_only=True)


def draft_source(cfg: EvalKeys) -> tuple[DictConfig, Path, Path]:
    """-> (draft group config, weights file, run dir the default report folder lives in)."""
    has_run, has_ckpt = cfg.run_dir not in (None, ""), cfg.draft_ckpt not in (None, "")
    require(has_run != has_ckpt, "run_dir", "set exactly one of run_dir (a training run dir) or draft_ckpt (a .ckpt)")
    if has_run:
        run_dir = resolve_path(cfg.run_dir)
        require(run_dir.is_dir(), "run_dir", f"{str(run_dir)!r} does not exist (a training run folder, "
                "runs/<experiment>/<stamp>; relative paths resolve against the repository root)")
        folder = run_dir / draft_dir.DRAFT_DIR
        weights, conf = folder / draft_dir.WEIGHTS_FILE, folder / draft_dir.CONFIG_FILE
        require(weights.is_file() and conf.is_file(), "run_dir",
                f"{str(run_dir)!r} lacks draft/model.safetensors + draft/draft_config.json (written when training ends)")
        draft_dir.check(folder)  # complete and unaltered, before any model loads
        if cfg.draft_config:
            conf = resolve_path(cfg.draft_config)
        return _load_draft_group(conf), weights, run_dir
    ckpt = resolve_path(cfg.draft_ckpt)
    require(ckpt.is_file(), "draft_ckpt", f"{str(ckpt)!r} is not a file (DeepSpeed checkpoint folders: convert first)")
    check_file(ckpt, hint="evaluate another checkpoint of the run (draft_ckpt=<path>) or its draft/ (run_dir=)")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    candidates = ([resolve_path(cfg.draft_config)] if cfg.draft_config else
                  [run_dir / "draft" / "draft_config.json", run_dir / ".hydra" / "config.yaml"])
    conf = next((c for c in candidates if c.is_file()), None)
    require(conf is not None, "draft_config", f"no draft config for {str(ckpt)!r}; tried {[str(c) for c in candidates]}")
    return _load_draft_group(conf), ckpt, run_dir


def load_draft_weights(draft: torch.nn.Module, weights: Path) -> None:
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(weights))
    else:
        full = _safe_torch_load(weights)
        require("state_dict" in full, "draft_ckpt", f"{str(weights)!r} is not a Lightning checkpoint (no state_dict)")
        state = {k[len("draft."):]: v for k, v in full["state_dict"].items() if k.startswith("draft.")}
    draft.load_state_dict(state, strict=True)


def build(cfg: EvalKeys, source: tuple[DictConfig, Path, Path] | None = None
          ) -> tuple[FrozenTarget, torch.nn.Module, DictConfig, Path, Path]:
    """-> (target, draft with trained weights, draft group, weights path, run dir); `source`: draft_source(cfg)
    when the caller has it already."""
    draft_group, weights, run_dir = source if source is not None else draft_source(cfg)
    draft_group = OmegaConf.merge(draft_group, {"init_from_target": False})  # trained weights overwrite it
    group = OmegaConf.to_container(draft_group, resolve=True)
    target = factory.build_target(cfg.target, group)
    draft = factory.build_draft(group, target)
    load_draft_weights(draft, weights)
    device = torch.device(str(cfg.device))
    target.to(device)
    draft.to(device).eval()
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    _check_training_target(cfg, run_dir, target)
    return target, draft, draft_group, weights, run_dir


def _check_training_target(cfg: EvalKeys, run_dir: Path, target: FrozenTarget) -> None:
    """Refuse a target other than the one the draft was trained against (draft/target.json fingerprint), unless
    allow_target_mismatch; older runs without that file only get the kind/path comparison, as a warning."""
    recorded = run_dir / draft_dir.DRAFT_DIR / draft_dir.TARGET_FILE
    if recorded.is_file():
        trained = json.loads(recorded.read_text())
        now = target.fingerprint()
        if trained.get("fingerprint") not in (None, now) and not _older_record_matches(target, trained["fingerprint"]):
            msg = (f"the draft was trained against target kind={trained.get('kind')} path={trained.get('path')} "
                   f"(fingerprint {str(trained.get('fingerprint'))[:12]}), this target (kind={cfg.target.kind} "
                   f"path={cfg.target.path}) has fingerprint {now[:12]}: different weights (a record written by an "
                   "older dspark, whose fingerprint depended on the load dtype, matches only with the run's own "
                   "target.dtype when the weights are stored in a finer one)")
            require(cfg.allow_target_mismatch, "target", msg + "; set allow_target_mismatch=true "
                    "to evaluate anyway")
            log.warning(msg)
        return
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if not hydra_cfg.is_file():
        return
    trained = OmegaConf.load(str(hydra_cfg)).get("target")
    if trained is not None and (trained.get("kind"), trained.get("path")) != (cfg.target.kind, cfg.target.path):
        log.warning("the draft was trained against target kind=%s path=%s, evaluating against kind=%s path=%s",
                    trained.get("kind"), trained.get("path"), cfg.target.kind, cfg.target.path)


def _older_record_matches(target: FrozenTarget, recorded: str) -> bool:
    """Whether `recorded` is this target's fingerprint in the older scheme (FrozenTarget.legacy_fingerprint, which
    depended on the dtype the weights were loaded in) for some load dtype; says which, when another than now."""
    loaded = target.embed_weight.dtype
    for dtype in dict.fromkeys((loaded, torch.bfloat16, torch.float32, torch.float16)):
        if target.legacy_fingerprint(dtype) == recorded:
            if dtype != loaded:
                log.info("draft/target.json holds the older fingerprint scheme (the weights as loaded in %s): this "
                         "target, loaded in %s, has those weights", str(dtype).removeprefix("torch."),
                         str(loaded).removeprefix("torch."))
            return True
    return False


# ---- which target: the run's own unless the command line names one ------------------------------------
def target_given(overrides) -> bool:
    """Whether Hydra command-line overrides choose the target (`target=...`, `target.path=...`, `+target.x=...`)."""
    keys = (str(o).lstrip("+~").split("=", 1)[0] for o in overrides)
    return any(k == "target" or k.startswith("target.") for k in keys)


def recorded_target(run_dir: Path) -> dict | None:
    """The target group a run trained against, read from its files (no model loads): the run's
    .hydra/config.yaml `target` node (every key, dtype too) when it agrees with draft/target.json (kind, path),
    else target.json's kind and path on configs/target/<kind>.yaml; None for a run that records neither."""
    rec_file = run_dir / draft_dir.DRAFT_DIR / draft_dir.TARGET_FILE
    record = json.loads(rec_file.read_text()) if rec_file.is_file() else None
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    node = OmegaConf.load(str(hydra_cfg)).get("target") if hydra_cfg.is_file() else None
    node = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_dict(node) else None

    def same(a: dict, b: dict) -> bool:
        return (str(a.get("kind")), str(a.get("path"))) == (str(b.get("kind")), str(b.get("path")))

    if record is None or (node is not None and same(node, record)):
        return node
    group_file = REPO_ROOT / "configs" / "target" / f"{record.get('kind')}.yaml"
    group = OmegaConf.to_container(OmegaConf.load(str(group_file))) if group_file.is_file() else {}
    return {**group, "kind": record.get("kind"), "path": record.get("path")}


def with_run_target(cfg: EvalKeys, run_dir: Path) -> EvalKeys:
    """cfg with `target` replaced by the target the run trained against (recorded_target), when it records one (its
    keys checked as a command line's are)."""
    trained = recorded_target(run_dir)
    if trained is None:
        log.info("target: %s (the run records no target; target=... chooses another)", _target_words(cfg.target))
        return cfg
    known = {f.name for f in dataclasses.fields(TargetKeys)}
    values = {**dataclasses.asdict(cfg.target), **{k: v for k, v in trained.items() if k in known}}
    check_section(TargetKeys, values, "target")
    out = dataclasses.replace(cfg, target=typed(TargetKeys, values))
    log.info("target: %s, the one the draft was trained against (from %s; target=... evaluates another)",
             _target_words(out.target), run_dir / draft_dir.DRAFT_DIR / draft_dir.TARGET_FILE)
    return out


def _target_words(t: TargetKeys | dict) -> str:
    t = dataclasses.asdict(t) if dataclasses.is_dataclass(t) else t
    return f"kind={t.get('kind')} path={t.get('path')}"


def target_config_json(group: dict) -> dict | None:
    """The config.json of a target group's model, read without loading it; None when it is not at hand without
    work (a Hub id not in the Hugging Face cache, a SmolLM2 GGUF not converted yet)."""
    kind, path = group.get("kind"), group.get("path")
    file: Path | None = None
    if path in (None, "???"):
        if shipped_without_work(str(kind)):
            file = Path(factory.target_folder(group)) / "config.json"
    elif Path(str(path)).expanduser().is_dir():
        file = Path(str(path)).expanduser() / "config.json"
    else:
        try:
            from huggingface_hub import try_to_load_from_cache

            hit = try_to_load_from_cache(str(path), "config.json")
        except Exception:  # noqa: BLE001 (not a Hub id: the target load names the problem)
            hit = None
        file = Path(hit) if isinstance(hit, str) else None
    try:
        return json.loads(file.read_text()) if file is not None and file.is_file() else None
    except (OSError, ValueError):
        return None


def check_target_fits(cfg: EvalKeys, draft_group: DictConfig, run_dir: Path) -> None:
    """Before any model loads: refuse a target of another architecture than the one the draft was trained against
    (config.json model_type of the chosen target vs the run's recorded one), and a target the draft's family
    cannot be built against (its config checks, on the target's config alone)."""
    chosen = target_config_json(dataclasses.asdict(cfg.target))
    if chosen is None:
        return
    now_type, kind = chosen.get("model_type"), str(draft_group.kind)
    trained = recorded_target(run_dir)
    trained_json = target_config_json(trained) if trained is not None else None
    trained_type = None if trained_json is None else trained_json.get("model_type")
    if trained_type and now_type and trained_type != now_type:
        raise factory.ConfigError(
            f"target: the {kind} draft in {run_dir} was trained against a {trained_type} target "
            f"({_target_words(trained)}); target {_target_words(cfg.target)} is a {now_type} model: drop target= "
            f"to evaluate against the run's own target, or name a {trained_type} one")
    if "mask_token_id" in draft_group and draft_group.mask_token_id is None:
        return  # an older draft config: resolving it needs the target's tokenizer (the build checks it)
    hf = _hf_config(chosen)
    if hf is None:
        return
    try:
        registry.build_config(OmegaConf.to_container(draft_group, resolve=True), hf)
    except (AttributeError, KeyError, TypeError, factory.ConfigError) as e:
        raise factory.ConfigError(f"target: the {kind} draft does not fit target {_target_words(cfg.target)} "
                                  f"(a {now_type} model; {type(e).__name__}: {e}): evaluate against the target it "
                                  "was trained with (drop target=)") from e


def _hf_config(config_json: dict):
    """A transformers config object from a config.json dict; None for a model_type transformers does not know."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    register_v41()
    model_type = config_json.get("model_type")
    if model_type is None:
        return PretrainedConfig.from_dict(config_json)
    try:
        return CONFIG_MAPPING[model_type].from_dict(config_json)
    except (KeyError, ValueError):
        return None


def eos_ids(cfg: EvalKeys, target: FrozenTarget) -> list[int]:
    if cfg.eos_token_id is not None:
        ids = cfg.eos_token_id
        return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
    found: list[int] = []
    gen = getattr(target.model, "generation_config", None)
    for ids in (getattr(gen, "eos_token_id", None), getattr(target.tokenizer, "eos_token_id", None)):
        if ids is not None:
            found += [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    return sorted(set(found))


# ---- running ---------------------------------------------------------------------------------------
def _validate(cfg: EvalKeys) -> None:
    """What the schema's types and ranges (checked when the typed config was built) do not say."""
    require(len(cfg.benchmarks) >= 1, "benchmarks", "name at least one benchmark")
    require(cfg.device == "cpu" or torch.cuda.is_available(), "device", f"{cfg.device!r} but CUDA is not available")
    require(not cfg.sps_table or resolve_path(cfg.sps_table).is_file(), "sps_table",
            f"{cfg.sps_table!r} is not a file")
    method = cfg.rejection_sample_method
    require(method not in NOT_REPRODUCED, "rejection_sample_method",
            f"{method!r} is one of vLLM's lossy methods {NOT_REPRODUCED}, which eval.py does not reproduce; "
            f"use one of {REJECTION_SAMPLE_METHODS}")


# the keys of a report's vllm_settings every family has; any other key is a family's own option (vllm_options)
VLLM_SETTINGS_KEYS = ("method", "num_speculative_tokens", "draft_sample_method", "note", "rejection_sample_method")


def vllm_settings(draft, g: int, draft_sample_method: str) -> dict:
    """The vLLM 0.33.0 speculative_config these numbers correspond to (same drafts, same acceptance rule): the family's
    vllm_method, its own options (vllm_options) and its note on vLLM's default num_speculative_tokens."""
    out = {"method": draft.config.vllm_method, "num_speculative_tokens": g,
           "draft_sample_method": draft_sample_method, **vllm_options(draft.config)}
    out["note"] = optional(draft.config, "VLLM_TOKENS_NOTE")
    return out


@dataclass
class ConversationRuns:
    """Decoded conversations: outputs[c][t] = tokens generated for turn t of conversation c."""

    outputs: list[list[torch.Tensor]]
    batches: list[Decoded]  # every batched decode call, in order
    turn_of_request: list[int]  # per request (batches flattened): its turn index
    prompts: list[list[torch.Tensor]] = field(default_factory=list)  # prompts[c][t]: the rendered prompt [P]

    @property
    def requests(self) -> list[torch.Tensor]:
        return [t for conv in self.outputs for t in conv]


def decode_conversations(tokenizer, convs: list[list[str]], decode, *, batch_size: int, all_turns: bool,
                         seed: int) -> ConversationRuns:
    """Turn by turn, batches of requests: decode(prompts [P_i] list, generators) -> Decoded."""
    outputs: list[list[torch.Tensor]] = [[] for _ in convs]
    prompts: list[list[torch.Tensor]] = [[] for _ in convs]
    answers: list[list[str]] = [[] for _ in convs]
    batches: list[Decoded] = []
    turn_of_request: list[int] = []
    n_turns = max(len(c) for c in convs) if all_turns else 1
    for t in range(n_turns):
        active = [i for i, c in enumerate(convs) if len(c) > t]
        for lo in range(0, len(active), batch_size):
            chunk = active[lo : lo + batch_size]
            prompts_now = [torch.tensor(render_conversation(tokenizer, convs[i][: t + 1], answers[i])) for i in chunk]
            gens = [torch.Generator().manual_seed(seed + 7919 * t + i) for i in chunk]
            decoded = decode(prompts_now, gens)
            batches.append(decoded)
            for i, prompt, toks in zip(chunk, prompts_now, decoded.tokens):
                outputs[i].append(toks)
                prompts[i].append(prompt)
                answers[i].append(tokenizer.decode(toks.tolist(), skip_special_tokens=True))
                turn_of_request.append(t)
    return ConversationRuns(outputs, batches, turn_of_request, prompts)


def _merged_timing(batches: list[Decoded]) -> Timing:
    out = Timing()
    for d in batches:
        for k in ("rounds", "total_s", "target_s", "draft_s"):
            setattr(out, k, getattr(out, k) + getattr(d.timing, k))
    return out


def benchmark_report(spec: ConversationRuns, plain: ConversationRuns | None, temperature: float) -> dict:
    """Acceptance counters (all turns, and per turn), timing split, forwards per token, speed ratio."""
    steps = [s for d in spec.batches for s in d.steps]  # per request, in request order
    per_turn: dict[int, list[AcceptanceCounter]] = {}
    for t, st in zip(spec.turn_of_request, steps):
        per_turn.setdefault(t, []).append(acceptance_counter(st))
    counters = [c for cs in per_turn.values() for c in cs]
    report = AcceptanceCounter.merged(counters).report()
    n_spec = sum(len(t) for t in spec.requests)
    timing = _merged_timing(spec.batches)
    forwards = sum(1 + len(st) for st in steps)  # prefill + one verify forward per step, per request
    report.update(
        num_prompts=len(spec.outputs), num_requests=len(steps), generated_tokens=n_spec,
        per_turn={str(t + 1): {"num_requests": len(cs), **{k: AcceptanceCounter.merged(cs).report()[k]
                                                        for k in ("mean_acceptance_length", "num_drafts")}}
                  for t, cs in sorted(per_turn.items())},
        per_request_mean_acceptance_length=[c.report()["mean_acceptance_length"] for c in counters],
        harness=timing.report(),
        target_forwards_per_token={"speculative": forwards / max(n_spec, 1)},
        tokens_per_s={"speculative": n_spec / timing.total_s if timing.total_s else None},
        wall_time_s={"speculative": round(timing.total_s, 4)},
    )
    if plain is not None:
        n_plain = sum(len(t) for t in plain.requests)
        pt = _merged_timing(plain.batches)
        report["wall_time_s"]["target"] = round(pt.total_s, 4)
        report["tokens_per_s"]["target"] = n_plain / pt.total_s if pt.total_s else None
        report["target_forwards_per_token"]["target"] = 1.0 if n_plain else None  # one forward per token
        report["batched_target_forwards"] = {"speculative": sum(d.target_forwards for d in spec.batches),
                                             "target": sum(d.target_forwards for d in plain.batches)}
        # per-token rates: at T > 0 the two runs may generate different numbers of tokens
        tps = report["tokens_per_s"]
        report["speedup_vs_target"] = tps["speculative"] / tps["target"] if tps["target"] and tps["speculative"] else None
        if temperature == 0:
            same = sum(a.tolist() == b.tolist() for a, b in zip(spec.requests, plain.requests))
            report["greedy_outputs_equal_target"] = f"{same}/{len(spec.requests)}"
    return report


SAMPLES_PER_BENCHMARK = 3  # decoded texts kept in each benchmark report


def decoded_samples(tokenizer, convs: list[list[str]], spec: ConversationRuns, plain: ConversationRuns | None,
                    n: int = SAMPLES_PER_BENCHMARK) -> list[dict]:
    """The first n decoded requests (conversation order, then turn): the user turn, the speculative output text and,
    when the plain target ran, its output, so a surprising acceptance length can be read against the text."""
    out: list[dict] = []
    for c, turns in enumerate(spec.outputs):
        for t, toks in enumerate(turns):
            if len(out) >= n:
                return out
            sample = {"conversation": c, "turn": t + 1, "prompt": convs[c][t],
                      "output": tokenizer.decode(toks.tolist(), skip_special_tokens=True), "output_tokens": len(toks)}
            if plain is not None:
                sample["target_output"] = tokenizer.decode(plain.outputs[c][t].tolist(), skip_special_tokens=True)
            out.append(sample)
    return out


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def _sps(cfg: EvalKeys, target: FrozenTarget) -> SPSTable:
    if cfg.sps_table:
        return SPSTable.load(resolve_path(cfg.sps_table))
    return analysis.profile_target_sps(target, context=int(cfg.sps_context))


def run_eval(cfg: DictConfig | EvalKeys, target_from_run: bool = False) -> dict[str, dict]:
    """Evaluate every benchmark; write the reports and plots (module docstring); return the reports.
    target_from_run: evaluate against the target the run recorded (draft/target.json), not cfg.target (eval.py
    sets it unless the command line names a target)."""
    cfg = eval_config(cfg)  # the typed config (dspark.schema.EvalKeys), every key checked
    _validate(cfg)
    benchmarks = read_benchmarks(cfg)  # inputs first: prompts, run dir and draft files, report folder, then models
    source = draft_source(cfg)
    out_dir = resolve_path(cfg.out) if cfg.out else source[2] / "eval"
    why = unwritable(out_dir)
    require(why is None, "out" if cfg.out else "run_dir",
            f"the reports go to {out_dir}, but {why}: set out=<a writable folder>")
    for stale in remove_stale_tmp(out_dir, older_than_s=STALE_TMP_S):  # a killed eval's half-written report / plot
        log.info("removed %s, left by an interrupted eval", stale.name)
    if target_from_run:
        cfg = with_run_target(cfg, source[2])
    check_target_fits(cfg, source[0], source[2])
    torch.manual_seed(int(cfg.seed))
    target, draft, draft_group, weights, run_dir = build(cfg, source)
    require(target.tokenizer is not None, "target", "the target has no tokenizer; eval renders chat prompts")
    # gamma defaults to the draft's drafts per verify step (block_size; MTP: num_steps). MTP drafts (chain drafting)
    # have no mask token / layout; the report records what the draft's config says.
    dcfg = draft.config
    mask_id, window = getattr(dcfg, "mask_token_id", None), getattr(dcfg, "sliding_window", None)
    g = int(cfg.num_drafts) if cfg.num_drafts is not None else int(dcfg.block_size)
    layout = str(getattr(dcfg, "layout", "chain"))
    temperature, eos = float(cfg.temperature), eos_ids(cfg, target)
    max_new, bs, seed = int(cfg.max_new_tokens), int(cfg.batch_size), int(cfg.seed)
    sample_method, draft_cache = cfg.draft_sample_method, cfg.draft_cache  # draft_cache=false: recompute per round
    n_samples, reject_method = SAMPLES_PER_BENCHMARK, cfg.rejection_sample_method
    tag = f"T{temperature:g}.g{g}" + ("" if sample_method == "greedy" or temperature == 0 else ".prob") + (
        "" if reject_method == "standard" else f".{reject_method}")
    common = {
        "engine": ENGINE, "temperature": temperature, "gamma": g, "layout": layout, "window": window,
        "vllm_settings": {**vllm_settings(draft, g, sample_method), "rejection_sample_method": reject_method},
        "draft_cache": draft_cache,
        "max_new_tokens": max_new, "batch_size": bs, "turns": str(cfg.turns), "seed": seed,
        "draft_kind": str(draft_group.kind), "draft_weights": str(weights),
        "target": dataclasses.asdict(cfg.target), "eos_token_id": eos, "mask_token_id": mask_id,
        "versions": _versions(),
    }

    def spec_decode(prompts, gens) -> Decoded:
        return speculative_generate_batch(target, draft, prompts, max_new_tokens=max_new, num_drafts=g,
                                          temperature=temperature, eos_token_id=eos, generators=gens,
                                          draft_sample_method=sample_method, draft_cache=draft_cache,
                                          rejection_sample_method=reject_method)

    def plain_decode(prompts, gens) -> Decoded:
        return plain_generate(target, prompts, max_new, temperature, eos, gens)

    reports: dict[str, dict] = {}
    spec_batches: list[Decoded] = []
    sps_cache: list[SPSTable] = []

    def sps() -> SPSTable:  # profiled (or read) once, when first needed
        if not sps_cache:
            sps_cache.append(_sps(cfg, target))
        return sps_cache[0]
    for name, convs in benchmarks.items():
        run = dict(batch_size=bs, all_turns=str(cfg.turns) == "all", seed=seed)
        spec = decode_conversations(target.tokenizer, convs, spec_decode, **run)
        plain = decode_conversations(target.tokenizer, convs, plain_decode, **run) if cfg.compare_target else None
        spec_batches += spec.batches
        reports[name] = {"benchmark": name, **common, **benchmark_report(spec, plain, temperature),
                         "samples": decoded_samples(target.tokenizer, convs, spec, plain, n_samples)}
        if plain is not None and temperature == 0:  # exact k/n below n/n: the first difference, and why
            reports[name]["greedy_difference"] = greedy_difference(target, spec, plain)
        target_outputs = plain if plain is not None else (spec if temperature == 0 else None)  # greedy: the same
        if target_outputs is not None:
            health = output_health([t.tolist() for turns in target_outputs.outputs for t in turns])
            reports[name]["target_output_health"] = health
            reports[name]["target_warning"] = degenerate_warning(health, target.tokenizer, what=f"{name}'s AL")
        if cfg.adaptive_verification and any(d.steps and any(d.steps) for d in spec.batches):
            reports[name]["adaptive_verification"] = {
                **adaptive.simulate([d.steps for d in spec.batches], sps()),
                "vllm_method": draft.config.vllm_method,  # the estimator lives in every DraftModelSpeculator
                "sps_table": sps().to_dict()}
            print(format_adaptive(name, reports[name]["adaptive_verification"]))
        atomic_write_json(out_dir / f"{name}.{tag}.json", reports[name])
        al = reports[name]["mean_acceptance_length"]
        log.info("%s: AL %s", name, "-" if al is None else f"{al:.3f}")
    atomic_write_json(out_dir / f"summary.{tag}.json", {"engine": ENGINE, "reports": reports})
    pictures: list[tuple[Path, str]] = []
    if cfg.plots:
        pictures.append((plots.plot_conditional_acceptance(reports, out_dir / f"acceptance.{tag}.png"),
                         "conditional acceptance per draft position"))
    n_requests = sum(len(d.steps) for d in spec_batches)
    if optional(draft, "confidence_head") is not None and cfg.confidence and n_requests < 2:
        log.warning("confidence analysis skipped: it needs at least 2 requests (fit / held-out), got %d", n_requests)
    elif optional(draft, "confidence_head") is not None and cfg.confidence:
        conf = analysis.confidence_report([d.steps for d in spec_batches], sps())
        atomic_write_json(out_dir / f"confidence.{tag}.json", {**common, **conf})
        if cfg.plots:
            pictures.append((plots.plot_reliability(conf["calibration"], out_dir / f"reliability.{tag}.png"),
                             "reliability of the confidence head, before / after STS"))
        print(format_confidence(conf))
    print(format_summary(reports, out_dir, pictures, tiny_cpu=str(cfg.target.kind).startswith("tiny")
                         and str(cfg.device) == "cpu"))
    return reports


def format_adaptive(name: str, av: dict) -> str:
    """One line in words: the tokens/s vLLM's adaptive verification would realise (simulated from this run's
    acceptance) when the verify length is chosen by the draft's confidence head, by vLLM's acceptance-rate
    estimator, or not chosen at all (verify every drafted token)."""
    def tps(p):
        return "-" if p is None or p["tokens_per_s"] is None else f"{p['tokens_per_s']:.1f} tok/s"

    head = av.get("head")
    by_head = (f"confidence head {tps(head)}, " if head else "")
    verdict = ("" if head is None else f"; the confidence head is {'worth' if av['head_pays'] else 'not worth'} "
               f"using here (x{av['head_vs_estimator']:.3f} vs the estimator)")
    return (f"{name}: adaptive verification (vLLM verifies fewer drafted tokens when they look unlikely to be "
            f"accepted; simulated over {av['engine_steps']} engine steps): verify length chosen by {by_head}"
            f"vLLM's acceptance estimator {tps(av['estimator'])}, verifying all drafts {tps(av['verify_all'])}"
            + (verdict if head else " (this draft has no confidence head)"))


def format_confidence(conf: dict) -> str:
    cal = conf["calibration"]
    lines = [f"confidence (held-out {conf['split']['heldout_blocks']} blocks): pooled ECE "
             f"{cal['pooled']['ece_before']:.3f} -> {cal['pooled']['ece_after']:.3f} after STS, "
             f"T = {[round(t, 3) for t in cal['temperatures']]}"]
    sim = conf.get("scheduler")
    if sim:
        best = sim["best_fixed_length"]
        lines.append(f"scheduler: {sim['scheduler']['tokens_per_s']:.1f} tok/s expected vs best fixed length {best}: "
                     f"{sim['fixed'][str(best)]['tokens_per_s']:.1f} tok/s (x{sim['speedup_vs_best_fixed']:.3f})")
    at_bound = cal.get("temperatures_at_bound") or []
    if at_bound:
        lo, hi = cal.get("fit_bounds", (None, None))
        where = ", ".join(f"{b['k']} (T = {b['T']:g}, {b['bound']})" for b in at_bound)
        lines.append(f"STS (the confidence head's calibration: one temperature per draft position, fitted on half the "
                     f"requests): position{'s' if len(at_bound) > 1 else ''} {where} hit the end of the allowed range "
                     f"[{lo:g}, {hi:g}]: a bound, not a fitted optimum (usually drafts there are almost never, or "
                     "always, accepted in the fit split; more prompts give a real fit)")
    return "\n".join(lines)


LEGEND = ("AL: mean acceptance length, tokens per verify step incl. the bonus token (vLLM's); accept: share of "
          "drafted tokens accepted; speedup: speculative vs plain-target tokens/s; overhead: share of the speculative "
          "wall time outside model forwards (Python harness); exact: requests whose greedy speculative output equals "
          "the plain target's, token for token (all of them in float32; in bf16 a near-tie of the target's top two "
          "tokens can flip, and a line below says so)")


def format_summary(reports: dict[str, dict], out_dir: Path, pictures: list[tuple[Path, str]] | tuple = (),
                   tiny_cpu: bool = False) -> str:
    lines = [f"{'benchmark':<12} {'AL':>6} {'accept':>7} {'speedup':>8} {'overhead':>8} {'exact':>7}  "
             "per-position rate (cumulative)"]
    for name, r in reports.items():
        exact = r.get("greedy_outputs_equal_target") or "-"
        al = r["mean_acceptance_length"]
        rate = r["draft_acceptance_rate"]
        sp = r.get("speedup_vs_target")
        ov = r["harness"]["overhead_share"]
        pos = " ".join(f"{x:.2f}" for x in r["per_position_rate"] if x is not None)
        lines.append(f"{name:<12} {'-' if al is None else f'{al:6.3f}':>6} "
                     f"{'-' if rate is None else f'{rate:7.3f}':>7} {'-' if sp is None else f'{sp:7.2f}x':>8} "
                     f"{'-' if ov is None else f'{100 * ov:7.1f}%':>8} {exact:>7}  {pos}")
    lines += [difference_line(name, r["greedy_difference"]) for name, r in reports.items() if r.get("greedy_difference")]
    lines += [r["target_warning"] for r in reports.values() if r.get("target_warning")]
    lines.append(LEGEND)
    if any(r.get("speedup_vs_target") is not None and r["speedup_vs_target"] < 1 for r in reports.values()):
        lines.append("speedup < 1" + (
            " is expected here: on a tiny target on CPU a draft forward costs about as much as a target forward, so "
            "speculative decoding cannot win time; AL is the measure that carries over to a large target"
            if tiny_cpu else ": the draft and verify rounds cost more than they save on this target and device; AL is "
            "the hardware-independent measure"))
    any_r = next(iter(reports.values()))
    v = any_r.get("vllm_settings") or {}
    lines.append(f"T={any_r['temperature']} gamma={any_r['gamma']} engine={ENGINE}; reports in {out_dir} "
                 f"(each with its first decoded texts under \"samples\")")
    if v:
        lines.append(f"vLLM equivalent: speculative_config method={v['method']} num_speculative_tokens="
                     f"{v['num_speculative_tokens']} draft_sample_method={v['draft_sample_method']}"
                     + "".join(f" {k}={v[k]}" for k in v if k not in VLLM_SETTINGS_KEYS)
                     + (f" rejection_sample_method={v['rejection_sample_method']}"
                        if v.get("rejection_sample_method", "standard") != "standard" else ""))
    lines += [f"picture: {path} ({what})" for path, what in pictures]
    return "\n".join(lines)
