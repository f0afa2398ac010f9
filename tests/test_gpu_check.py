"""scripts/gpu_check, the GPU check's machinery, on this machine (no GPU): bundles planned
under the device's 64 MiB a call, inputs cut and put together again over several calls with
their sha256 checked, the CMake settings of the CUDA build against llama-cpp-sys-2's build.rs
and the release workflow, the wheel check, the test suite's resumable chunks, and the GPU
machine's entry script (receive and status) end to end on small inputs."""

from __future__ import annotations

import argparse
import io
import json
import lzma
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any

import kvfork
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check.bundles as bundles  # noqa: E402
import gpu_check.chunks as chunks  # noqa: E402
import gpu_check.cmake_flags as cmake_flags  # noqa: E402
import gpu_check.gpu_bench as gpu_bench  # noqa: E402
import gpu_check.noise as noise  # noqa: E402
import gpu_check.prepare as prepare  # noqa: E402
from gpu_check.bundles import MIB, Input, Item  # noqa: E402

from .serving import bench_serve_module  # noqa: E402

SCRIPTS = ROOT / "scripts" / "gpu_check"


def sys_crate() -> Path | None:
    """llama-cpp-sys-2's source in cargo's registry, if a build fetched it here."""
    try:
        return prepare.sys_crate_dir(prepare.sys_crate_version(ROOT))
    except SystemExit:
        return None


# ---- bundle planning -------------------------------------------------------------------------

# The real inputs' sizes (bytes): llama.cpp source, release wheel (BENCHMARKS.md), test
# wheels, the two models as xz -1 (raw: 98,362,432 and 253,113,024).
REAL = [
    Item("llama.cpp-0.1.161.tar.xz", 4_063_784, splittable=False),
    Item("kvfork-0.1.0-cp310-abi3-manylinux_2_35_x86_64.whl", 15_200_000, splittable=False),
    Item("test-wheels.tar", 14_800_000, splittable=False),
    Item("SmolLM2-135M-Instruct.Q4_1.gguf", 91_856_252),
    Item("gemma-3-270m-q4_k_m.gguf", 239_534_920),
]


def check_plan(items: list[Item], plan: list[list[bundles.Piece]], capacity: int) -> None:
    """Every bundle within capacity, every part under 64 MiB, each item covered exactly once in
    order, unsplittable items whole, no piece but an item's tail a sliver under MIN_PIECE (a
    bundle with less room left is closed instead)."""
    for pieces in plan:
        assert sum(p.size for p in pieces) <= capacity
        assert all(p.size < bundles.PART_LIMIT for p in pieces)
    for item in items:
        pieces = [p for b in plan for p in b if p.name == item.name]
        assert sum(p.size for p in pieces) == item.size
        assert [p.offset for p in pieces] == [
            sum(q.size for q in pieces[:i]) for i in range(len(pieces))
        ]
        if not item.splittable:
            assert len(pieces) == 1
        assert all(p.size >= bundles.MIN_PIECE for p in pieces[:-1])


def test_the_real_inputs_plan_into_calls_under_64_mib() -> None:
    tree = 3 * MIB
    capacity = bundles.CALL_LIMIT - tree - prepare.MARGIN
    plan = bundles.plan_pieces(REAL, capacity)
    check_plan(REAL, plan, capacity)
    for pieces in plan:
        assert sum(p.size for p in pieces) + tree < 64 * MIB
    total = sum(i.size for i in REAL)
    assert len(plan) == -(-total // capacity) == 6  # as few calls as the bytes allow
    assert {p.name for p in plan[0]} >= {i.name for i in REAL if not i.splittable}


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(0, 40 * MIB), st.booleans()), min_size=1, max_size=8),
    capacity=st.integers(2 * MIB, 62 * MIB),
)
def test_any_inputs_plan_within_capacity(sizes: list[tuple[int, bool]], capacity: int) -> None:
    items = [
        Item(f"f{i}", size, splittable=split or size > capacity)
        for i, (size, split) in enumerate(sizes)
    ]
    plan = bundles.plan_pieces(items, capacity)
    check_plan(items, plan, capacity)


def test_an_unsplittable_input_larger_than_a_call_is_refused() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        bundles.plan_pieces([Item("big", 10 * MIB, splittable=False)], 5 * MIB)


# ---- split, receive over several calls, reassemble --------------------------------------------


def make_inputs(tmp_path: Path) -> list[Input]:
    rng = random.Random(7)
    files = {"model.gguf": 5 * MIB + 123, "kvfork.whl": 300_000, "src.tar.xz": 700_000}
    out = []
    for name, size in files.items():
        path = tmp_path / "src" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(rng.randbytes(size))
        kind = {"gguf": "model", "whl": "wheel", "xz": "source"}[name.rsplit(".", 1)[1]]
        xz = None
        if kind == "model":  # a model travels xz-compressed
            xz = path.with_name(name + ".xz")
            xz.write_bytes(lzma.compress(path.read_bytes(), preset=1))
        out.append(Input(name, kind, path, splittable=kind == "model", xz=xz))
    return sorted(out, key=lambda i: i.splittable)


def test_inputs_arrive_over_several_calls_and_reassemble(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path)
    out = tmp_path / "bundles"
    manifest = bundles.write_bundles(inputs, out, 2 * MIB, {"note": "test"})
    folders = sorted(out.glob("bundle-*"))
    assert len(folders) == len(manifest["bundles"]) == 3  # 6.0 MB in 2 MiB bundles
    for folder in folders:
        assert (
            sum(p.stat().st_size for p in folder.iterdir() if p.name != "manifest.json") <= 2 * MIB
        )
    work = tmp_path / "work"
    first = bundles.receive([folders[0]], work)
    assert first.fresh and not first.errors
    assert sorted(first.assembled) == ["kvfork.whl", "src.tar.xz"]
    assert first.missing == {"model.gguf": [2, 3]}  # its first piece came in bundle 1
    assert "MISSING model.gguf: send bundle-02, bundle-03" in first.markdown()
    for folder in folders[1:]:
        report = bundles.receive([folder], work)
        assert not report.errors and not report.fresh
    assert report.assembled == ["model.gguf"] and report.missing == {}
    for i in inputs:
        assert (work / "inputs" / i.name).read_bytes() == i.path.read_bytes()
    assert sorted(p.name for p in (work / "inputs").iterdir()) == sorted(i.name for i in inputs)
    assert not list((work / "parts").iterdir())  # parts dropped once their input is whole
    again = bundles.receive(folders, work)  # idempotent: nothing new
    assert not again.received and not again.assembled and not again.errors
    paths, status = bundles.paths_of_kind(work, "model")
    assert status == 0 and paths == [work / "inputs" / "model.gguf"]
    assert bundles.paths_of_kind(work, "module") == ([], 5)


