"""Imported first by the tiny-target builders: the checkout's dspark before any installed copy, and idle OpenMP
threads that sleep instead of spinning (on shared cores, spinning threads of tiny ops slow training down by an order
of magnitude; it must be set before torch starts OpenMP)."""
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
