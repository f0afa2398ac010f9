"""Gathers the GPU check's inputs into .gpu-check/, in bundles of one device call each, and
prints the calls to make (scripts/gpu_check/prepare.sh runs this with the project's venv).

Inputs: the release wheel (abi3, built with `dynamic-backends`: `make wheel`), the llama.cpp
source the pinned llama-cpp-sys-2 vendors (tar.xz), the wheels the test suite and the server
need that the GPU image lacks (CPython 3.12, manylinux x86-64, at this venv's versions), and
the two test models; or, instead of the source, a CUDA module an earlier session built and
sent back (`--module`). The stage `serve` (not planned unless `--stages` names it) also
takes `llama-server`'s source: the llama.cpp tree of llama-cpp-python 0.3.36's sdist, trimmed
to what its build needs (about 2.6 MiB as xz), and needs the default model only. Each bundle,
with the working tree that travels on every call, stays under 64 MiB.

usage: scripts/gpu_check/prepare.sh [--wheel PATH] [--stages build,install,test,bench,serve]
                                    [--module DIR ...] [--allow-unusable-wheel] [--out DIR]
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .bundles import CALL_LIMIT, MIB, Input, assemble_export, write_bundles

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("build", "install", "test", "bench", "serve")
#: The stages planned when `--stages` is not given (`serve` only when asked for).
DEFAULT_STAGES = ("build", "install", "test", "bench")
#: The GPU machine's Python (its image's python3).
TARGET_PYTHON = (3, 12)
#: Python packages the GPU image has and the check uses as they are there (numpy: 16 MB).
IMAGE_PROVIDES = frozenset({"numpy"})
#: The extras whose packages the test suite imports (the server's tests start `kvfork serve`).
EXTRAS = ("test", "server")
#: manylinux levels pip may pick for the GPU machine (glibc 2.35 or newer there).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(35, 4, -1)] + [
    "manylinux2014_x86_64",
    "manylinux2010_x86_64",
    "manylinux1_x86_64",
]
COMMAND = "scripts/gpu_check/run_stage.sh next"
#: Room left in each call for the working tree to grow between prepare and the calls.
MARGIN = 1 * MIB


@dataclass
class WheelCheck:
    """Whether a kvfork wheel can run the GPU check, and why not."""

    path: Path
    tags: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return not self.problems


def _tag_fits(tag: str, python: tuple[int, int]) -> bool:
    interp, abi, platform = tag.split("-", 2)
    if not platform.endswith("x86_64") or not interp.startswith("cp"):
        return False
    version = int(interp[2:]) if interp[2:].isdigit() else 0
    target = python[0] * 100 + python[1]
    return (abi == "abi3" and version <= target) or (version == target and abi == interp)


def check_wheel(path: Path, python: tuple[int, int] = TARGET_PYTHON) -> WheelCheck:
    """Reads the wheel's tags and files: CPython `python` must take it, and it must carry
    llama.cpp as shared libraries (`kvfork/ggml/libggml-base.so*`), which the CUDA module
    binds to; a developer build links llama.cpp into the extension and loads no module."""
    check = WheelCheck(path)
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        wheel_meta = next((n for n in names if n.endswith(".dist-info/WHEEL")), None)
        text = zf.read(wheel_meta).decode() if wheel_meta else ""
    for line in text.splitlines():
        if line.startswith("Tag:"):
            tag = line.split(":", 1)[1].strip()
            check.tags += [
                f"{i}-{a}-{p}"
                for i in tag.split("-")[0].split(".")
                for a in tag.split("-")[1].split(".")
                for p in tag.split("-", 2)[2].split(".")
            ]
    py = f"{python[0]}.{python[1]}"
    if not any(_tag_fits(t, python) for t in check.tags):
        check.problems.append(
            f"tagged {', '.join(check.tags) or 'nothing'}: CPython {py} (the GPU machine's) "
            "cannot install it. A per-version build (maturin without the `abi3` feature) runs "
            "only on its own Python; the release wheel is abi3 (cp310-abi3: any CPython >= 3.10)"
        )
    if not any(re.fullmatch(r"kvfork/ggml/libggml-base\.so[.0-9]*", n) for n in names):
        check.problems.append(
            "no kvfork/ggml/libggml-base.so: llama.cpp is linked into the extension (a "
            "developer build, without `dynamic-backends`), so it cannot load the CUDA module"
        )
    return check


def find_wheels(root: Path) -> list[Path]:
    """kvfork wheels in the usual places, newest first."""
    dirs = [root / "dist", root / "target" / "wheels"]
    for var in ("CARGO_TARGET_DIR", "KVFORK_WHEEL_TARGET_DIR"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "wheels")
    dirs.append(root / "target-wheel" / "wheels")
    found = {p.resolve() for d in dirs for p in d.glob("kvfork-*.whl")}
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)


def sys_crate_version(root: Path) -> str:
    lock = (root / "Cargo.lock").read_text()
    m = re.search(r'name = "llama-cpp-sys-2"\nversion = "([^"]+)"', lock)
    if m is None:
        raise SystemExit("Cargo.lock has no llama-cpp-sys-2")
    return m.group(1)


def sys_crate_dir(version: str) -> Path:
    """The sys crate's source in cargo's registry (a build has fetched it)."""
    home = Path(os.environ.get("CARGO_HOME") or Path.home() / ".cargo")
    hits = sorted(glob.glob(str(home / "registry" / "src" / "*" / f"llama-cpp-sys-2-{version}")))
    if not hits:
        raise SystemExit(
            f"llama-cpp-sys-2 {version} is not in {home}/registry/src: build once (make setup)"
        )
    return Path(hits[-1])


def source_tarball(version: str, cache: Path) -> Path:
    """The vendored llama.cpp as llama.cpp-VERSION.tar.xz (made once; then reused)."""
    dest = cache / f"llama.cpp-{version}.tar.xz"
    if dest.is_file():
        return dest
    crate = sys_crate_dir(version)
    tmp = dest.with_suffix(".partial")
    tar = subprocess.Popen(
        [
            *("tar", "--sort=name", "--mtime=@0", "--owner=0", "--group=0", "--numeric-owner"),
            *("-C", str(crate), "-cf", "-", "llama.cpp"),
        ],
        stdout=subprocess.PIPE,
    )
    with tmp.open("wb") as out:
        subprocess.run(["xz", "-6", "-T0", "-c"], stdin=tar.stdout, stdout=out, check=True)
    if tar.wait() != 0:
        raise SystemExit("tar of the llama.cpp source failed")
    tmp.replace(dest)
    return dest


#: llama-cpp-python's sdist, whose llama.cpp has tools/server (llama-cpp-sys-2's tree has not):
#: what scripts/build_llama_server.sh builds `llama-server` from, here and for stage serve.
SERVER_SDIST = "llama_cpp_python-0.3.36.tar.gz"
SERVER_REQUIREMENT = "llama-cpp-python==0.3.36"
#: The version of `server_file_kept`'s rules, in the trimmed tarball's name: a change of the
#: rules makes a new one instead of reusing the cached one.
SERVER_TRIM = 1
#: The top of llama.cpp's tree that a `llama-server` build reads (CMake, sources, the vendored
#: libraries, the license texts CMake embeds); models, docs, tests, examples, CI, Python go.
SERVER_TOP = frozenset(
    {"CMakeLists.txt", "CMakePresets.json", "LICENSE"}
    | {"app", "cmake", "common", "ggml", "include", "licenses", "src", "tools", "vendor"}
)
#: ggml's backends the CUDA build compiles (CMake adds a backend's folder only when enabled).
SERVER_BACKENDS = frozenset({"ggml-cpu", "ggml-cuda", "ggml-blas"})
#: What tools/ui/CMakeLists.txt needs with no web UI (LLAMA_BUILD_UI and
#: LLAMA_USE_PREBUILT_UI off): scripts/ui-assets.cmake writes an empty ui.cpp from these.
SERVER_UI = frozenset({"CMakeLists.txt", "ui.cpp.in", "ui.h.in", "sources.cmake", "README.md"})


def server_file_kept(rel: str) -> bool:
    """Whether building `llama-server` (scripts/build_llama_server.sh: tests, examples, the
    app and the web UI off) needs `rel`, a path inside llama.cpp's tree. Every tool's folder
    stays (tools/CMakeLists.txt adds them all), less its tests and media."""
    parts = rel.split("/")
    top = parts[0]
    if rel == "scripts/ui-assets.cmake":  # run by tools/ui at build time
        return True
    if top not in SERVER_TOP:
        return False
    if top == "ggml" and len(parts) > 3 and parts[1] == "src" and parts[2].startswith("ggml-"):
        return parts[2] in SERVER_BACKENDS
    if top == "tools" and len(parts) > 2:
        if parts[1] == "ui":
            return len(parts) == 3 and parts[2] in SERVER_UI
        if parts[2] in ("tests", "bench") or parts[2].startswith("test-"):
            return False
    return True


def trim_server_source(sdist: Path, dest: Path) -> dict[str, int]:
    """llama.cpp's tree of llama-cpp-python's `sdist` (its vendor/llama.cpp), less what
    `server_file_kept` drops, as `dest` (tar.xz with llama.cpp/ at its top, like the
    `source` input; names sorted, owners and times zeroed). Returns the files and bytes kept
    and dropped."""
    counts = {"kept": 0, "kept_bytes": 0, "dropped": 0, "dropped_bytes": 0}
    tmp = dest.with_name(dest.name + ".partial")
    with tarfile.open(sdist, "r:gz") as src:
        members = []
        for m in src.getmembers():
            head, sep, rel = m.name.partition("/vendor/llama.cpp/")
            if not sep or "/" in head or not (m.isfile() or m.issym()):
                continue
            keep = server_file_kept(rel)
            counts["kept" if keep else "dropped"] += 1
            counts["kept_bytes" if keep else "dropped_bytes"] += m.size
            if keep:
                members.append((rel, m))
        members.sort(key=lambda rm: rm[0])
        with tmp.open("wb") as out:
            xz = subprocess.Popen(["xz", "-6", "-T0", "-c"], stdin=subprocess.PIPE, stdout=out)
            assert xz.stdin is not None
            with tarfile.open(fileobj=xz.stdin, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                for rel, m in members:
                    info = tarfile.TarInfo(f"llama.cpp/{rel}")  # owners and time 0
                    info.size, info.mode = m.size, m.mode
                    info.type, info.linkname = m.type, m.linkname
                    tar.addfile(info, src.extractfile(m) if m.isfile() else None)
            xz.stdin.close()
            if xz.wait() != 0:
                raise SystemExit("xz of the llama-server source failed")
    tmp.replace(dest)
    return counts


def server_sdist(root: Path, cache: Path) -> Path:
    """llama-cpp-python's sdist: the one `make peer-server` fetched into .peer-server/, else
    one pip downloads into the cache (once)."""
    for path in (root / ".peer-server" / SERVER_SDIST, cache / SERVER_SDIST):
        if path.is_file():
            return path
    print(f"prepare: pip download of {SERVER_REQUIREMENT}'s sdist (llama-server's source)")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*cmd, SERVER_REQUIREMENT, "-d", str(cache)], check=True)
    return cache / SERVER_SDIST


def server_source_tarball(root: Path, cache: Path) -> Path:
    """The trimmed llama.cpp tree `llama-server` is built from (made once; then reused)."""
    sdist = server_sdist(root, cache)
    version = SERVER_SDIST.removesuffix(".tar.gz").rsplit("-", 1)[1]
    dest = cache / f"llama-server-src-{version}.t{SERVER_TRIM}.tar.xz"
    if not dest.is_file():
        counts = trim_server_source(sdist, dest)
        print(
            f"prepare: llama-server's source from {sdist.name}: {counts['kept']} files, "
            f"{counts['kept_bytes'] / MIB:.1f} MiB ({counts['dropped']} files, "
            f"{counts['dropped_bytes'] / MIB:.1f} MiB left out), {dest.stat().st_size / MIB:.1f} "
            "MiB as xz"
        )
    return dest


def requirements(root: Path, extras: Sequence[str] = EXTRAS) -> list[str]:
    """The requirement strings of pyproject.toml's `extras`."""
    import tomllib

    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    reqs: list[str] = []
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return reqs