def test_a_corrupt_part_is_refused_and_its_input_stays_missing(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path)
    out = tmp_path / "bundles"
    manifest = bundles.write_bundles(inputs, out, 2 * MIB)
    model = next(a for a in manifest["artifacts"] if a["name"] == "model.gguf")
    bad = out / f"bundle-{model['parts'][1]['bundle']:02d}" / model["parts"][1]["file"]
    data = bytearray(bad.read_bytes())
    data[1000] ^= 0xFF
    bad.write_bytes(bytes(data))
    report = bundles.receive(sorted(out.glob("bundle-*")), tmp_path / "work")
    assert any("sha256 differs" in e for e in report.errors)
    assert "model.gguf" in report.missing and "model.gguf" not in report.complete


def test_bundles_of_another_prepare_run_are_refused(tmp_path: Path) -> None:
    inputs = make_inputs(tmp_path)
    bundles.write_bundles(inputs, tmp_path / "a", 2 * MIB)
    work = tmp_path / "work"
    bundles.receive([tmp_path / "a" / "bundle-01"], work)
    inputs[0].path.write_bytes(b"changed")
    bundles.write_bundles(inputs, tmp_path / "b", 2 * MIB)
    report = bundles.receive([tmp_path / "b" / "bundle-02"], work)
    assert any("from plan" in e for e in report.errors)


def test_an_exported_file_comes_back_over_several_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bundles, "EXPORT_PART", 1000)
    monkeypatch.setattr(bundles, "EXPORT_PARTS", 2)
    module = tmp_path / "libggml-cuda.so"
    module.write_bytes(os.urandom(4500))
    calls = []
    for i in range(3):
        out = tmp_path / f"out{i}"
        calls.append(out)
        done = bundles.export(tmp_path / "work", module, out, {"archs": "90-real"})
        assert done == (i == 2)
        assert len(list(out.glob("libggml-cuda.so.*[0-9]"))) == (2 if i < 2 else 1)
    with pytest.raises(FileNotFoundError, match="not returned yet"):
        bundles.assemble_export(calls[:2], tmp_path / "back.so")
    manifest = bundles.assemble_export(calls, tmp_path / "back.so")
    assert (tmp_path / "back.so").read_bytes() == module.read_bytes()
    assert manifest["meta"] == {"archs": "90-real"}


# ---- the CMake settings of the CUDA build -----------------------------------------------------


def test_build_rs_defines_are_all_accounted_for() -> None:
    crate = sys_crate()
    if crate is None:
        pytest.skip("llama-cpp-sys-2 is not in cargo's registry here")
    assert cmake_flags.check_build_rs((crate / "build.rs").read_text()) == []


def test_a_changed_build_rs_is_caught() -> None:
    crate = sys_crate()
    if crate is None:
        pytest.skip("llama-cpp-sys-2 is not in cargo's registry here")
    src = (crate / "build.rs").read_text()
    nccl = 'config.define("GGML_CUDA_NCCL", "OFF");'
    assert nccl in src
    added = src.replace(nccl, nccl + '\n        config.define("GGML_CUDA_FORCE_MMQ", "ON");')
    problems = cmake_flags.check_build_rs(added)
    assert any("GGML_CUDA_FORCE_MMQ, unknown" in p for p in problems)
    assert any("cuda block defines" in p for p in problems)
    flipped = cmake_flags.check_build_rs(src.replace(nccl, nccl.replace("OFF", "ON")))
    assert any("GGML_CUDA_NCCL" in p for p in flipped)
    dl = 'config.define("GGML_BACKEND_DL", "ON");'
    assert any("GGML_BACKEND_DL" in p for p in cmake_flags.check_build_rs(src.replace(dl, "")))


def test_the_stage_flags_equal_the_workflows_but_for_the_arch_and_paths() -> None:
    assert cmake_flags.check_repo(ROOT) == []
    workflow = cmake_flags.workflow_defines(ROOT)
    archs = workflow[cmake_flags.ARCHS].split(";")
    assert "90-real" in archs and workflow["GGML_CUDA"] == "ON"
    assert workflow["GGML_BACKEND_DL"] == "ON" and workflow["BUILD_SHARED_LIBS"] == "ON"
    assert workflow["GGML_AVX2"] == "ON"  # the workflow's env, forwarded by build.rs
    stage = cmake_flags.stage_defines(ROOT, "/tmp/b", "90-real")
    notes, problems = cmake_flags.compare(workflow, stage)
    assert problems == []
    assert [n.split(":")[0].split("=")[0] for n in notes] == [
        "CMAKE_CUDA_ARCHITECTURES",
        "CMAKE_INSTALL_PREFIX",
        "GGML_BACKEND_DIR",
    ]
    same = cmake_flags.stage_defines(ROOT, "<OUT_DIR>")
    assert cmake_flags.compare(workflow, same) == ([], [])
    _, bad = cmake_flags.compare(workflow, cmake_flags.stage_defines(ROOT, "/b", "100-real"))
    assert bad and "not in the workflow's" in bad[0]
    stage["GGML_CUDA_FORCE_MMQ"] = "ON"
    assert cmake_flags.compare(workflow, stage)[1] == [
        "GGML_CUDA_FORCE_MMQ: workflow None, this build 'ON'"
    ]


