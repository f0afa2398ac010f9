"""scripts/gpu_check, the GPU check's machinery, on this machine (no GPU): bundles planned
under the device's 64 MiB a call, inputs cut and put together again over several calls with
their sha256 checked, the CMake settings of the CUDA build against llama-cpp-sys-2's build.rs
and the release workflow, the wheel check, the test suite's resumable chunks, and the GPU
machine's entry script (receive and status) end to end on small inputs."""

from __future__ import annotations

import json
import lzma
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check.bundles as bundles  # noqa: E402
import gpu_check.chunks as chunks  # noqa: E402
import gpu_check.cmake_flags as cmake_flags  # noqa: E402
import gpu_check.prepare as prepare  # noqa: E402
from gpu_check.bundles import MIB, Input, Item  # noqa: E402

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


def test_run_stage_receives_over_calls_and_says_what_is_missing(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(
        SCRIPTS, repo / "scripts" / "gpu_check", ignore=shutil.ignore_patterns("__pycache__")
    )
    inputs = make_inputs(tmp_path)
    staged = tmp_path / "prepared"
    bundles.write_bundles(inputs, staged, 2 * MIB, {"stages": ["install"]})
    env = {
        **os.environ,
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