def constraints() -> list[str]:
    """`name==version` of each distribution in this interpreter (the venv the suite passes
    in), so the GPU machine tests with the same versions; kvfork itself left out."""
    pins = set()
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name and not re.match(r"kvfork|gemma3", name, re.IGNORECASE):
            pins.add(f"{name}=={dist.version}")
    return sorted(pins)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_wheels(root: Path, cache: Path) -> tuple[Path, list[str]]:
    """test-wheels.tar: every wheel the test and server extras need on CPython 3.12 except
    what the GPU image provides; downloaded once per set of requirements."""
    reqs = requirements(root)
    pins = constraints()
    key = hashlib.sha256(json.dumps([reqs, pins, PLATFORMS]).encode()).hexdigest()[:12]
    folder = cache / f"wheels-{key}"
    tar_path = cache / f"test-wheels-{key}.tar"
    if tar_path.is_file():
        return tar_path, sorted(p.name for p in folder.glob("*.whl"))
    folder.mkdir(parents=True, exist_ok=True)
    pin_file = cache / f"constraints-{key}.txt"
    pin_file.write_text("\n".join(pins) + "\n")
    py = f"{TARGET_PYTHON[0]}.{TARGET_PYTHON[1]}"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:"]
    cmd += ["--python-version", py, "--implementation", "cp", "-d", str(folder)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    cmd += ["-c", str(pin_file), *reqs]
    print(f"prepare: pip download of the {'+'.join(EXTRAS)} extras for CPython {py}")
    subprocess.run(cmd, check=True)
    kept = []
    tmp = tar_path.with_suffix(".partial")
    with tarfile.open(tmp, "w") as tar:
        for whl in sorted(folder.glob("*.whl")):
            if _norm(whl.name.split("-")[0]) in IMAGE_PROVIDES:
                continue
            tar.add(whl, arcname=whl.name)
            kept.append(whl.name)
    tmp.replace(tar_path)
    return tar_path, kept


def model_paths() -> dict[str, Path]:
    """The chat and the default model, as the test suite loads them (the smaller first)."""
    import kvfork

    return {
        "chat": Path(kvfork.default_chat_model_path()),
        "default": Path(kvfork.default_model_path()),
    }


def xz_copy(path: Path, cache: Path) -> Path:
    """`path` compressed with `xz -1` (multi-threaded; made once per file version): the
    models shrink by about 6%, which can spare a device call."""
    stat = path.stat()
    dest = cache / f"{path.name}.{stat.st_size}.{int(stat.st_mtime)}.xz"
    if not dest.is_file():
        print(f"prepare: xz -1 of {path.name} ({stat.st_size / MIB:.0f} MiB, once)")
        tmp = dest.with_suffix(".partial")
        with tmp.open("wb") as out:
            subprocess.run(["xz", "-1", "-T0", "-c", str(path)], stdout=out, check=True)
        tmp.replace(dest)
    return dest


def travelling_tree_size(root: Path) -> int:
    """Bytes of the working tree a device call ships: tracked and untracked-not-ignored
    files, and shared/ where the checkout has one."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout
    total = 0
    for name in out.decode().split("\0"):
        path = root / name
        if name and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    shared = root / "shared"
    if shared.is_dir():
        total += sum(p.stat().st_size for p in shared.rglob("*") if p.is_file())
    return total


#: Minutes each step takes, as measured on an H100 on 2026-11-27 (session time held, from
#: the device tool's `lease.held_s`): a machine's start with the first bundle (35 s); a bundle
#: call (its ~60 MiB transfer, the sha256 checks, the gap before the next call: 10 s); the
#: CUDA build for one architecture on 16 cores (230 s, overlapping the bundle calls); install
#: (6 s); the suite, 730 tests in 16 chunks three at a time (150 s). On an H200 on
#: 2026-11-28: the suite again (757 tests, ~170 s), llama-server's CUDA build (278 s),
#: bench_serve.py's two workloads at 2 rounds (~40 s), and half the benchmark steps in 177 s
#: (the whole stage is a guess from that).
MINUTES = {
    "start": 0.6,
    "bundle": 0.2,
    "build": 3.8,
    "install": 0.1,
    "test": 2.8,
    "bench": 6.0,
    "serve_build": 4.6,
    "serve": 2.0,
}


def estimate(manifest: dict[str, Any]) -> str:
    """The device time the plan may take, from MINUTES (a guess until measured)."""
    stages = set(manifest["meta"].get("stages", DEFAULT_STAGES))
    calls = len(manifest["bundles"])
    total = MINUTES["start"] + calls * MINUTES["bundle"]
    # The builds run detached (sharing the cores) while calls 2.. carry the rest.
    builds = MINUTES["build"] if "build" in stages and "module" not in manifest["meta"] else 0.0
    builds += MINUTES["serve_build"] if "serve" in stages else 0.0
    total += max(0.0, builds - (calls - 1) * MINUTES["bundle"])
    total += sum(MINUTES[s] for s in ("install", "test", "bench", "serve") if s in stages)
    return (
        f"Estimated device time: about {total:.0f} min ({', '.join(sorted(stages))}; "
        "guessed per step in prepare.MINUTES until a run measures it; a session has 15)."
    )


def describe(manifest: dict[str, Any], tree: int, folder: str = ".gpu-check") -> str:
    """The device calls to make, as a developer types them, with the inputs each carries."""
    lines = []
    arts = manifest["artifacts"]
    total = sum(a.get("xz", a)["size"] for a in arts)
    lines.append(
        f"GPU check inputs (plan {manifest['plan_id']}): {total / MIB:.1f} MiB in "
        f"{len(manifest['bundles'])} bundles; the working tree adds {tree / MIB:.1f} MiB to "
        f"each call (limit 64 MiB)"
    )
    for a in arts:
        where = ", ".join(sorted({f"{p['bundle']:02d}" for p in a["parts"]}))
        sent = f" ({a['xz']['size'] / MIB:.1f} MiB as xz)" if "xz" in a else ""
        lines.append(
            f"  {a['name']:<48} {a['kind']:<13} {a['size'] / MIB:7.1f} MiB{sent}  "
            f"{len(a['parts'])} part(s), bundle(s) {where}"
        )
    lines.append("")
    lines.append("Device calls: `run` with timeout_s=600, each with the same command")
    lines.append(f"    {COMMAND}")
    lines.append("and these carry lists, back to back (the machine stays warm 30 s after a call):")
    for b in manifest["bundles"]:
        files = ", ".join(b["files"])
        lines.append(
            f'  {b["index"]}. carry ["{folder}/{b["dir"]}"]  '
            f"({(b['size'] + tree) / MIB:.1f} MiB with the tree): {files}"
        )
    n = len(manifest["bundles"]) + 1
    stages = manifest["meta"].get("stages", DEFAULT_STAGES)
    rest = {"test": "the test chunks not run yet", "bench": "the benchmarks"}
    rest["serve"] = "llama-server's build and bench_serve.py's workloads (stage serve)"
    todo = [rest[s] for s in stages if s in rest] or ["the stages not done yet"]
    lines.append(
        f"  {n}. carry []  and again while the summary says `continue`: {', then '.join(todo)}"
    )
    lines.append(estimate(manifest))
    lines.append(
        "Each call returns $OUT/summary.md (every stage's summary so far) and the logs of the "
        "stages it ran. A summary that says `fresh machine` means the earlier calls' inputs are "
        "gone: resend the bundles it lists as MISSING. `run_stage.sh export` (carry []) sends "
        "the built CUDA module back, for `prepare.sh --module DIR` in a later session."
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wheel", type=Path, help="the kvfork wheel (default: the newest found)")
    parser.add_argument(
        "--stages",
        default=",".join(DEFAULT_STAGES),
        help=f"from {','.join(STAGES)} (default {','.join(DEFAULT_STAGES)}; serve: "
        "llama-server against kvfork serve, bench_serve.py)",
    )
    parser.add_argument(
        "--module",
        type=Path,
        nargs="+",
        help="folders an earlier `run_stage.sh export` returned: send that CUDA module "
        "instead of building one",
    )
    parser.add_argument("--allow-unusable-wheel", action="store_true")
    parser.add_argument("--no-xz", action="store_true", help="send the models uncompressed")
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu-check")
    args = parser.parse_args(argv)
    stages = set(args.stages.split(","))
    if not stages <= set(STAGES):
        parser.error(f"--stages: from {','.join(STAGES)}")
    if stages & {"test", "bench", "serve"}:
        stages.add("install")  # they run on the installed wheel
    if "install" in stages and not args.module:
        stages.add("build")  # which makes the module
    out: Path = args.out
    cache = out / "cache"
    cache.mkdir(parents=True, exist_ok=True)

    needs_wheel = bool(stages - {"build"})
    wheels = [args.wheel] if args.wheel else find_wheels(ROOT)
    if needs_wheel and not wheels:
        raise SystemExit("prepare: no kvfork wheel found (make wheel, or --wheel PATH)")
    checks = [check_wheel(w) for w in wheels] if needs_wheel else [WheelCheck(Path("-"))]
    chosen = next((c for c in checks if c.usable), checks[0])
    if needs_wheel:
        print(f"prepare: wheel {chosen.path}")
    for problem in chosen.problems:
        print(f"prepare: UNUSABLE on the GPU machine: {problem}")
    if not chosen.usable:
        print(
            "prepare: the GPU machine needs the release wheel: `make wheel` (abi3 and "
            "dynamic-backends; about 40 min on 2 cores), then prepare.sh again"
        )
        if not args.allow_unusable_wheel:
            return 1
        print("prepare: --allow-unusable-wheel: bundling it anyway (the install stage will fail)")

    version = sys_crate_version(ROOT)
    inputs: list[Input] = []
    meta: dict[str, Any] = {
        "llama_cpp_sys_2": version,
        "stages": sorted(stages, key=STAGES.index),
        "wheel_tags": chosen.tags,
        "wheel_usable": chosen.usable,
    }
    head = subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    )
    meta["repo"] = head.stdout.strip()
    module_meta: dict[str, Any] | None = None
    if args.module:
        module = cache / "libggml-cuda.so"
        module_meta = assemble_export(args.module, module)
        meta["module"] = module_meta.get("meta", {})
        built_from = meta["module"].get("llama_cpp_sys_2")
        if built_from and built_from != version:
            raise SystemExit(f"prepare: that module is from llama-cpp-sys-2 {built_from}")
    if ("build" in stages and module_meta is None) or "bench" in stages:
        src = source_tarball(version, cache)
        inputs.append(Input(src.name, "source", src, splittable=False))
    if "serve" in stages:
        server_src = server_source_tarball(ROOT, cache)
        meta["server_sdist"] = SERVER_SDIST
        inputs.append(Input(server_src.name, "server-source", server_src, splittable=False))
    if needs_wheel:
        inputs.append(Input(chosen.path.name, "wheel", chosen.path, splittable=False))
    if stages & {"test", "serve"}:  # serve: the server extra, and openai for bench_serve.py
        deps, names = dependency_wheels(ROOT, cache)
        meta["test_wheels"] = names
        inputs.append(Input("test-wheels.tar", "deps", deps, splittable=False))
    if module_meta is not None:
        inputs.append(Input("libggml-cuda.so", "module", cache / "libggml-cuda.so"))
    if stages & {"test", "bench", "serve"}:
        models = model_paths()
        if not stages & {"test", "bench"}:  # bench_serve.py loads the default model only
            models = {"default": models["default"]}
        meta["models"] = {role: p.name for role, p in models.items()}
        inputs += [
            Input(p.name, "model", p, xz=None if args.no_xz else xz_copy(p, cache))
            for p in models.values()
        ]

    tree = travelling_tree_size(ROOT)
    capacity = CALL_LIMIT - tree - MARGIN
    manifest = write_bundles(inputs, out, capacity, meta)
    try:
        folder = str(out.resolve().relative_to(ROOT))
    except ValueError:
        folder = str(out)
        print(f"prepare: {out} is outside the repository: a device call cannot carry it")
    text = describe(manifest, tree, folder)
    (out / "PLAN.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