def test_the_cmake_crates_flags_match_the_developer_builds_cache() -> None:
    """CC_FLAGS is what the cmake crate gives the release build (no target features): the
    developer build's cache holds the same plus one -m flag per .cargo/config.toml feature."""
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    caches = sorted(target.glob("release/build/llama-cpp-sys-2-*/out/build/CMakeCache.txt"))
    if not caches:
        pytest.skip("no developer build of llama-cpp-sys-2 here")
    cache = cmake_flags.read_cache(caches[-1].read_text())
    extra = cmake_flags.rustflags_features((ROOT / ".cargo" / "config.toml").read_text())
    assert extra == ["-mavx2", "-mfma", "-mf16c", "-mbmi2"]
    for lang in ("C", "CXX", "ASM"):
        flags = [f for f in cache[f"CMAKE_{lang}_FLAGS"].split() if f not in extra]
        assert flags == cmake_flags.CC_FLAGS.split()
    assert cache["CMAKE_BUILD_TYPE"] == "Release"
    for key in ("LLAMA_BUILD_TESTS", "LLAMA_BUILD_TOOLS", "LLAMA_BUILD_COMMON", "GGML_OPENMP"):
        assert cache[key] == cmake_flags.BUILD_RS[key][0]
    asked = {"GGML_OPENMP": "ON", "CMAKE_C_FLAGS": cache["CMAKE_C_FLAGS"], "GGML_CUDA": "ON"}
    assert cmake_flags.cache_mismatches(caches[-1].read_text(), asked) == [
        "GGML_CUDA: asked 'ON', cache has 'OFF'"
    ]


def test_the_build_stage_takes_every_flag_from_cmake_flags() -> None:
    script = (SCRIPTS / "stage_build.sh").read_text()
    assert "gpu_check.cmake_flags flags" in script and "check-cache" in script
    assert "gpu_check.cmake_flags compare" in script
    assert not re.search(r"-D(GGML|LLAMA|CMAKE)_", script)


def test_yaml_env_reads_the_workflow() -> None:
    text = (ROOT / cmake_flags.WORKFLOW).read_text()
    top = cmake_flags.yaml_env(text, ["env"])
    assert top["GGML_AVX512"] == "OFF" and "MANYLINUX_PYTHON" in top
    cuda = cmake_flags.yaml_env(text, ["jobs", "cuda", "env"])
    assert set(cuda) == {"CMAKE_CUDA_ARCHITECTURES", "CUDA_PATH", "CUDACXX"}
    assert cmake_flags.yaml_env(text, ["jobs", "nope", "env"]) == {}


# ---- the wheel --------------------------------------------------------------------------------


def fake_wheel(path: Path, tag: str, ggml: bool) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("kvfork-0.1.0.dist-info/WHEEL", f"Wheel-Version: 1.0\nTag: {tag}\n")
        zf.writestr("kvfork/__init__.py", "")
        if ggml:
            zf.writestr("kvfork/ggml/libggml-base.so.0", "")
    return path


def test_the_wheel_check_says_what_the_gpu_machine_needs(tmp_path: Path) -> None:
    dev = prepare.check_wheel(fake_wheel(tmp_path / "a.whl", "cp311-cp311-linux_x86_64", False))
    assert not dev.usable and len(dev.problems) == 2
    assert "CPython 3.12" in dev.problems[0] and "abi3" in dev.problems[0]
    assert "cannot load the CUDA module" in dev.problems[1]
    release = "cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64"
    assert prepare.check_wheel(fake_wheel(tmp_path / "b.whl", release, True)).usable
    static = prepare.check_wheel(fake_wheel(tmp_path / "c.whl", release, False))
    assert [p[:23] for p in static.problems] == ["no kvfork/ggml/libggml-"]
    assert prepare.check_wheel(
        fake_wheel(tmp_path / "d.whl", "cp312-cp312-linux_x86_64", True)
    ).usable
    assert not prepare.check_wheel(
        fake_wheel(tmp_path / "e.whl", "cp313-abi3-linux_x86_64", True)
    ).usable


# ---- the test suite in resumable chunks --------------------------------------------------------


def test_chunks_resume_where_the_deadline_stopped_them(tmp_path: Path) -> None:
    plan = chunks.plan_chunks([f"tests/test_{i}.py" for i in range(9)], 2)
    assert [len(c) for c in plan] == [2, 2, 2, 2, 1]
    now = [0.0]
    ran: list[list[str]] = []

    def runner(files: list[str], xml: Path, log: Path, limit: float) -> tuple[int, float]:
        ran.append(files)
        now[0] += 100
        if files == plan[3]:  # this chunk hangs: cut at its limit
            return chunks.CUT, limit
        return (1 if files == plan[1] else 0), 100.0

    def call(deadline: float) -> int:
        return chunks.run(
            tmp_path, plan, deadline, runner, clock=lambda: now[0], log=lambda _: None
        )

    assert call(now[0] + 400) == 3  # three chunks fit (150 s must be left to start one)
    assert ran == plan[:3]
    assert call(now[0] + 400) == 3  # chunk 3 is cut once: run again on the next call
    assert ran[3:] == [plan[3]]
    assert chunks.load_chunk(tmp_path, 3, plan[3]).status == "cut"
    assert call(now[0] + 400) == 0  # cut twice: recorded as timed out; chunk 4 runs
    assert ran[4:] == [plan[3], plan[4]]
    states = [chunks.load_chunk(tmp_path, i, c).status for i, c in enumerate(plan)]
    assert states == ["passed", "failed", "passed", "timeout", "passed"]
    assert call(now[0] + 400) == 0 and len(ran) == 6  # all done: nothing runs
    assert "5/5 chunks done" in chunks.summary(tmp_path)


def test_chunks_run_side_by_side_up_to_jobs_and_stop_at_the_deadline(tmp_path: Path) -> None:
    plan = chunks.plan_chunks([f"tests/test_{i}.py" for i in range(7)], 1)
    lock = threading.Lock()
    running, most, now = [0], [0], [0.0]
    started: list[list[str]] = []

    def runner(files: list[str], xml: Path, log: Path, limit: float) -> tuple[int, float]:
        with lock:
            started.append(files)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05)  # long enough for the other workers to start theirs
        with lock:
            running[0] -= 1
            now[0] += 40  # each chunk moves the clock on: the deadline comes within the run
        return 0, 40.0

    rc = chunks.run(
        tmp_path,
        plan,
        300.0,
        runner,
        jobs=3,
        min_left=150.0,
        clock=lambda: now[0],
        log=lambda _: None,
    )
    assert most[0] == 3  # three at a time, never more
    assert rc == 3 and 3 <= len(started) < 7  # no chunk starts with under 150 s left
    done = [i for i, c in enumerate(plan) if chunks.load_chunk(tmp_path, i, c).done]
    assert sorted(done) == sorted(plan.index(f) for f in started)
    assert chunks.run(tmp_path, plan, 1e12, runner, jobs=3, log=lambda _: None) == 0
    assert sorted(map(tuple, started)) == sorted(map(tuple, plan))  # each chunk ran once
    with pytest.raises(ValueError):
        chunks.run(tmp_path, plan, 1e12, runner, jobs=0)


