"""Where ggml's backend modules are, for the release wheel (built with ``dynamic-backends``).

The wheel carries llama.cpp's shared libraries and one CPU backend per instruction-set level
in ``kvfork/ggml/``; kvfork loads the best CPU variant this machine runs (never the AMX one)
when the first model loads. GPU backends come as companion packages, pulled in by the
extras ``kvfork[cuda]`` and ``kvfork[vulkan]``: ``kvfork_cuda`` and ``kvfork_vulkan``, each a
directory holding ``libggml-cuda.so`` or ``libggml-vulkan.so`` built from the same llama.cpp.
A module whose runtime (the NVIDIA driver, a Vulkan loader) is missing is skipped, and the
CPU runs the model.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: The companion packages that may hold GPU modules, in order of preference.
GPU_PACKAGES: tuple[str, ...] = ("kvfork_cuda", "kvfork_vulkan")


def _package_dir(name: str) -> Path | None:
    """The directory of the installed package ``name``, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def module_dirs() -> list[str]:
    """The directories to search for ``libggml-*.so``: the wheel's own, then GPU companions."""
    dirs = [Path(__file__).resolve().parent / "ggml"]
    dirs += [d for d in map(_package_dir, GPU_PACKAGES) if d is not None]
    return [str(d) for d in dirs if d.is_dir()]
