"""The release wheel's run-time CPU code: ggml's CPU variants loaded as modules (a build with
`dynamic-backends`, `make wheel`). Each case runs in a fresh interpreter, since the choice is
made once per process. `make test-wheel` runs this file on the installed wheel; a `make` build
links llama.cpp in and skips it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvfork
import pytest

pytestmark = pytest.mark.skipif(
    kvfork.system_info()["cpu_variant"] == "built-in",
    reason="llama.cpp is linked in (a make build); the release wheel loads CPU modules",
)

# Greedy text of the default model, printed with the variant that produced it.
GENERATE = """
import kvfork
info = kvfork.system_info()
ctx = kvfork.create_context_sync(kvfork.default_model_path(), n_ctx=128)
b = kvfork.Branch.create(ctx, 0, kvfork.SamplingParams(temperature=0))
b.prefill_sync(ctx.tokenize("The history of the printing press begins with"))
print(info["cpu_variant"])
print(repr("".join(t.text for t in b.generate_sync(max_tokens=8))))
"""

# The first load's error, or "loaded <variant>".
FIRST_LOAD = """
import kvfork
try:
    print("loaded", kvfork.system_info()["cpu_variant"])
except kvfork.KvforkError as e:
    print("KvforkError:", e)
"""


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter with `env` added; it must exit normally."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_every_variant_this_cpu_runs_generates_the_same_greedy_text() -> None:
    best = run(GENERATE).stdout.splitlines()
    assert best[0] == kvfork.system_info()["cpu_variant"]
    for variant in ("x64", "sse42", "haswell"):
        lines = run(GENERATE, KVFORK_CPU_VARIANT=variant).stdout.splitlines()
        assert lines[0] == variant
        assert lines[1] == best[1], (variant, lines[1], best[1])


def test_the_amx_variant_is_refused_not_loaded() -> None:
    out = run(FIRST_LOAD, KVFORK_CPU_VARIANT="sapphirerapids").stdout
    assert "KvforkError" in out and "AMX" in out, out


def test_unknown_variant_names_the_ones_there_are() -> None:
    out = run(FIRST_LOAD, KVFORK_CPU_VARIANT="pentium4").stdout
    assert "KvforkError" in out and "x64" in out, out


def test_no_cpu_module_is_a_kvfork_error_not_a_crash(tmp_path: Path) -> None:
    code = f"import kvfork; kvfork._native._set_module_dirs([{str(tmp_path)!r}])\n" + FIRST_LOAD
    out = run(code).stdout
    assert "KvforkError" in out and "no CPU variant" in out, out