def test_a_chunk_runs_in_pytest_and_reports_its_failures(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text(
        "import pytest\n\n"
        "def test_ok() -> None:\n    pass\n\n"
        "def test_bad() -> None:\n    assert 1 == 2, 'one is not two'\n\n"
        "@pytest.mark.skip\ndef test_skipped() -> None:\n    pass\n\n"
        "async def test_async() -> None:\n    pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nasyncio_mode = auto\n")
    work = tmp_path / "work"
    plan = chunks.load_plan(work, tmp_path, 6)
    assert plan == [["tests/test_a.py"]]
    rc = chunks.run(work, plan, 1e12, chunks.pytest_runner(tmp_path), log=lambda _: None)
    assert rc == 0
    chunk = chunks.load_chunk(work, 0, plan[0])
    assert (chunk.status, chunk.tests, chunk.failures, chunk.skipped) == ("failed", 4, 1, 1)
    assert chunk.failed_ids[0].startswith("tests.test_a::test_bad: AssertionError: one is not two")
    assert "1 failed" in chunks.summary(work)


# ---- the GPU machine's entry script, end to end on small inputs -------------------------------


def outside_a_gpu_call() -> dict[str, str]:
    """This environment without the GPU check's own variables: the suite runs inside a call
    of stage test, whose deadline (KVFORK_GPU_DEADLINE) must not become these calls'."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVFORK_GPU_")}


def test_run_stage_receives_over_calls_and_says_what_is_missing(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(
        SCRIPTS, repo / "scripts" / "gpu_check", ignore=shutil.ignore_patterns("__pycache__")
    )
    inputs = make_inputs(tmp_path)
    staged = tmp_path / "prepared"
    bundles.write_bundles(inputs, staged, 2 * MIB, {"stages": ["install"]})
    env = {
        **outside_a_gpu_call(),
        "KVFORK_GPU_WORK": str(tmp_path / "work"),
        "KVFORK_GPU_PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
    }
    script = repo / "scripts" / "gpu_check" / "run_stage.sh"

    def call(stage: str, *carry: str) -> tuple[int, str]:
        shutil.rmtree(repo / ".gpu-check", ignore_errors=True)
        for name in carry:
            shutil.copytree(staged / name, repo / ".gpu-check" / name)
        proc = subprocess.run(["bash", str(script), stage], env=env, capture_output=True, text=True)
        return proc.returncode, (tmp_path / "out" / "summary.md").read_text()

    rc, text = call("receive")
    assert rc == 1 and "no bundle has arrived yet" in text
    rc, text = call("receive", "bundle-01")
    assert rc == 4 and "verdict: waiting" in text
    assert "MISSING model.gguf: send bundle-02, bundle-03" in text
    (tmp_path / "go").touch()  # the build may finish
    rc, text = call("next", "bundle-02")
    assert rc == 4 and "MISSING model.gguf: send bundle-03" in text
    assert "waiting: the CUDA module" in text  # install: no module was built
    rc, text = call("status", "bundle-03")
    assert rc == 0 and "verdict: done" in text
    assert "complete: kvfork.whl, src.tar.xz, model.gguf" in text
    assert json.loads((tmp_path / "work" / "manifest.json").read_text())["meta"]["stages"] == [
        "install"
    ]


def test_the_shell_scripts_parse() -> None:
    for script in sorted(SCRIPTS.glob("*.sh")):
        subprocess.run(["bash", "-n", str(script)], check=True)
        if script.name != "common.sh":
            assert os.access(script, os.X_OK), f"{script.name} is not executable"


# ---- stage serve: llama-server's CUDA build and bench_serve.py on the GPU --------------------


def print_cmake(tmp_path: Path, *args: str, path: str | None = None) -> list[str]:
    """scripts/build_llama_server.sh --print-cmake ARGS, split as the shell would."""
    env = {**os.environ, "PATH": path or os.environ["PATH"]}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_llama_server.sh"), "--print-cmake", *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return shlex.split(proc.stdout)


def defines(command: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in command if a.startswith("-D"))


def test_build_llama_server_configures_cuda_without_amx(tmp_path: Path) -> None:
    cpu = print_cmake(tmp_path, str(tmp_path / "cpu"))
    assert cpu[:5] == [
        "cmake",
        "-S",
        f"{tmp_path}/cpu/src/vendor/llama.cpp",
        "-B",
        f"{tmp_path}/cpu/build",
    ]
    assert "GGML_CUDA" not in defines(cpu)
    cuda = print_cmake(
        tmp_path, "--cuda", "--cuda-archs", "80-real;90-real", "--source", "x.tar.xz", "out"
    )
    d = defines(cuda)
    assert d["GGML_CUDA"] == "ON" and d["CMAKE_CUDA_ARCHITECTURES"] == "80-real;90-real"
    assert cuda[2] == "out/src/llama.cpp"  # the trimmed tarball's tree
    for flags in (defines(cpu), d):
        assert flags["LLAMA_BUILD_SERVER"] == "ON" and flags["LLAMA_USE_PREBUILT_UI"] == "OFF"
        assert flags["GGML_NATIVE"] == "OFF"
        amx = {k: v for k, v in flags.items() if "AMX" in k}
        assert amx and set(amx.values()) == {"OFF"}
    # No --cuda-archs: the GPUs' own, from nvidia-smi's compute_cap; Ninja when there is one.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"nvidia-smi": "printf '9.0\\n9.0\\n'", "ninja": "exit 0"}.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    found = print_cmake(tmp_path, "--cuda", "out", path=f"{bin_dir}:{os.environ['PATH']}")
    assert defines(found)["CMAKE_CUDA_ARCHITECTURES"] == "90-real"
    assert found[5:7] == ["-G", "Ninja"]


def fake_sdist(path: Path, files: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            data = f"{name}\n".encode()
            info = tarfile.TarInfo(f"llama_cpp_python-0.3.36/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_server_source_keeps_what_the_server_build_needs(tmp_path: Path) -> None:
    kept = [
        "CMakeLists.txt",
        "LICENSE",
        "cmake/build-info.cmake",
        "common/arg.cpp",
        "ggml/src/ggml.c",
        "ggml/src/ggml-cuda/CMakeLists.txt",
        "ggml/src/ggml-cuda/template-instances/fattn-vec.cu",
        "ggml/src/ggml-cpu/ggml-cpu.c",
        "include/llama.h",
        "scripts/ui-assets.cmake",
        "src/llama.cpp",
        "tools/CMakeLists.txt",
        "tools/mtmd/clip.cpp",
        "tools/quantize/CMakeLists.txt",
        "tools/server/CMakeLists.txt",
        "tools/server/server.cpp",
        "tools/ui/CMakeLists.txt",
        "tools/ui/ui.cpp.in",
        "tools/ui/ui.h.in",
        "vendor/cpp-httplib/httplib.cpp",
    ]
    dropped = [
        ".git",
        ".github/workflows/build.yml",
        "docs/build.md",
        "examples/simple/simple.cpp",
        "ggml/src/ggml-vulkan/ggml-vulkan.cpp",
        "models/ggml-vocab-llama-bpe.gguf",
        "scripts/sync-ggml.sh",
        "tests/test-backend-ops.cpp",
        "tools/mtmd/test-1.jpeg",
        "tools/server/tests/unit/test_basic.py",
        "tools/server/bench/bench.py",
        "tools/ui/src/app.html",
    ]
    sdist = fake_sdist(
        tmp_path / prepare.SERVER_SDIST,
        [f"vendor/llama.cpp/{f}" for f in kept + dropped] + ["llama_cpp/llama.py"],
    )
    counts = prepare.trim_server_source(sdist, tmp_path / "server.tar.xz")
    assert (counts["kept"], counts["dropped"]) == (len(kept), len(dropped))
    with tarfile.open(tmp_path / "server.tar.xz") as tar:
        names = tar.getnames()
        assert names == sorted(f"llama.cpp/{f}" for f in kept)
        member = tar.getmember("llama.cpp/tools/server/CMakeLists.txt")
        assert member.mtime == 0 and member.uid == 0
        data = tar.extractfile(member)
        assert data is not None and data.read() == b"vendor/llama.cpp/tools/server/CMakeLists.txt\n"


def test_the_real_sdist_trims_to_the_server_build() -> None:
    """On llama-cpp-python 0.3.36's sdist (`make peer-server` fetched it), the names only."""
    sdist = ROOT / ".peer-server" / prepare.SERVER_SDIST
    if not sdist.is_file():
        pytest.skip(f"no {sdist}")
    with tarfile.open(sdist) as tar:
        members = {
            m.name.split("/vendor/llama.cpp/", 1)[1]: m.size
            for m in tar
            if "/vendor/llama.cpp/" in m.name
        }
    kept = {name for name in members if prepare.server_file_kept(name)}
    for need in (
        "CMakeLists.txt",
        "tools/server/CMakeLists.txt",
        "tools/ui/ui.cpp.in",
        "scripts/ui-assets.cmake",
    ):
        assert need in kept
    cuda = {n for n in members if n.startswith("ggml/src/ggml-cuda/")}
    assert len(cuda) > 100 and cuda <= kept
    assert not any(
        n.startswith(("models/", "docs/", "tests/", "ggml/src/ggml-vulkan/")) for n in kept
    )
    assert sum(members[n] for n in kept) < 40 * MIB < sum(members.values())


FAKE_CMAKE = """#!/bin/sh
# A stand-in for cmake: records its arguments; configure writes a cache, --build a binary.
echo "$*" >>"$FAKE_LOG"
if [ "$1" = --build ]; then
  mkdir -p "$2/bin" && touch "$2/bin/llama-server" && chmod +x "$2/bin/llama-server"
else
  mkdir -p "$4" && echo "CMAKE_HOME_DIRECTORY:INTERNAL=$(realpath "$2")" >"$4/CMakeCache.txt"
fi
"""


def test_build_llama_server_unpacks_each_kind_of_source_and_resumes(tmp_path: Path) -> None:
    """scripts/build_llama_server.sh with a stand-in cmake: the trimmed tarball and the sdist
    unpacked, configure run again only when its command or tree changed, nothing run when the
    binary of the same command is there."""
    files = ["CMakeLists.txt", "tools/server/CMakeLists.txt", "docs/x.md"]
    sdist = fake_sdist(tmp_path / prepare.SERVER_SDIST, [f"vendor/llama.cpp/{f}" for f in files])
    trimmed = tmp_path / "server.tar.xz"
    prepare.trim_server_source(sdist, trimmed)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "cmake").write_text(FAKE_CMAKE)
    (bin_dir / "cmake").chmod(0o755)
    log = tmp_path / "cmake.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log)}
    out = tmp_path / "out"

    def build(*args: str) -> list[str]:
        before = log.read_text().splitlines() if log.exists() else []
        proc = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build_llama_server.sh"), *args, str(out)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert proc.stdout == f"{out}/build/bin/llama-server\n"
        return log.read_text().splitlines()[len(before) :] if log.exists() else []

    calls = build("--source", str(trimmed), "--jobs", "3")
    assert (out / "src" / "llama.cpp" / "tools" / "server" / "CMakeLists.txt").is_file()
    assert not (out / "src" / "llama.cpp" / "docs").exists()
    assert calls[0].startswith(f"-S {out}/src/llama.cpp -B {out}/build")
    assert calls[1] == f"--build {out}/build --target llama-server -j 3"
    assert build("--source", str(trimmed)) == []  # built: nothing to do
    calls = build("--source", str(trimmed), "--cuda-archs", "90-real")
    assert len(calls) == 2 and "-DGGML_CUDA=ON" in calls[0]
    (out / "build" / "bin" / "llama-server").unlink()  # as a cut build leaves it
    calls = build("--source", str(trimmed), "--cuda-archs", "90-real")
    assert [c.split()[0] for c in calls] == ["--build"]  # configured already: goes on
    calls = build("--source", str(sdist), "--cuda-archs", "90-real")  # another tree
    assert calls[0].startswith(f"-S {out}/src/vendor/llama.cpp -B {out}/build")
    assert (out / "src" / "vendor" / "llama.cpp" / "docs" / "x.md").is_file()


