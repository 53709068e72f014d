"""Targets. Importing the package registers the DeepSeek-V4.1 target (model_type "deepseek_v41", dspark.targets.v41)
with transformers' Auto classes, so every loader of a target folder reads V4.1 folders too."""
from dspark.targets import v41 as _v41  # noqa: F401  (registration)
