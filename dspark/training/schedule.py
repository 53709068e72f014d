"""The learning-rate schedule (a multiplier of train.lr by optimizer step): linear warmup, then cosine to
train.min_lr_ratio at trainer.max_steps; and what a resume with another trainer.max_steps (an extension, or a
shorter end) does to it.

A run resumed with the trainer.max_steps it was saved under keeps its schedule exactly (same steps, same lr). One
resumed with another trainer.max_steps continues the decay from where it is: from the resume step s0, whose
multiplier m0 the saved schedule defines, a cosine from m0 to min_lr_ratio at the new max_steps. The lr never jumps
up at the resume step and decays monotonically to the same floor at the new end; a finished run (m0 = the floor)
trains on at the floor. Rejected: the plain schedule of the new length (what train.py did before: 300 -> 600 steps
put the lr of step 300 back from the floor to about half the peak, a jump that undoes part of the annealing) and a
re-warm (its peak and length would be new settings nobody chose; resume_override=[train.lr] train.lr=X scales the
continued decay instead). A resume still in the warmup (s0 before the saved schedule's warmup end) takes the plain
schedule of the new length: its warmup is still under way and only gets longer. The schedule travels in every
checkpoint (`LrSchedule.record`), so a resumed extension resumes its own schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

CHECKPOINT_KEY = "dspark_lr_schedule"  # the LrSchedule.record a checkpoint carries


def warmup_cosine(step: int, max_steps: int, warmup_ratio: float, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup over ceil(warmup_ratio*max_steps) steps, then cosine to min_lr_ratio."""
    warm = warmup_steps(max_steps, warmup_ratio)
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, max_steps - warm))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_steps(max_steps: int, warmup_ratio: float) -> int:
    return max(1, math.ceil(warmup_ratio * max_steps))


@dataclass(frozen=True)
class LrSchedule:
    """warmup_cosine over max_steps; with `from_step` (a resume with another max_steps), from that step on a cosine
    from `from_multiplier` to min_lr_ratio at max_steps (module docstring)."""

    max_steps: int
    warmup_ratio: float
    min_lr_ratio: float
    from_step: int | None = None
    from_multiplier: float = 1.0

    def multiplier(self, step: int) -> float:
        if self.from_step is None or step < self.from_step:
            return warmup_cosine(step, self.max_steps, self.warmup_ratio, self.min_lr_ratio)
        progress = min(1.0, (step - self.from_step) / max(1, self.max_steps - self.from_step))
        return self.min_lr_ratio + (self.from_multiplier - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def extended(self, step: int, max_steps: int) -> "LrSchedule":
        """This schedule, saved at `step`, resumed with trainer.max_steps=`max_steps`: itself when max_steps is the
        same; the plain schedule of the new length while the warmup is under way; else the decay continued from this
        schedule's multiplier at `step` to the floor at the new max_steps."""
        if int(max_steps) == self.max_steps:
            return self
        if self.from_step is None and step < warmup_steps(self.max_steps, self.warmup_ratio):
            return LrSchedule(int(max_steps), self.warmup_ratio, self.min_lr_ratio)
        return LrSchedule(int(max_steps), self.warmup_ratio, self.min_lr_ratio, int(step), self.multiplier(step))

    def with_ratios(self, warmup_ratio: float, min_lr_ratio: float) -> "LrSchedule":
        """The same schedule with this run's warmup_ratio / min_lr_ratio (a resume_override of them)."""
        return replace(self, warmup_ratio=float(warmup_ratio), min_lr_ratio=float(min_lr_ratio))

    def record(self) -> dict:
        return {"max_steps": self.max_steps, "warmup_ratio": self.warmup_ratio, "min_lr_ratio": self.min_lr_ratio,
                "from_step": self.from_step, "from_multiplier": self.from_multiplier}

    @classmethod
    def from_record(cls, d: dict) -> "LrSchedule":
        return cls(int(d["max_steps"]), float(d["warmup_ratio"]), float(d["min_lr_ratio"]),
                   None if d.get("from_step") is None else int(d["from_step"]), float(d.get("from_multiplier", 1.0)))


def saved_schedule(checkpoint: dict) -> LrSchedule | None:
    """The schedule a checkpoint was trained under: its record, or (a checkpoint written before records existed) the
    plain schedule of its run config's trainer.max_steps and train ratios; None when it holds neither."""
    record = checkpoint.get(CHECKPOINT_KEY)
    if record:
        return LrSchedule.from_record(record)
    hp = checkpoint.get("hyper_parameters") or {}
    train, trainer = hp.get("train") or {}, hp.get("trainer") or {}
    if not trainer.get("max_steps") or "warmup_ratio" not in train or "min_lr_ratio" not in train:
        return None
    return LrSchedule(int(trainer["max_steps"]), float(train["warmup_ratio"]), float(train["min_lr_ratio"]))


def resumed_schedule(checkpoint: dict, step: int, max_steps: int, warmup_ratio: float,
                     min_lr_ratio: float) -> LrSchedule:
    """The schedule a run resumed from `checkpoint` (saved at `step`) trains under, with this run's max_steps and
    ratios."""
    saved = saved_schedule(checkpoint)
    if saved is None:
        return LrSchedule(int(max_steps), float(warmup_ratio), float(min_lr_ratio))
    return saved.extended(step, max_steps).with_ratios(warmup_ratio, min_lr_ratio)


def extension_line(schedule: LrSchedule, saved_max_steps: int | None, step: int, lr: float) -> str:
    """What the resume line adds about the lr when trainer.max_steps changed ("" when it did not)."""
    if saved_max_steps is None or saved_max_steps == schedule.max_steps:
        return ""
    if schedule.from_step is None:
        return (f"; the learning rate follows the schedule of {schedule.max_steps} steps (the run was still "
                "warming up)")
    start, floor = lr * schedule.multiplier(step), lr * schedule.min_lr_ratio
    if math.isclose(start, floor, rel_tol=1e-6, abs_tol=1e-12):
        return (f"; the learning rate continues its decay: it stays at its floor {floor:.3g} (where the finished "
                "schedule ended; no re-warm)")
    return (f"; the learning rate continues its decay from {start:.3g} at step {step} to {floor:.3g} at step "
            f"{schedule.max_steps} (no re-warm)")