def test_prepare_plans_the_server_source_only_for_stage_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def small(name: str, size: int = 1000) -> Path:
        path = tmp_path / "files" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(size))
        return path

    release = "cp310-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64"
    wheel = fake_wheel(
        tmp_path / "kvfork-0.1.0-cp310-abi3-manylinux_2_17_x86_64.whl", release, True
    )
    monkeypatch.setattr(prepare, "source_tarball", lambda version, cache: small("llama.cpp.tar.xz"))
    monkeypatch.setattr(
        prepare, "server_source_tarball", lambda root, cache: small("llama-server-src.tar.xz")
    )
    monkeypatch.setattr(
        prepare, "dependency_wheels", lambda root, cache: (small("test-wheels.tar"), ["a.whl"])
    )
    monkeypatch.setattr(
        prepare, "model_paths", lambda: {"chat": small("chat.gguf"), "default": small("d.gguf")}
    )
    monkeypatch.setattr(prepare, "travelling_tree_size", lambda root: 3 * MIB)

    def plan(*stages: str) -> dict[str, Any]:
        out = tmp_path / "out"
        args = ["--wheel", str(wheel), "--no-xz", "--out", str(out), *stages]
        assert prepare.main(args) == 0
        manifest: dict[str, Any] = json.loads((out / "manifest.json").read_text())
        return manifest

    serve = plan("--stages", "serve")
    kinds = sorted(a["kind"] for a in serve["artifacts"])
    assert kinds == ["deps", "model", "server-source", "source", "wheel"]
    assert serve["meta"]["stages"] == ["build", "install", "serve"]
    assert serve["meta"]["models"] == {"default": "d.gguf"}  # bench_serve.py's only
    full = plan()
    assert "server-source" not in {a["kind"] for a in full["artifacts"]}
    assert full["meta"]["stages"] == ["build", "install", "test", "bench"]


