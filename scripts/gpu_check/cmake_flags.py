"""The CMake settings of llama.cpp's CUDA build, equal to what the release workflow's cargo
build passes, and the checks that keep them equal.

The `kvfork-cuda` job of .github/workflows/wheels.yml runs `KVFORK_WHEEL_FEATURES=cuda make
wheel`: scripts/build_wheel.sh calls maturin with the features `abi3,dynamic-backends,cuda`
and RUSTFLAGS="", and llama-cpp-sys-2's build.rs configures llama.cpp through the `cmake`
crate. What reaches CMake there, in the order build.rs defines it (a later -D wins):

1. every environment variable named CMAKE_* or GGML_*: the workflow's top-level `env:` and
   the cuda job's `env:` (CMAKE_CUDA_ARCHITECTURES), over .cargo/config.toml's `[env]`
   (cargo's [env] does not override a variable already set);
2. build.rs's own defines for this build (`BUILD_RS` below: the features `openmp`, `common`
   from the workspace Cargo.toml, `cuda` and `dynamic-backends` (which turns on
   `dynamic-link`) from the wheel build, Linux x86-64, no target-cpu);
3. what the cmake crate adds (`CMAKE_RS`): the build type from the profile, and C/C++/ASM
   flags from the cc crate for the target (no `-O`, no `-g`: CMake's build type decides).

`workflow_defines` computes that set from the repository's files; `stage_defines` is the GPU
stage's set: the same, except where this build puts its files (GGML_BACKEND_DIR,
CMAKE_INSTALL_PREFIX) and, unless told otherwise, CMAKE_CUDA_ARCHITECTURES narrowed to the
GPU at hand (one of the workflow's list: compiling all of them takes several times as long).
`compare` says so, line by line. Not flags, and so not compared: the generator (Ninja there,
Makefiles in cargo's build), the compilers (the GPU image's gcc and nvcc against the manylinux
image's gcc-toolset and CUDA 12.8), and CMAKE_BUILD_PARALLEL_LEVEL (build.rs forwards the job
count it sets in its own environment; as a cache entry it does nothing).

`check_build_rs` reads build.rs and fails on any define it cannot account for, so an upgrade
of the sys crate that changes what its CUDA build sets shows up in tests/test_gpu_check.py.

usage (PYTHONPATH=scripts):
  python -m gpu_check.cmake_flags flags --repo . --build-dir DIR [--archs 90-real]
  python -m gpu_check.cmake_flags compare --repo . --build-dir DIR [--archs 90-real]
  python -m gpu_check.cmake_flags check-cache --repo . --build-dir DIR [--archs ..] CACHE
  python -m gpu_check.cmake_flags check-build-rs BUILD_RS
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

#: build.rs's defines for this project's wheel build: (value, why). GGML_BACKEND_DIR's value
#: is a path (OUT_DIR/backends), filled in by the caller.
BUILD_RS: dict[str, tuple[str, str]] = {
    "LLAMA_BUILD_TESTS": ("OFF", "always"),
    "LLAMA_BUILD_EXAMPLES": ("OFF", "always"),
    "LLAMA_BUILD_SERVER": ("OFF", "always"),
    "LLAMA_BUILD_TOOLS": ("OFF", "always"),
    "LLAMA_BUILD_APP": ("OFF", "always"),
    "LLAMA_BUILD_COMMON": ("ON", 'feature "common" (workspace Cargo.toml)'),
    "LLAMA_CURL": ("OFF", "always"),
    "GGML_NATIVE": ("OFF", 'no target-cpu=native (RUSTFLAGS="")'),
    "BUILD_SHARED_LIBS": ("ON", 'feature "dynamic-link", from "dynamic-backends"'),
    "GGML_CUDA": ("ON", 'feature "cuda"'),
    "GGML_CUDA_NCCL": ("OFF", 'feature "cuda"'),
    "GGML_OPENMP": ("ON", 'feature "openmp" on Linux'),
    "GGML_WEBGPU": ("OFF", "not an Emscripten target"),
    "GGML_BACKEND_DL": ("ON", 'feature "dynamic-backends"'),
    "GGML_CPU_ALL_VARIANTS": ("ON", 'feature "dynamic-backends"'),
    "GGML_BACKEND_DIR": ("<OUT_DIR>/backends", 'feature "dynamic-backends"'),
}

#: The other keys build.rs defines, and why this build does not reach them.
BUILD_RS_ELSEWHERE: dict[str, str] = {
    **dict.fromkeys(
        (
            "GGML_AVX",
            "GGML_AVX2",
            "GGML_AVX512_BF16",
            "GGML_AVX512_VBMI",
            "GGML_AVX512_VNNI",
            "GGML_AVX_VNNI",
            "GGML_BMI2",
            "GGML_F16C",
            "GGML_FMA",
            "GGML_SSE42",
        ),
        'from the Rust target\'s features: RUSTFLAGS="" leaves the x86-64 baseline',
    ),
    "GGML_BLAS": "Apple targets, feature mkl",
    "GGML_BLAS_VENDOR": "feature mkl",
    "GGML_METAL": "watchOS",
    "GGML_LLAMAFILE": "Android",
    "CMAKE_TOOLCHAIN_FILE": "Android, Emscripten",
    "ANDROID_PLATFORM": "Android",
    "ANDROID_ABI": "Android",
    "ANDROID_STL": "Android",
    "GGML_CPU_ARM_ARCH": "aarch64",
    "EMSCRIPTEN_SYSTEM_PROCESSOR": "Emscripten",
    "LLAMA_OPENSSL": "Emscripten",
    "LLAMA_WASM_MEM64": "Emscripten",
    "GGML_VULKAN": "feature vulkan",
    "Vulkan_INCLUDE_DIR": "feature vulkan",
    "Vulkan_LIBRARY": "feature vulkan",
    "Vulkan_GLSLC_EXECUTABLE": "feature vulkan",
    "SPIRV-Headers_DIR": "feature vulkan",
    "GGML_CUDA_NO_VMM": "feature cuda-no-vmm",
    "GGML_HIP": "feature rocm",
    "GGML_OPENCL": "feature opencl",
    "OpenCL_INCLUDE_DIR": "feature opencl",
    "OpenCL_LIBRARY": "feature opencl",
    "Python3_EXECUTABLE": "feature opencl",
    "LLAMA_BUILD_MTMD": "feature mtmd",
    "LLAMA_USE_SYSTEM_GGML": "feature system-ggml",
}

#: The defines inside build.rs's `if cfg!(feature = ...)` blocks this build turns on: a new
#: one there is a change to the CUDA module's build and must be looked at.
FEATURE_BLOCKS: dict[str, dict[str, str | None]] = {
    "cuda": {"GGML_CUDA": "ON", "GGML_CUDA_NCCL": "OFF", "GGML_CUDA_NO_VMM": "ON"},
    "dynamic-backends": {
        "GGML_BACKEND_DL": "ON",
        "GGML_CPU_ALL_VARIANTS": "ON",
        "GGML_BACKEND_DIR": None,  # a path
    },
}

#: What the cmake crate adds (cmake 0.1, cc 1.x, target x86_64-unknown-linux-gnu, Release):
#: cc's flags for the target without -O and -g, warnings off (-w).
CC_FLAGS = "-ffunction-sections -fdata-sections -fPIC -m64 -march=x86-64 -w"
CMAKE_RS: dict[str, str] = {
    "CMAKE_BUILD_TYPE": "Release",
    "CMAKE_C_FLAGS": CC_FLAGS,
    "CMAKE_CXX_FLAGS": CC_FLAGS,
    "CMAKE_ASM_FLAGS": CC_FLAGS,
}

#: Where a build puts things: equal in meaning, different by nature.
PATH_KEYS = ("GGML_BACKEND_DIR", "CMAKE_INSTALL_PREFIX")
#: Forwarded from the environment, no setting of the build (see the module's docstring).
IGNORED = ("CMAKE_BUILD_PARALLEL_LEVEL",)
ARCHS = "CMAKE_CUDA_ARCHITECTURES"
WORKFLOW = ".github/workflows/wheels.yml"
CUDA_JOB = "cuda"

_DEFINE = re.compile(r"config\s*\.define\(\s*(\"[^\"]*\"|&?\w+)\s*,\s*(.*?)\)\s*;", re.DOTALL)


def defines_in(src: str) -> list[tuple[str, str]]:
    """(key, value expression) of each `config.define(...)` in `src`; the key is `&name` for a
    variable key (the environment-forwarding loops)."""
    out = []
    for m in _DEFINE.finditer(src):
        key = m.group(1)
        out.append((key.strip('"') if key.startswith('"') else key, " ".join(m.group(2).split())))
    return out


def feature_block(src: str, feature: str) -> str | None:
    """The body of build.rs's `if cfg!(feature = "<feature>") ... { ... }` (None if absent)."""
    m = re.search(r"if\s+cfg!\(feature\s*=\s*\"" + re.escape(feature) + r"\"\)[^{]*\{", src)
    if m is None:
        return None
    depth = 1
    i = m.end()
    while depth and i < len(src):
        depth += {"{": 1, "}": -1}.get(src[i], 0)
        i += 1
    return src[m.end() : i - 1]


