"""How many conversations a run holds out for validation (data.val_examples): the last ones of the set."""
from __future__ import annotations

from dspark.errors import ConfigError

AUTO_HELD_OUT_MAX = 64  # data.val_examples=auto: a tenth of the conversations, at most this, at least 1


def held_out_count(setting: int | str, n: int) -> int:
    """data.val_examples for `n` usable conversations -> how many are held out (the last ones); ConfigError, one
    line, when the data cannot be split (fewer than 2) or an explicit count leaves nothing to train on."""
    if n < 2:
        raise ConfigError(f"data: {n} usable conversation(s): training needs at least 2 (one held out for validation)")
    if setting == "auto":
        return max(1, min(AUTO_HELD_OUT_MAX, n // 10))
    if not isinstance(setting, int) or not 1 <= setting < n:
        raise ConfigError(f"data.val_examples: {setting!r} cannot be held out of {n} usable conversations (the rest "
                          f"train): use 1 to {n - 1}, or auto (a tenth, at most {AUTO_HELD_OUT_MAX})")
    return setting