def test_bench_serve_offloads_llama_servers_layers_only_as_kvfork_does(tmp_path: Path) -> None:
    """bench_serve.py --gpu-layers N: llama-server gets -ngl N when kvfork serve offloads the
    same (every layer on a GPU backend, none on the CPU); no -ngl when not given."""
    import kvfork

    bench = bench_serve_module()
    server = tmp_path / "llama-server"
    server.touch()
    args = argparse.Namespace(
        gpu_layers=None,
        llama_server=str(server),
        adaptive=False,
        example_server="",
        peer_python="",
        kvfork_variant=[],
    )

    def llama_command() -> list[str]:
        specs = {s.name: s for s in bench.servers(args, Path("m.gguf"), 16)}
        assert sorted(specs) == ["kvfork", "llama-server"]
        command: list[str] = specs["llama-server"].command(8080)
        return command

    assert "-ngl" not in llama_command()
    on_gpu = kvfork.system_info()["backend"] != "cpu"
    args.gpu_layers = 99 if on_gpu else 0
    assert llama_command()[-2:] == ["-ngl", str(args.gpu_layers)]
    args.gpu_layers = 0 if on_gpu else 99
    with pytest.raises(SystemExit, match="llama-server would not match"):
        llama_command()
    # --kvfork-variant NAME=ARGS: kvfork serve again, with those options, under NAME.
    args.gpu_layers, args.kvfork_variant = None, ["no-warmup=--warmup off --loop asyncio"]
    specs = {s.name: s for s in bench.servers(args, Path("m.gguf"), 16)}
    base, variant = specs["kvfork"].command(8080), specs["no-warmup"].command(8080)
    assert variant == [*base, "--warmup", "off", "--loop", "asyncio"]


FAKE_BUILD = """#!/usr/bin/env bash
# A stand-in for scripts/build_llama_server.sh: records its arguments, makes a llama-server.
echo "$*" >>"$FAKE_LOG"
for _ in $(seq 300); do [ -f "$FAKE_GO" ] && break; sleep 0.1; done # held until the test says
dir=${@: -1}
mkdir -p "$dir/build/bin"
printf 'CMAKE_CUDA_ARCHITECTURES:STRING=90-real\\n' >"$dir/build/CMakeCache.txt"
cat >"$dir/build/bin/llama-server" <<'SH'
#!/bin/sh
case $1 in
  --list-devices) printf 'Available devices:\\n  CUDA0: NVIDIA H100 (81000 MiB, 80000 MiB free)\\n' ;;
  --version) echo 'version: 0.5.0-dev (build 1, commit abc)' ;;
esac
SH
chmod +x "$dir/build/bin/llama-server"
echo "$dir/build/bin/llama-server"
"""

FAKE_BENCH = """import sys
args = sys.argv[1:]
with open(__import__("os").environ["FAKE_LOG"], "a") as f:
    print("bench", *args, file=f)
load = args[args.index("--only") + 1]
walls = {"shared": (0.5, 3.0), "disjoint": (1.0, 0.9)}[load]
print("\\n16 clients, 32 greedy tokens each, streamed; median of 2 cold starts\\n")
for _ in range(2):
    for name, wall in zip(("kvfork", "llama-server"), walls):
        print(f"  {load:8} {name:15} wall {wall:6.2f} s  TTFT {wall / 2:6.2f} s  "
              f"warm {wall / 3:6.2f} s  (client CPU 0.04 s)", file=sys.stderr)
print("| workload | server | wall (s) | median TTFT (s) | same requests again, warm (s) |")
print("|---|---|---|---|---|")
for name, wall in zip(("kvfork", "llama-server"), walls):
    print(f"| {load} | {name} | {wall:.2f} | {wall / 2:.2f} | {wall / 3:.2f} |")
"""


