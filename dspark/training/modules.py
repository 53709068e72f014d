"""Objective name (dspark.models.registry `Family.objective`) -> the LightningModule that trains it."""
from __future__ import annotations

from dspark.training.block_module import BlockDraftModule
from dspark.training.mtp_module import MTPDraftModule

MODULES = {"block": BlockDraftModule, "mtp": MTPDraftModule}
