"""Inputs cut into parts and grouped into bundles, one bundle per device call; reassembled there.

A device call ships the working tree plus the paths it carries, 64 MiB in all. `write_bundles`
(here, from prepare.py) cuts the inputs into parts at bundle boundaries, so that each bundle,
with the working tree, stays under that limit, and writes `bundle-NN/` folders holding the
parts and a copy of the manifest (each part's and each whole input's size and sha256; an
input sent xz-compressed also has its compressed form's).
`receive` (there) checks every part it finds, keeps it under the work folder, and reassembles
an input once all its parts have arrived, over as many calls as that takes, checking the
whole file's sha256 (decompressed first, if it travelled as xz) before it appears under
`inputs/`.

`export` is the way back: a file built there (the CUDA module) leaves through $OUT, at most
8 files of 16 MiB per call, so it goes out as parts with a manifest, over several calls if
needed; `assemble_export` (here) puts it together again for the next session's bundles.

usage (on the GPU machine, PYTHONPATH=scripts):
  python -m gpu_check.bundles receive --work DIR [--from .gpu-check]
  python -m gpu_check.bundles status --work DIR
  python -m gpu_check.bundles paths --work DIR KIND     (exit 4: not all arrived; 5: none planned)
  python -m gpu_check.bundles export --work DIR --file PATH --out OUT
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIB = 1 << 20
#: What one device call may ship: the working tree plus its carried paths.
CALL_LIMIT = 64 * MIB
#: Each part stays strictly under this (the device's limit, and a convenient file size).
PART_LIMIT = 64 * MIB
#: A bundle is never opened for a sliver smaller than this: the next bundle takes it whole.
MIN_PIECE = 1 * MIB
#: $OUT's limits: at most 8 files of 16 MiB, 64 MiB together. An export call sends the
#: export manifest, the summary and at most EXPORT_PARTS parts of EXPORT_PART bytes.
EXPORT_PART = 15 * MIB
EXPORT_PARTS = 4
MANIFEST = "manifest.json"
FORMAT = 1


@dataclass(frozen=True)
class Piece:
    """Bytes [offset, offset + size) of the input `name`."""

    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class Item:
    """An input to plan: its name, size, and whether it may be cut (else it travels whole)."""

    name: str
    size: int
    splittable: bool = True


def plan_pieces(items: Sequence[Item], capacity: int) -> list[list[Piece]]:
    """Bundles (lists of pieces) for `items`, in order, each at most `capacity` bytes.

    Whole items go into the first bundle with room for them; splittable ones fill the
    current bundle and run on into the next, cut at the boundary. A bundle never gets a
    piece under MIN_PIECE (unless the item's tail is that small): it is closed instead.
    """
    if capacity < 2 * MIN_PIECE:
        raise ValueError(f"capacity {capacity} bytes is too small to plan bundles")
    bundles: list[list[Piece]] = [[]]
    used = [0]
    for item in items:
        if not item.splittable:
            if item.size > capacity:
                raise ValueError(f"{item.name} ({item.size} bytes) does not fit one bundle")
            for i, u in enumerate(used):
                if u + item.size <= capacity:
                    bundles[i].append(Piece(item.name, 0, item.size))
                    used[i] += item.size
                    break
            else:
                bundles.append([Piece(item.name, 0, item.size)])
                used.append(item.size)
            continue
        offset = 0
        while True:
            remaining = item.size - offset
            free = capacity - used[-1]
            if free < min(MIN_PIECE, max(remaining, 1)):
                bundles.append([])
                used.append(0)
                free = capacity
            size = min(remaining, free, PART_LIMIT - 1)
            bundles[-1].append(Piece(item.name, offset, size))
            used[-1] += size
            offset += size
            if offset >= item.size:
                break
    return [b for b in bundles if b]


def sha256_file(path: Path, offset: int = 0, size: int | None = None) -> str:
    """sha256 of `size` bytes of `path` from `offset` (the rest of the file by default)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left is None or left > 0:
            chunk = f.read(MIB if left is None else min(MIB, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h.hexdigest()


def _copy_range(src: Path, offset: int, size: int, dest: Path) -> str:
    """Copies bytes [offset, offset + size) of `src` into `dest`; their sha256."""
    h = hashlib.sha256()
    with src.open("rb") as f, dest.open("wb") as out:
        f.seek(offset)
        left = size
        while left > 0:
            chunk = f.read(min(MIB, left))
            if not chunk:
                raise OSError(f"{src} ended {left} bytes early")
            h.update(chunk)
            out.write(chunk)
            left -= len(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Input:
    """A file to send: `name` is what it is called there (under `inputs/`), `kind` what it is
    (wheel, source, deps, model, module), `path` where it is here; `xz`, if given, its
    xz-compressed copy, which is what travels (decompressed there, then checked)."""

    name: str
    kind: str
    path: Path
    splittable: bool = True
    xz: Path | None = None

    @property
    def sent(self) -> Path:
        return self.xz or self.path


def write_bundles(
    inputs: Sequence[Input],
    out: Path,
    capacity: int,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Cuts `inputs` into parts under `out/bundle-NN/` (each folder at most `capacity`
    bytes, a manifest copy aside) and returns the manifest, also written to `out/`."""
    names = [i.name for i in inputs]
    if len(set(names)) != len(names):
        raise ValueError(f"input names repeat: {names}")
    by_name = {i.name: i for i in inputs}
    items = [Item(i.name, i.sent.stat().st_size, i.splittable) for i in inputs]
    plan = plan_pieces(items, capacity)
    artifacts: dict[str, dict[str, Any]] = {}
    for i in inputs:
        art: dict[str, Any] = {
            "name": i.name,
            "kind": i.kind,
            "size": i.path.stat().st_size,
            "sha256": sha256_file(i.path),
        }
        if i.xz is not None:
            art["xz"] = {"size": i.xz.stat().st_size, "sha256": sha256_file(i.xz)}
        artifacts[i.name] = {**art, "parts": []}
    for old in out.glob("bundle-*"):
        shutil.rmtree(old)
    bundles: list[dict[str, Any]] = []
    for index, pieces in enumerate(plan, start=1):
        folder = out / f"bundle-{index:02d}"
        folder.mkdir(parents=True)
        files = []
        for piece in pieces:
            parts = artifacts[piece.name]["parts"]
            file = f"{piece.name}.{len(parts) + 1:02d}"
            digest = _copy_range(by_name[piece.name].sent, piece.offset, piece.size, folder / file)
            parts.append(
                {
                    "file": file,
                    "offset": piece.offset,
                    "size": piece.size,
                    "sha256": digest,
                    "bundle": index,
                }
            )
            files.append(file)
        bundles.append(
            {
                "index": index,
                "dir": folder.name,
                "size": sum(p.size for p in pieces),
                "files": files,
            }
        )
    body = {"artifacts": list(artifacts.values()), "bundles": bundles}
    plan_id = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    manifest = {
        "format": FORMAT,
        "plan_id": plan_id,
        "capacity": capacity,
        **body,
        "meta": meta or {},
    }
    text = json.dumps(manifest, indent=1) + "\n"
    (out / MANIFEST).write_text(text)
    for b in bundles:
        (out / b["dir"] / MANIFEST).write_text(text)
    return manifest


def load_manifest(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: manifest format {data.get('format')}, expected {FORMAT}")
    return data


@dataclass
class Report:
    """What a `receive` did and where the inputs stand."""

    plan_id: str = ""
    received: list[str] = field(default_factory=list)
    assembled: list[str] = field(default_factory=list)
    complete: list[str] = field(default_factory=list)
    missing: dict[str, list[int]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    fresh: bool = False

    def markdown(self) -> str:
        lines = [f"inputs of plan `{self.plan_id or '-'}`"]
        if self.fresh:
            lines.append("- this work folder was empty: a fresh machine (or the first call)")
        if self.received:
            lines.append(f"- parts received this call: {', '.join(self.received)}")
        if self.assembled:
            lines.append(f"- reassembled and sha256-checked: {', '.join(self.assembled)}")
        lines.append(f"- complete: {', '.join(self.complete) or 'none'}")
        for name, need in sorted(self.missing.items()):
            carried = ", ".join(f"bundle-{b:02d}" for b in need)
            lines.append(f"- MISSING {name}: send {carried}")
        lines += [f"- ERROR {e}" for e in self.errors]
        return "\n".join(lines) + "\n"


def _work_manifest(work: Path) -> dict[str, Any] | None:
    path = work / MANIFEST
    return load_manifest(path) if path.is_file() else None


def standing(manifest: dict[str, Any], work: Path, report: Report) -> None:
    """Fills `report.complete` and `report.missing` (with the bundles still to send)."""
    inputs = work / "inputs"
    parts = work / "parts"
    report.plan_id = str(manifest["plan_id"])
    for art in manifest["artifacts"]:
        if (inputs / art["name"]).is_file():
            report.complete.append(art["name"])
            continue
        need = sorted({p["bundle"] for p in art["parts"] if not (parts / p["file"]).is_file()})
        report.missing[art["name"]] = need


def receive(bundle_dirs: Iterable[Path], work: Path) -> Report:
    """Takes in the parts found in `bundle_dirs`, reassembling each input whose parts are all
    there. Idempotent: parts already kept, and inputs already whole, are skipped."""
    report = Report()
    inputs = work / "inputs"
    parts = work / "parts"
    current = _work_manifest(work)
    report.fresh = current is None
    for folder in sorted(bundle_dirs):
        path = folder / MANIFEST
        if not path.is_file():
            report.errors.append(f"{folder}: no {MANIFEST}")
            continue
        manifest = load_manifest(path)
        if current is None:
            work.mkdir(parents=True, exist_ok=True)
            (work / MANIFEST).write_text(path.read_text())
            current = manifest
        if manifest["plan_id"] != current["plan_id"]:
            report.errors.append(
                f"{folder.name} is from plan {manifest['plan_id']}, this work folder holds plan "
                f"{current['plan_id']}: send bundles of one prepare run (or clear {work})"
            )
            continue
        parts.mkdir(parents=True, exist_ok=True)
        for art in manifest["artifacts"]:
            if (inputs / art["name"]).is_file():
                continue
            for part in art["parts"]:
                src = folder / part["file"]
                dest = parts / part["file"]
                if dest.is_file() or not src.is_file():
                    continue
                size = src.stat().st_size
                if size != part["size"] or sha256_file(src) != part["sha256"]:
                    report.errors.append(f"{src}: size or sha256 differs from the manifest")
                    continue
                tmp = dest.with_name(dest.name + ".tmp")
                shutil.copyfile(src, tmp)
                tmp.replace(dest)
                report.received.append(part["file"])
    if current is None:
        report.errors.append("no bundle has arrived yet (carry .gpu-check/bundle-NN)")
        return report
    for art in current["artifacts"]:
        target = inputs / art["name"]
        if target.is_file():
            continue
        files = [parts / p["file"] for p in art["parts"]]
        if not all(f.is_file() for f in files):
            continue
        inputs.mkdir(parents=True, exist_ok=True)
        sent = art.get("xz") or art
        joined = target.with_name(target.name + (".xz" if "xz" in art else "") + ".partial")
        with joined.open("wb") as out:
            for f in files:
                with f.open("rb") as src_f:
                    shutil.copyfileobj(src_f, out, MIB)
        if joined.stat().st_size != sent["size"] or sha256_file(joined) != sent["sha256"]:
            joined.unlink()
            report.errors.append(f"{art['name']}: the reassembled file's sha256 is wrong")
            continue
        tmp = target.with_name(target.name + ".partial")
        if "xz" in art:
            with lzma.open(joined) as src_x, tmp.open("wb") as out:
                shutil.copyfileobj(src_x, out, 4 * MIB)
            joined.unlink()
            if tmp.stat().st_size != art["size"] or sha256_file(tmp) != art["sha256"]:
                tmp.unlink()
                report.errors.append(f"{art['name']}: the decompressed file's sha256 is wrong")
                continue
        tmp.replace(target)
        for f in files:
            f.unlink()
        report.assembled.append(art["name"])
    standing(current, work, report)
    return report


def paths_of_kind(work: Path, kind: str) -> tuple[list[Path], int]:
    """The inputs of `kind` and a status: 0 all arrived, 4 some missing, 5 none planned."""
    manifest = _work_manifest(work)
    if manifest is None:
        return [], 4
    arts = [a for a in manifest["artifacts"] if a["kind"] == kind]
    if not arts:
        return [], 5
    found = [work / "inputs" / a["name"] for a in arts]
    return found, 0 if all(p.is_file() for p in found) else 4


def export(work: Path, file: Path, out: Path, meta: dict[str, Any] | None = None) -> bool:
    """Writes the next parts of `file` (at most EXPORT_PARTS of EXPORT_PART bytes) and the
    export manifest into `out`; True once every part has gone out. State: work/exports/."""
    state_dir = work / "exports"
    state_dir.mkdir(parents=True, exist_ok=True)
    state_path = state_dir / f"{file.name}.json"
    size = file.stat().st_size
    digest = sha256_file(file)
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("sha256") != digest:
        count = max(1, -(-size // EXPORT_PART))
        state = {
            "format": FORMAT,
            "name": file.name,
            "size": size,
            "sha256": digest,
            "parts": [
                {
                    "file": f"{file.name}.{i + 1:02d}",
                    "offset": i * EXPORT_PART,
                    "size": min(EXPORT_PART, size - i * EXPORT_PART),
                    "sha256": "",
                    "sent": False,
                }
                for i in range(count)
            ],
            "meta": meta or {},
        }
    out.mkdir(parents=True, exist_ok=True)
    sent_now = 0
    for part in state["parts"]:
        if part["sent"] or sent_now == EXPORT_PARTS:
            continue
        part["sha256"] = _copy_range(file, part["offset"], part["size"], out / part["file"])
        part["sent"] = True
        sent_now += 1
    state_path.write_text(json.dumps(state, indent=1))
    public = {
        **state,
        "parts": [{k: v for k, v in p.items() if k != "sent"} for p in state["parts"]],
    }
    for part in public["parts"]:
        if not part["sha256"]:
            part["sha256"] = sha256_file(file, part["offset"], part["size"])
    (out / f"{file.name}.export.json").write_text(json.dumps(public, indent=1) + "\n")
    return all(p["sent"] for p in state["parts"])


def assemble_export(folders: Sequence[Path], dest: Path) -> dict[str, Any]:
    """Puts an exported file together from the folders its calls returned; checks every part's
    and the whole file's sha256. Returns the export manifest (its `meta` says how it was made)."""
    manifests = [p for f in folders for p in sorted(f.glob("*.export.json"))]
    if not manifests:
        raise FileNotFoundError(f"no *.export.json in {', '.join(map(str, folders))}")
    manifest: dict[str, Any] = json.loads(manifests[-1].read_text())
    found: dict[str, Path] = {}
    for folder in folders:
        for part in manifest["parts"]:
            if (folder / part["file"]).is_file():
                found[part["file"]] = folder / part["file"]
    missing = [p["file"] for p in manifest["parts"] if p["file"] not in found]
    if missing:
        raise FileNotFoundError(f"parts not returned yet: {', '.join(missing)} (run export again)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    with tmp.open("wb") as out:
        for part in manifest["parts"]:
            src = found[part["file"]]
            if sha256_file(src) != part["sha256"]:
                raise ValueError(f"{src}: sha256 differs from the export manifest")
            with src.open("rb") as f:
                shutil.copyfileobj(f, out, MIB)
    if sha256_file(tmp) != manifest["sha256"]:
        tmp.unlink()
        raise ValueError(f"{manifest['name']}: the reassembled file's sha256 is wrong")
    tmp.replace(dest)
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("receive")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--from", dest="source", type=Path, default=Path(".gpu-check"))
    p = sub.add_parser("status")
    p.add_argument("--work", type=Path, required=True)
    p = sub.add_parser("paths")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("kind")
    p = sub.add_parser("export")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--file", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--meta", default="{}", help="JSON object recorded in the export manifest")
    args = parser.parse_args(argv)
    if args.cmd == "receive":
        report = receive(sorted(args.source.glob("bundle-*")), args.work)
        print(report.markdown(), end="")
        return 1 if report.errors else 0
    if args.cmd == "status":
        manifest = _work_manifest(args.work)
        report = Report(fresh=manifest is None)
        if manifest is not None:
            standing(manifest, args.work, report)
        print(report.markdown(), end="")
        return 0
    if args.cmd == "paths":
        found, status = paths_of_kind(args.work, args.kind)
        for path in found:
            print(path)
        return status
    done = export(args.work, args.file, args.out, json.loads(args.meta))
    print(f"export {args.file.name}: {'all parts out' if done else 'more parts remain'}")
    return 0 if done else 3


if __name__ == "__main__":
    sys.exit(main())