def test_run_stage_serve_builds_then_runs_each_workload_once(tmp_path: Path) -> None:
    """Stage serve through run_stage.sh, with stand-ins for the build and bench_serve.py: the
    build starts detached while bundles are missing, the workloads wait for stage install
    and a call's time, then run once each; the summary weighs kvfork against the targets."""
    repo = tmp_path / "repo"
    shutil.copytree(
        SCRIPTS, repo / "scripts" / "gpu_check", ignore=shutil.ignore_patterns("__pycache__")
    )
    (repo / "scripts" / "build_llama_server.sh").write_text(FAKE_BUILD)
    (repo / "scripts" / "build_llama_server.sh").chmod(0o755)
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "bench_serve.py").write_text(FAKE_BENCH)
    src = tmp_path / "src"
    src.mkdir()
    model = src / "d.gguf"
    model.write_bytes(os.urandom(3 * MIB))
    (src / "server.tar.xz").write_bytes(b"source")
    inputs = [
        Input("server.tar.xz", "server-source", src / "server.tar.xz", splittable=False),
        Input("d.gguf", "model", model),
    ]
    meta = {"stages": ["serve"], "models": {"default": "d.gguf"}, "server_sdist": "sdist"}
    staged = tmp_path / "prepared"
    bundles.write_bundles(inputs, staged, 2 * MIB, meta)
    work = tmp_path / "work"
    fake_log = tmp_path / "calls.log"
    env = {
        **outside_a_gpu_call(),
        "KVFORK_GPU_WORK": str(work),
        "KVFORK_GPU_PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "FAKE_LOG": str(fake_log),
        "FAKE_GO": str(tmp_path / "go"),
    }

    def call(stage: str, *carry: str, budget: int = 540) -> tuple[int, str]:
        shutil.rmtree(repo / ".gpu-check", ignore_errors=True)
        for name in carry:
            shutil.copytree(staged / name, repo / ".gpu-check" / name)
        proc = subprocess.run(
            ["bash", str(repo / "scripts" / "gpu_check" / "run_stage.sh"), stage],
            env={**env, "KVFORK_GPU_BUDGET_S": str(budget)},
            capture_output=True,
            text=True,
        )
        return proc.returncode, (tmp_path / "out" / "summary.md").read_text()

    rc, text = call("next", "bundle-01")  # the model's second half is still to come
    assert rc == 4 and "verdict: waiting" in text
    assert "llama-server: building in the background" in text
    (tmp_path / "go").touch()  # the build may finish
    rc, text = call("next", "bundle-02")
    assert rc == 4 and "waiting: stage install" in text  # the build is done meanwhile
    assert "CUDA0: NVIDIA H100" in text and "archs 90-real" in text
    build_calls = [line for line in fake_log.read_text().splitlines() if "--cuda" in line]
    assert len(build_calls) == 1 and "--source" in build_calls[0]
    (work / "install").mkdir()
    (work / "install" / "DONE").write_text("installed\n")
    rc, text = call("serve", budget=100)  # under the 150 s a workload must have left
    assert rc == 3 and "not finished" in text and "shared: not run yet" in text
    rc, text = call("serve")
    assert rc == 0 and "verdict: done" in text
    assert (
        "- shared: kvfork 6.00x llama-server's throughput (cold, 0.50 s against 3.00 s; "
        "rounds 6.00, 6.00), target >= 4x: met" in text
    )
    assert "- disjoint: kvfork 0.90x" in text and "target >= 1x: NOT met" in text
    assert "median of 2 cold starts\n\n| workload | server |" in text
    assert "| shared | llama-server | 3.00 | 1.50 | 1.00 |\n| disjoint | kvfork |" in text
    # The stand-in prints what bench_serve.py prints, which gpu_check/serve.py reads.
    real = (ROOT / "benchmarks" / "bench_serve.py").read_text()
    assert 'wall {wall:6.2f} s  TTFT {ttft:6.2f} s  "' in real
    assert 'f"warm {warm:6.2f} s  (client CPU {cpu:4.2f} s)"' in real
    assert 'print(f"| {load} | {name} | {med[0]:.2f} | {med[1]:.2f} | {med[2]:.2f} |")' in real
    benches = [line for line in fake_log.read_text().splitlines() if line.startswith("bench")]
    assert len(benches) == 2 and all("--gpu-layers 99 --client raw" in b for b in benches)
    assert all("--example-server  --gpu" in b for b in benches)  # none: '' passed
    rc, text = call("serve")  # done: nothing runs again
    assert rc == 0 and len(fake_log.read_text().splitlines()) == 3


def test_the_bench_report_shows_both_bench_store_tables(tmp_path: Path) -> None:
    """The bench stage's summary carries bench_store.py's throughput table and its
    device-sampling table (issue 42's item 3) for each model, as printed."""
    (tmp_path / "bench_store-default.txt").write_text("| N | step greedy |\n| 1 | 874 |\n")
    (tmp_path / "device-default.txt").write_text("| N | greedy, host rows tok/s |\n| 1 | 880 |\n")
    (tmp_path / "device-chat.txt").write_text("| N | greedy, host rows tok/s |\n| 8 | 4047 |\n")
    text = gpu_bench.report(tmp_path)
    assert "### benchmarks/bench_store.py --only throughput (default)\n| N | step greedy |" in text
    assert "--only device (device_sampling=True against host rows) (chat)\n" in text
    assert "| 1 | 880 |" in text and "| 8 | 4047 |" in text
    assert text.index("(chat)") < text.index("| 8 | 4047 |")


def test_the_kvfork_table_sets_device_sampling_beside_the_bare_backend_loop(
    tmp_path: Path,
) -> None:
    """Issue 42's item 3 target, in one table: `store.step` with `device_sampling=True`
    against the bare loop with llama.cpp's backend sampling, N by N (`-` where a number is
    missing)."""
    result = {
        "label": "default",
        "model": "m.gguf",
        "steps": 64,
        "checks": {"backend": "OK cuda"},
        "store_step": {"8": 3933.0, "64": 7623.0},
        "store_step_device": {"8": 4200.0},
        "store_step_device_k1": {"8": 4400.0},
        "outside_ms": {"8": 0.2345},
        "split_ms": {
            "store_step": {"8": [1.8, 0.2, 0.034], "64": [7.5, 0.5, 0.1]},
            "store_step_device_k1": {"8": [1.7, 0.05, 0.03]},
        },
    }
    (tmp_path / "kvfork-default.json").write_text(json.dumps(result))
    (tmp_path / "bare-default-host.txt").write_text("bare N=8 tok/s=2409.0 step_ms=3.3\n")
    (tmp_path / "bare-default-gpu.txt").write_text(
        "bare-gpusample N=8 tok/s=4047.0 step_ms=2.0\nbare-gpusample N=64 tok/s=9043.0\n"
    )
    text = gpu_bench.report(tmp_path)
    assert "| kvfork, device_sampling |" in text and "| device_sampling / bare backend |" in text
    assert "| device_sampling, K=1 |" in text and "| K=1 / bare backend |" in text
    assert "| kvfork / bare backend (target >= 1.0) |" in text
    assert (
        "| 8 | 3,933 | 4,200 | 4,400 | 2,409 | 4,047 | 0.97 | 1.63 | 1.04 | 1.09 | 0.234 |" in text
    )
    assert "| 64 | 7,623 | - | - | - | 9,043 | 0.84 | - | - | - | - |" in text
    # Where a step's time goes, for the modes that ran.
    assert "| N | host rows | device_sampling, K=1 |" in text
    assert "| 8 | 1.800 + 0.200 + 0.034 | 1.700 + 0.050 + 0.030 |" in text
    assert "| 64 | 7.500 + 0.500 + 0.100 | - |" in text
    assert "Replies before the rows land" not in text  # a run before the landing