def check_build_rs(src: str) -> list[str]:
    """Problems with the model above of what build.rs defines (empty: it holds)."""
    problems = []
    found = defines_in(src)
    literal = {k for k, _ in found if not k.startswith("&")}
    for key in sorted(literal - BUILD_RS.keys() - BUILD_RS_ELSEWHERE.keys()):
        problems.append(
            f"build.rs defines {key}, unknown to gpu_check.cmake_flags: add it to BUILD_RS "
            "(the wheel's CUDA build sets it) or BUILD_RS_ELSEWHERE (with why not)"
        )
    for key in sorted(BUILD_RS.keys() - literal):
        problems.append(f"build.rs no longer defines {key}")
    values: dict[str, list[str]] = {}
    for k, v in found:
        values.setdefault(k, []).append(v)
    for key, (value, _why) in BUILD_RS.items():
        exprs = values.get(key, [])
        if key == "LLAMA_BUILD_COMMON":
            ok = any('cfg!(feature = "common")' in e for e in exprs)
        elif key == "BUILD_SHARED_LIBS":
            ok = any("build_shared_libs" in e for e in exprs) and bool(
                re.search(r'let build_shared_libs = cfg!\(feature = "dynamic-link"\)', src)
            )
        elif key == "GGML_BACKEND_DIR":
            ok = bool(exprs)
        else:
            ok = f'"{value}"' in exprs
        if exprs and not ok:
            problems.append(f"build.rs sets {key} otherwise than {value!r}: {exprs}")
    for feature, expected in FEATURE_BLOCKS.items():
        body = feature_block(src, feature)
        if body is None:
            problems.append(f'build.rs has no `if cfg!(feature = "{feature}")` block')
            continue
        got = dict(defines_in(body))
        if got.keys() != expected.keys():
            problems.append(
                f"build.rs's {feature} block defines {sorted(got)}, expected {sorted(expected)}"
            )
        for key, want in expected.items():
            if want is not None and key in got and got[key] != f'"{want}"':
                problems.append(f"build.rs's {feature} block sets {key} = {got[key]}")
    for prefix in ("CMAKE_", "GGML_"):
        if f'key.starts_with("{prefix}")' not in src:
            problems.append(f"build.rs no longer forwards {prefix}* environment variables")
    return problems


