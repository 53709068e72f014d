"""`eval.py` body: trained draft + target -> real speculative decoding on benchmark prompts -> JSON reports.

For each benchmark (`<data_dir>/<name>.jsonl`, one {"turns": [...]} per line) the FIRST turn of the first
`num_prompts` prompts is rendered with the target's chat template (generation prompt added), decoded
with `speculative_generate` and, for the speed ratio (and at T=0 an exactness check), with plain
`target_generate` in the same run. Acceptance is counted as vLLM counts it (dspark.evaluation.metrics).
"""
from __future__ import annotations

import json
import logging
import platform
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dspark import factory
from dspark.evaluation.metrics import AcceptanceCounter
from dspark.evaluation.propose import draft_config
from dspark.evaluation.speculative import acceptance_counter, speculative_generate, target_generate
from dspark.io import atomic_write_json
from dspark.targets.hf_target import FrozenTarget

log = logging.getLogger("dspark.eval")

REPO_ROOT = Path(__file__).resolve().parents[2]
ENGINE = "dspark-reference"
require = factory.require


# ---- inputs -------------------------------------------------------------------------------------------
def resolve_path(path: str | Path) -> Path:
    """Absolute paths as given; relative ones against the repository root (not the shell's cwd)."""
    p = Path(str(path)).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def read_benchmark(path: Path, limit: int | None = None) -> list[str]:
    """First user turn of each line of a {"turns": [str, ...]} jsonl file; malformed lines raise with the line number."""
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {str(path)!r} does not exist (check data_dir / benchmarks)")
    prompts: list[str] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if limit is not None and len(prompts) >= limit:
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
            prompts.append(turns[0])
    return prompts


