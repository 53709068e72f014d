"""Prompt records from reasoning-gym (PyPI ``reasoning-gym``, Apache-2.0): procedurally generated, seeded
reasoning and arithmetic word problems, a second instruction source besides ShareGPT that needs no download
(the generators and their small word lists ship inside the wheel).

One job: :func:`iter_reasoning_gym` yields ``{"id", "messages": [{"role": "user", ...}], "source", "license"}``
records, the tasks of :data:`DEFAULT_TASKS` taken in turn (so any prefix, e.g. ``--limit N``, is balanced over
them), the same records for the same seed on every machine (reasoning-gym draws item ``i`` of a task from
``Random(seed + i)``). The prompt is the task's question as reasoning-gym writes it; answers are regenerated
by the target, reasoning-gym's reference answers are not kept.

Excluded on purpose:

* ``gsm_symbolic``: its 100 templates are GSM8K TEST questions with names and numbers as variables (template 0
  is the GSM8K test question "Emily can peel 6 shrimp a minute ...", line 990 of
  dspark/assets/eval/gsm8k.jsonl). Training on it would leak the GSM8K benchmark eval.py reports.
* tasks built on bundled third-party data (``codeio``, ``arc_*``/``rearc``, word lists from other corpora) or
  on grids/ASCII art that a chat model of this size cannot read (sudoku, mazes, figlet, ...).

Prompts equal (after whitespace normalisation) to a shipped eval prompt (dspark/assets/eval/*.jsonl, every
turn) are dropped, as are repeats of a prompt already yielded (tiny tasks such as leap-year questions repeat);
both are counted in :class:`ReasoningGymStats`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REASONING_GYM_PACKAGE = "reasoning-gym"
LICENSE = "Apache-2.0"
EVAL_DIR = Path(__file__).resolve().parents[1] / "assets" / "eval"

# Natural-language word problems and short reasoning tasks, none derived from an eval set.
DEFAULT_TASKS = (
    "leg_counting",
    "time_intervals",
    "calendar_arithmetic",
    "family_relationships",
    "aiw",
    "simple_equations",
    "fraction_simplification",
    "prime_factorization",
    "coin_flip",
    "basic_arithmetic",
    "decimal_arithmetic",
    "number_sequence",
    "syllogism",
    "knights_knaves",
    "letter_counting",
    "word_sorting",
)
# Beyond word problems and arithmetic: number theory, algebra, calculus, geometry, logic, strings, planning
# (procedural, no bundled third-party text); the 30k SmolLM2 set draws from DEFAULT_TASKS + these (--rg-tasks wide).
WIDE_EXTRA_TASKS = (
    "base_conversion", "gcd", "lcm", "count_bits", "polynomial_multiplication", "polynomial_equations",
    "simple_geometry", "number_sorting", "number_filtering", "power_function", "complex_arithmetic",
    "simple_integration", "propositional_logic", "tower_of_hanoi", "dice", "isomorphic_strings",
    "bitwise_arithmetic", "chain_sum", "products", "binary_alternation", "string_insertion", "list_functions",
    "jugs", "course_schedule",
)
WIDE_TASKS = DEFAULT_TASKS + WIDE_EXTRA_TASKS
EXCLUDED_TASKS = ("gsm_symbolic",)  # GSM8K test templates (see the module docstring)


@dataclass
class ReasoningGymStats:
    """What :func:`iter_reasoning_gym` yielded and dropped."""

    yielded: int = 0
    dropped_eval_overlap: int = 0
    dropped_duplicate: int = 0
    per_task: dict = field(default_factory=dict)


def normalise_prompt(text: str) -> str:
    """Whitespace-collapsed, case-folded text: what "the same prompt" means for the overlap checks."""
    return " ".join(text.split()).casefold()


def eval_prompts(eval_dir: str | Path = EVAL_DIR) -> set[str]:
    """Every turn of every shipped eval prompt file, normalised."""
    out = set()
    for path in sorted(Path(eval_dir).glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8-sig").split("\n"):  # not splitlines: U+2028 is legal in JSON strings
            if line.strip():
                out.update(normalise_prompt(t) for t in json.loads(line).get("turns", []))
    return out


def _import_reasoning_gym():
    try:
        import reasoning_gym  # noqa: PLC0415 (optional dependency)
    except ImportError as exc:
        raise ImportError(f"--source reasoning-gym needs the PyPI package `{REASONING_GYM_PACKAGE}` "
                          f"(pip install {REASONING_GYM_PACKAGE}, or pip install 'dspark[data]')") from exc
    return reasoning_gym


def iter_reasoning_gym(limit: int, *, seed: int = 0, tasks: Iterable[str] = DEFAULT_TASKS,
                       eval_dir: str | Path | None = EVAL_DIR,
                       stats: ReasoningGymStats | None = None) -> Iterator[dict]:
    """Up to ``limit`` single-turn prompt records, the tasks in turn (item 0 of each, item 1 of each, ...).

    ``seed`` picks the problems (the same ``seed`` gives the same records); ``eval_dir``: prompts equal to one
    of its eval prompts are dropped (None: no check). Record ids are ``rg-<task>-s<seed>-<item>``, stable
    for a (task, seed, item), so a longer run resumes a shorter one.
    """
    tasks = tuple(tasks)
    bad = sorted(set(tasks) & set(EXCLUDED_TASKS))
    if bad:
        raise ValueError(f"reasoning-gym tasks {bad} are excluded (GSM8K test templates: eval leakage)")
    if not tasks or limit <= 0:
        return
    rg = _import_reasoning_gym()
    stats = stats if stats is not None else ReasoningGymStats()
    banned = eval_prompts(eval_dir) if eval_dir is not None else set()
    visited: set[str] = set()  # ids
    prompts: set[str] = set()  # normalised prompts yielded
    # Enough items per task for the limit even when some are dropped; datasets are lazy per item.
    per_task = limit // len(tasks) + 1
    while True:
        datasets = {t: rg.create_dataset(t, size=per_task, seed=seed) for t in tasks}
        for item in range(per_task):
            for task in tasks:
                rid = f"rg-{task}-s{seed}-{item}"
                if rid in visited:  # items already visited in a smaller pass
                    continue
                visited.add(rid)
                question = datasets[task][item]["question"]
                key = normalise_prompt(question)
                if key in banned:
                    stats.dropped_eval_overlap += 1
                    continue
                if key in prompts:
                    stats.dropped_duplicate += 1
                    continue
                prompts.add(key)
                stats.yielded += 1
                stats.per_task[task] = stats.per_task.get(task, 0) + 1
                yield {"id": rid, "messages": [{"role": "user", "content": question}],
                       "source": f"reasoning-gym/{task}", "license": LICENSE}
                if stats.yielded >= limit:
                    logger.info("reasoning-gym: %d records, dropped %d eval overlaps / %d duplicates",
                                stats.yielded, stats.dropped_eval_overlap, stats.dropped_duplicate)
                    return
        if per_task > 64 * (limit + 1):
            logger.warning("reasoning-gym: only %d distinct records for limit %d", stats.yielded, limit)
            return
        per_task *= 2  # too many drops: look further into every task (items already visited are skipped)
