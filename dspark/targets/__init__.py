"""Targets. transformers has no DeepSeek-V4.1 (model_type "deepseek_v41", dspark.targets.v41): every loader of a target
folder or its config.json calls register_v41() first, so transformers' Auto classes read V4.1 folders too. Not done at
the package's import: it loads transformers' DeepSeek-V4 classes (about 2 s), which a command that loads no target
(`python -m dspark.export --help`, `verify`) never needs."""


def register_v41() -> None:
    """Register the V4.1 target with transformers' AutoConfig / AutoModelForCausalLM (importing dspark.targets.v41
    does it, once)."""
    import dspark.targets.v41  # noqa: F401  (registration)