def render_prompt(tokenizer, text: str) -> list[int]:
    """One user turn -> token ids of the chat-template render with the assistant generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise factory.ConfigError("target: the target tokenizer has no chat_template; eval renders chat prompts")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])


# ---- the draft under evaluation ------------------------------------------------------------------
def _load_draft_group(path: Path) -> DictConfig:
    """draft_config.json (the exported draft group) or a Hydra run config.yaml (its `draft` node)."""
    node = OmegaConf.load(str(path))
    if "kind" not in node and "draft" in node:
        node = node.draft
    require("kind" in node and ("block_size" in node or "num_steps" in node), "draft_config",
            f"{str(path)!r} holds no draft group")
    return node


def _safe_torch_load(path: Path) -> dict:
    """Lightning .ckpt with weights_only=True (dspark checkpoints hold only tensors and plain types)."""
    return torch.load(str(path), map_location="cpu", weights_only=True)


def draft_source(cfg: DictConfig) -> tuple[DictConfig, Path, Path]:
    """-> (draft group config, weights file, run dir the default report folder lives in)."""
    has_run, has_ckpt = cfg.run_dir not in (None, ""), cfg.draft_ckpt not in (None, "")
    require(has_run != has_ckpt, "run_dir", "set exactly one of run_dir (a training run dir) or draft_ckpt (a .ckpt)")
    if has_run:
        run_dir = resolve_path(cfg.run_dir)
        weights, conf = run_dir / "draft" / "model.safetensors", run_dir / "draft" / "draft_config.json"
        require(weights.is_file() and conf.is_file(), "run_dir",
                f"{str(run_dir)!r} lacks draft/model.safetensors + draft/draft_config.json (written when training ends)")
        if cfg.get("draft_config"):
            conf = resolve_path(cfg.draft_config)
        return _load_draft_group(conf), weights, run_dir
    ckpt = resolve_path(cfg.draft_ckpt)
    require(ckpt.is_file(), "draft_ckpt", f"{str(ckpt)!r} is not a file (DeepSpeed checkpoint folders: convert first)")
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    candidates = ([resolve_path(cfg.draft_config)] if cfg.get("draft_config") else
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


def build(cfg: DictConfig) -> tuple[FrozenTarget, torch.nn.Module, DictConfig, Path, Path]:
    """-> (target, draft with trained weights, draft group, weights path, run dir)."""
    draft_group, weights, run_dir = draft_source(cfg)
    draft_group = OmegaConf.merge(draft_group, {"init_from_target": False})  # trained weights overwrite it
    build_cfg = OmegaConf.create({"target": OmegaConf.to_container(cfg.target, resolve=True),
                                  "draft": OmegaConf.to_container(draft_group, resolve=True)})
    target = factory.build_target(build_cfg)
    draft = factory.build_draft(build_cfg, target)
    load_draft_weights(draft, weights)
    device = torch.device(str(cfg.device))
    target.to(device)
    draft.to(device).eval()
    draft.share_target_weights(target.embed_weight, target.lm_head_weight)
    _check_training_target(cfg, run_dir)
    return target, draft, draft_group, weights, run_dir


def _check_training_target(cfg: DictConfig, run_dir: Path) -> None:
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if not hydra_cfg.is_file():
        return
    trained = OmegaConf.load(str(hydra_cfg)).get("target")
    if trained is not None and (trained.get("kind"), trained.get("path")) != (cfg.target.kind, cfg.target.path):
        log.warning("the draft was trained against target kind=%s path=%s, evaluating against kind=%s path=%s",
                    trained.get("kind"), trained.get("path"), cfg.target.kind, cfg.target.path)


def eos_ids(cfg: DictConfig, target: FrozenTarget) -> list[int]:
    if cfg.eos_token_id is not None:
        ids = cfg.eos_token_id
        return [int(i) for i in (ids if OmegaConf.is_list(ids) or isinstance(ids, list) else [ids])]
    found: list[int] = []
    gen = getattr(target.model, "generation_config", None)
    for ids in (getattr(gen, "eos_token_id", None), getattr(target.tokenizer, "eos_token_id", None)):
        if ids is not None:
            found += [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]
    return sorted(set(found))


# ---- running ---------------------------------------------------------------------------------------
def _validate(cfg: DictConfig) -> None:
    require(int(cfg.num_prompts) >= 1, "num_prompts", f"must be >= 1, got {cfg.num_prompts}")
    require(int(cfg.max_new_tokens) >= 1, "max_new_tokens", f"must be >= 1, got {cfg.max_new_tokens}")
    require(float(cfg.temperature) >= 0, "temperature", f"must be >= 0, got {cfg.temperature}")
    require(cfg.num_drafts is None or int(cfg.num_drafts) >= 1, "num_drafts", f"must be >= 1 or null, got {cfg.num_drafts}")
    require(len(cfg.benchmarks) >= 1, "benchmarks", "name at least one benchmark")
    require(str(cfg.device) == "cpu" or torch.cuda.is_available(), "device", f"{cfg.device!r} but CUDA is not available")


def evaluate_benchmark(target, draft, prompts: list[list[int]], *, num_drafts: int, mask_token_id: int,
                       layout: str, window: int | None, temperature: float, max_new_tokens: int,
                       eos: list[int], seed: int, compare_target: bool) -> dict:
    """Speculative (and plain) decoding of every prompt; counts, timings and, at T=0, the exactness check."""
    counters: list[AcceptanceCounter] = []
    t_spec = t_plain = 0.0
    n_spec = n_plain = 0
    matches = 0
    for i, ids in enumerate(prompts):
        gen = torch.Generator().manual_seed(seed + i)
        t0 = time.perf_counter()
        out, stats = speculative_generate(target, draft, ids, max_new_tokens=max_new_tokens, num_drafts=num_drafts,
                                          mask_token_id=mask_token_id, layout=layout, window=window,
                                          temperature=temperature, eos_token_id=eos, generator=gen)
        t_spec += time.perf_counter() - t0
        n_spec += len(out)
        counters.append(acceptance_counter(stats))
        if compare_target:
            gen = torch.Generator().manual_seed(seed + i)
            t0 = time.perf_counter()
            ref = target_generate(target, ids, max_new_tokens, temperature, eos, gen)
            t_plain += time.perf_counter() - t0
            n_plain += len(ref)
            matches += int(ref.tolist() == out.tolist())
    report = AcceptanceCounter.merged(counters).report()
    report.update(
        num_prompts=len(prompts), generated_tokens=n_spec, wall_time_s={"speculative": round(t_spec, 4)},
        per_prompt_mean_acceptance_length=[c.report()["mean_acceptance_length"] for c in counters],
    )
    if compare_target:
        report["wall_time_s"]["target"] = round(t_plain, 4)
        # per-token times: at T > 0 the two runs may generate different numbers of tokens
        report["speedup_vs_target"] = ((t_plain / max(n_plain, 1)) / (t_spec / max(n_spec, 1))) if t_spec else None
        if temperature == 0:
            report["greedy_outputs_equal_target"] = f"{matches}/{len(prompts)}"
    return report


def _versions() -> dict:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def run_eval(cfg: DictConfig) -> dict[str, dict]:
    """Evaluate every benchmark; write <out>/<benchmark>.T<T>.g<gamma>.json and summary; return the reports."""
    _validate(cfg)
    torch.manual_seed(int(cfg.seed))
    target, draft, draft_group, weights, run_dir = build(cfg)
    require(target.tokenizer is not None, "target", "the target has no tokenizer; eval renders chat prompts")
    # MTP drafts (own propose, chain drafting) have no mask token / layout; gamma defaults to num_steps.
    mtp = hasattr(draft, "propose") and hasattr(getattr(draft, "config", None), "num_steps")
    dcfg = draft.config if mtp else draft_config(draft)
    mask_id = None if getattr(dcfg, "mask_token_id", None) is None else int(dcfg.mask_token_id)
    window = getattr(dcfg, "sliding_window", None)
    g = int(cfg.num_drafts) if cfg.num_drafts is not None else int(dcfg.num_steps if mtp else dcfg.block_size)
    layout = str(draft_group.get("layout", "chain"))
    temperature, eos = float(cfg.temperature), eos_ids(cfg, target)
    data_dir = resolve_path(cfg.data_dir)
    out_dir = resolve_path(cfg.out) if cfg.out else run_dir / "eval"
    common = {
        "engine": ENGINE, "temperature": temperature, "gamma": g, "layout": layout, "window": window,
        "max_new_tokens": int(cfg.max_new_tokens), "seed": int(cfg.seed), "draft_kind": str(draft_group.kind),
        "draft_weights": str(weights), "target": OmegaConf.to_container(cfg.target, resolve=True),
        "eos_token_id": eos, "mask_token_id": mask_id, "versions": _versions(),
    }
    reports: dict[str, dict] = {}
    for name in cfg.benchmarks:
        texts = read_benchmark(data_dir / f"{name}.jsonl", int(cfg.num_prompts))
        require(len(texts) > 0, "benchmarks", f"{name}: no prompts in {data_dir / f'{name}.jsonl'}")
        prompts = [render_prompt(target.tokenizer, t) for t in texts]
        body = evaluate_benchmark(target, draft, prompts, num_drafts=g, mask_token_id=mask_id, layout=layout,
                                  window=window, temperature=temperature, max_new_tokens=int(cfg.max_new_tokens),
                                  eos=eos, seed=int(cfg.seed), compare_target=bool(cfg.compare_target))
        reports[name] = {"benchmark": name, **common, **body}
        atomic_write_json(out_dir / f"{name}.T{temperature:g}.g{g}.json", reports[name])
    atomic_write_json(out_dir / f"summary.T{temperature:g}.g{g}.json", {"engine": ENGINE, "reports": reports})
    print(format_summary(reports, out_dir))
    return reports


def format_summary(reports: dict[str, dict], out_dir: Path) -> str:
    lines = [f"{'benchmark':<12} {'AL':>6} {'accept':>7} {'speedup':>8}  per-position rate (cumulative)"]
    for name, r in reports.items():
        al = r["mean_acceptance_length"]
        rate = r["draft_acceptance_rate"]
        sp = r.get("speedup_vs_target")
        pos = " ".join(f"{x:.2f}" for x in r["per_position_rate"] if x is not None)
        lines.append(f"{name:<12} {al if al is None else f'{al:6.3f}':>6} "
                     f"{rate if rate is None else f'{rate:7.3f}':>7} {'-' if sp is None else f'{sp:7.2f}x':>8}  {pos}")
    any_r = next(iter(reports.values()))
    lines.append(f"T={any_r['temperature']} gamma={any_r['gamma']} engine={ENGINE}; reports in {out_dir}")
    return "\n".join(lines)