def _unquote(value: str) -> str:
    value = value.strip()
    if value[:1] in "\"'":
        return value[1 : value.index(value[0], 1)]
    return value.split(" #")[0].strip()


def yaml_env(text: str, path: Sequence[str]) -> dict[str, str]:
    """The `KEY: value` lines of the mapping at `path` (e.g. ["jobs", "cuda", "env"]) of a
    simple YAML file (block style, two-space indents, as the workflows are written)."""
    lines = text.splitlines()
    start, indent = 0, 0
    for key in path:
        pattern = re.compile(" " * indent + re.escape(key) + r":\s*(#.*)?$")
        for i in range(start, len(lines)):
            line = lines[i]
            stripped = line.strip()
            outdented = len(line) - len(line.lstrip()) < indent
            if i > start and stripped and not stripped.startswith("#") and outdented:
                return {}
            if pattern.match(line):
                start, indent = i + 1, indent + 2
                break
        else:
            return {}
    out = {}
    for line in lines[start:]:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) < indent:
            break
        m = re.match(" " * indent + r"([A-Za-z_][A-Za-z0-9_]*):\s*(.*)$", line)
        if m:
            out[m.group(1)] = _unquote(m.group(2))
    return out


def cargo_env(text: str) -> dict[str, str]:
    """The `[env]` table of a .cargo/config.toml (plain `KEY = "value"` lines)."""
    m = re.search(r"^\[env\]\s*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    if m is None:
        return {}
    return dict(re.findall(r'^\s*([A-Za-z_]\w*)\s*=\s*"([^"]*)"', m.group(1), re.MULTILINE))


def rustflags_features(text: str) -> list[str]:
    """The `-m` flags cc adds for .cargo/config.toml's `target-feature=+a,+b` rustflags."""
    m = re.search(r"target-feature=([^\"]+)", text)
    if m is None:
        return []
    return ["-m" + f[1:] for f in m.group(1).split(",") if f.startswith("+")]


def check_repo(repo: Path) -> list[str]:
    """Problems with the assumptions about how the workflow builds the CUDA wheel."""
    problems = []
    wf = (repo / WORKFLOW).read_text()
    if "KVFORK_WHEEL_FEATURES=cuda make wheel" not in wf:
        problems.append(
            f"{WORKFLOW}: the cuda job no longer runs `KVFORK_WHEEL_FEATURES=cuda make wheel`"
        )
    if ARCHS not in yaml_env(wf, ["jobs", CUDA_JOB, "env"]):
        problems.append(f"{WORKFLOW}: the cuda job's env has no {ARCHS}")
    build = (repo / "scripts" / "build_wheel.sh").read_text()
    if 'export RUSTFLAGS=""' not in build:
        problems.append('scripts/build_wheel.sh no longer sets RUSTFLAGS=""')
    if not re.search(r'features="abi3,dynamic-backends\$\{KVFORK_WHEEL_FEATURES', build):
        problems.append("scripts/build_wheel.sh: features are not abi3,dynamic-backends + extra")
    if re.search(r"^\s*(export\s+)?(CMAKE|GGML)_\w+=", build, re.MULTILINE):
        problems.append("scripts/build_wheel.sh sets CMAKE_* or GGML_* (not modelled here)")
    recipe = re.search(r"^wheel:.*?\n((?:\t.*\n)+)", (repo / "Makefile").read_text(), re.MULTILINE)
    if recipe is None or "cpu_flags" in recipe.group(1) or "GGML_" in recipe.group(1):
        problems.append("Makefile: `make wheel` is no longer plain scripts/build_wheel.sh")
    cargo = (repo / "Cargo.toml").read_text()
    m = re.search(r"^llama-cpp-sys-2\s*=\s*\{(.*)\}", cargo, re.MULTILINE)
    if m is None or "default-features = false" not in m.group(1):
        problems.append("Cargo.toml: llama-cpp-sys-2 is not `default-features = false`")
    elif sorted(re.findall(r'"(\w+)"', m.group(1).split("features = ")[-1])) != [
        "common",
        "openmp",
    ]:
        problems.append("Cargo.toml: llama-cpp-sys-2's features are not exactly openmp, common")
    engine = (repo / "crates" / "kvfork" / "Cargo.toml").read_text()
    for feature in ("cuda", "dynamic-backends"):
        if f'{feature} = ["llama-cpp-2/{feature}"]' not in engine:
            problems.append(f"crates/kvfork/Cargo.toml: {feature} is not llama-cpp-2/{feature}")
    return problems


def workflow_defines(repo: Path, out_dir: str = "<OUT_DIR>") -> dict[str, str]:
    """The -D settings the workflow's cargo build of the CUDA wheel gives llama.cpp's CMake."""
    wf = (repo / WORKFLOW).read_text()
    env = cargo_env((repo / ".cargo" / "config.toml").read_text())
    env.update(yaml_env(wf, ["env"]))
    env.update(yaml_env(wf, ["jobs", CUDA_JOB, "env"]))
    defines = {
        k: v for k, v in env.items() if k.startswith(("CMAKE_", "GGML_")) and k not in IGNORED
    }
    defines.update({k: v for k, (v, _why) in BUILD_RS.items()})
    defines["GGML_BACKEND_DIR"] = f"{out_dir}/backends"
    defines.update(CMAKE_RS)
    defines["CMAKE_INSTALL_PREFIX"] = out_dir
    return defines


def stage_defines(repo: Path, build_dir: str, archs: str | None = None) -> dict[str, str]:
    """The GPU stage's settings: the workflow's, with this build's paths and, if given, the
    CUDA architectures to compile for."""
    defines = workflow_defines(repo, build_dir)
    if archs:
        defines[ARCHS] = archs
    return defines


def compare(workflow: dict[str, str], stage: dict[str, str]) -> tuple[list[str], list[str]]:
    """(notes, problems): each difference between the two, explained, or a problem."""
    notes, problems = [], []
    for key in sorted(workflow.keys() | stage.keys()):
        a, b = workflow.get(key), stage.get(key)
        if a == b:
            continue
        if key in PATH_KEYS:
            notes.append(f"{key}: a path ({b})")
        elif key == ARCHS and a is not None and b is not None:
            extra = set(b.split(";")) - set(a.split(";"))
            if extra:
                problems.append(f"{key}={b}: {sorted(extra)} not in the workflow's {a}")
            else:
                notes.append(f"{key}={b}, one of the workflow's {a} (the GPU at hand)")
        else:
            problems.append(f"{key}: workflow {a!r}, this build {b!r}")
    return notes, problems


def read_cache(text: str) -> dict[str, str]:
    """A CMakeCache.txt's entries, `KEY:TYPE=VALUE` -> {KEY: VALUE}."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"([^#/][^:=]*):[A-Z]+=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def cache_mismatches(cache_text: str, defines: dict[str, str]) -> list[str]:
    """The settings that did not land in a configured build's CMakeCache.txt as given."""
    cache = read_cache(cache_text)
    bad = []
    for key, want in sorted(defines.items()):
        got = cache.get(key)
        if got is None or got.split() != want.split():
            bad.append(f"{key}: asked {want!r}, cache has {got!r}")
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("flags", "compare", "check-cache"):
        p = sub.add_parser(name)
        p.add_argument("--repo", type=Path, default=Path("."))
        p.add_argument("--build-dir", required=True)
        p.add_argument("--archs", default="")
        if name == "check-cache":
            p.add_argument("cache", type=Path)
    p = sub.add_parser("check-build-rs")
    p.add_argument("build_rs", type=Path)
    args = parser.parse_args(argv)
    if args.cmd == "check-build-rs":
        problems = check_build_rs(args.build_rs.read_text())
        print("\n".join(problems) or "build.rs: every define accounted for")
        return 1 if problems else 0
    stage = stage_defines(args.repo, args.build_dir, args.archs or None)
    if args.cmd == "flags":
        for key, value in stage.items():
            print(f"-D{key}={value}")
        return 0
    if args.cmd == "check-cache":
        bad = cache_mismatches(args.cache.read_text(), stage)
        print("\n".join(bad) or "CMakeCache.txt: every setting as given")
        return 1 if bad else 0
    notes, problems = compare(workflow_defines(args.repo), stage)
    problems = check_repo(args.repo) + problems
    print(f"CMake settings: {len(stage)}, equal to the workflow's cargo build except:")
    for line in notes:
        print(f"- {line}")
    for line in problems:
        print(f"- PROBLEM {line}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