def test_the_kvfork_table_sets_replies_before_the_landing_beside_after(tmp_path: Path) -> None:
    """The landing's A/B (engine/landing.rs): host rows and K=1 with the reply before the
    rows are read against `KVFORK_LAND_BEFORE_REPLY`, N by N, with their ratios."""
    result = {
        "label": "chat",
        "model": "m.gguf",
        "steps": 64,
        "checks": {},
        "store_step": {"1": 900.0, "8": 4000.0},
        "store_step_land_first": {"1": 800.0, "8": 4000.0},
        "store_step_device_k1": {"1": 950.0},
        "store_step_device_k1_land_first": {"1": 850.0},
    }
    (tmp_path / "kvfork-chat.json").write_text(json.dumps(result))
    text = gpu_bench.report(tmp_path)
    assert "| N | host rows | landing first | ratio | K=1 | K=1, landing first | ratio |" in text
    assert "| 1 | 900 | 800 | 1.12 | 950 | 850 | 1.12 |" in text
    assert "| 8 | 4,000 | 4,000 | 1.00 | - | - | - |" in text


def test_the_throughput_runs_host_rows_and_device_sampling() -> None:
    """`gpu_bench`'s throughput on the CPU backend (what runs on the GPU with every layer
    offloaded): host rows, device sampling, and device sampling of one candidate, each N."""
    result: dict[str, Any] = {"store_step": {}, "store_step_device": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kvfork.KvforkWarning)  # no GPU here: the CPU runs it
        gpu_bench._throughput(str(kvfork.default_chat_model_path()), [2], 2, result)
    modes = (
        "store_step",
        "store_step_device",
        "store_step_device_k1",
        "store_step_land_first",
        "store_step_device_k1_land_first",
    )
    assert all(set(result[m]) == {"2"} and result[m]["2"] > 0 for m in modes)
    # Set only while a context opened.
    assert "KVFORK_DEVICE_CANDIDATES" not in os.environ
    assert "KVFORK_LAND_BEFORE_REPLY" not in os.environ
    assert 0 < result["outside_ms"]["2"] < 1000 / result["store_step"]["2"] * 2
    for mode in modes:  # decode, the engine's own, the rest: each measured, none negative
        decode, engine, caller = result["split_ms"][mode]["2"]
        assert decode > 0 and engine > 0 and caller > 0, result["split_ms"]
        assert decode + engine + caller == pytest.approx(1000 * 2 / result[mode]["2"])
    assert result["team_threads"]["2"] >= 1
    assert result["generate"] > 0


def test_the_noise_measure_stays_within_the_suites_constants_here() -> None:
    """gpu_check.noise, which a GPU run uses to check the GPU constants, on this backend: its
    table, and every measure within the constants the suite uses here."""
    from .conftest import LOGIT_NOISE, LOGPROB_NOISE, MIN_CORRELATION

    text = noise.measure(kvfork.default_model_path(), steps=3, n_forks=3, gpu_layers=None)
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| measure") and len(rows) == 3, text
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        pairs, max_diff, _, _, top_logprob, corr = cells[1:]
        assert int(pairs) > 0
        assert float(max_diff) <= LOGIT_NOISE and float(top_logprob) <= LOGPROB_NOISE, row
        assert float(corr) > MIN_CORRELATION, row


def test_the_files_named_first_open_the_plan(tmp_path: Path) -> None:
    """KVFORK_GPU_TEST_FIRST: last run's failing files go first, before a short call's deadline;
    every file still runs once, and a name that is not a test file of the suite is refused."""
    (tmp_path / "tests" / "sub").mkdir(parents=True)
    for name in ("test_a.py", "test_b.py", "test_c.py", "sub/test_d.py"):
        (tmp_path / "tests" / name).write_text("")
    assert chunks.test_files(tmp_path, ["tests/test_c.py", "tests/sub/test_d.py"]) == [
        "tests/test_c.py",
        "tests/sub/test_d.py",
        "tests/test_a.py",
        "tests/test_b.py",
    ]
    assert chunks.load_plan(tmp_path / "work", tmp_path, 3, ["tests/test_b.py"]) == [
        ["tests/test_b.py", "tests/sub/test_d.py", "tests/test_a.py"],
        ["tests/test_c.py"],
    ]
    with pytest.raises(ValueError, match="test_x.py"):
        chunks.test_files(tmp_path, ["tests/test_x.py"])


@pytest.mark.parametrize(("bench_first", "order"), [("0", "test bench"), ("1", "bench test")])
def test_next_runs_the_benchmarks_first_when_asked(
    tmp_path: Path, bench_first: str, order: str
) -> None:
    """`run_stage.sh next` runs the planned stages in order, the suite before the benchmarks
    unless KVFORK_GPU_BENCH_FIRST=1 (a session short of device time wants the numbers
    first); stand-ins for the stages record the order."""
    repo = tmp_path / "repo"
    shutil.copytree(
        SCRIPTS, repo / "scripts" / "gpu_check", ignore=shutil.ignore_patterns("__pycache__")
    )
    for stage in ("build", "install", "test", "bench"):
        script = repo / "scripts" / "gpu_check" / f"stage_{stage}.sh"
        script.write_text(f'#!/usr/bin/env bash\necho {stage} >>"$FAKE_LOG"\n')
        script.chmod(0o755)
    model = tmp_path / "d.gguf"
    model.write_bytes(os.urandom(MIB))
    meta = {"stages": ["build", "install", "test", "bench"], "models": {"default": "d.gguf"}}
    bundles.write_bundles([Input("d.gguf", "model", model)], repo / ".gpu-check", 2 * MIB, meta)
    fake_log = tmp_path / "calls.log"
    env = {
        **outside_a_gpu_call(),
        "KVFORK_GPU_WORK": str(tmp_path / "work"),
        "KVFORK_GPU_PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"),
        "FAKE_LOG": str(fake_log),
        "KVFORK_GPU_BENCH_FIRST": bench_first,
    }
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_check" / "run_stage.sh"), "next"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert fake_log.read_text().split() == ["build", "install", *order.split()]
