"""Build small C++ CPU kernels on first use (torch's cpp_extension, ``g++``), cached under
``$DSPARK_CACHE/torch_extensions/<name>``, compiled for this CPU (``-march=native``). Where a kernel cannot be
built (no compiler, no headers) the caller's torch path runs and one warning says why."""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_built: dict[str, object] = {}
_failed: dict[str, str] = {}


def load_cpu_kernel(name: str, source: str, functions: list[str], what: str):
    """The compiled module for ``source`` exporting ``functions``, or None (the reason logged once; ``what`` names
    the torch path that runs instead). ``name`` changes whenever the kernel's contract does."""
    if name in _built:
        return _built[name]
    if name in _failed:
        return None
    try:
        from torch.utils.cpp_extension import load_inline  # noqa: PLC0415 (pulls in the compiler toolchain)

        root = Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark")).expanduser()
        build = root / "torch_extensions" / name
        build.mkdir(parents=True, exist_ok=True)
        module = load_inline(name, cpp_sources=source, functions=functions,
                             extra_cflags=["-O3", "-march=native", "-ffast-math"], build_directory=str(build),
                             verbose=False)
    except Exception as exc:  # noqa: BLE001 (no compiler, no headers: the torch path still works)
        _failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        logger.warning("%s: the C++ kernel could not be built (%s); using %s", name, _failed[name], what)
        return None
    _built[name] = module
    return module
