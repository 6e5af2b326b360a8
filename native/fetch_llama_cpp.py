#!/usr/bin/env python3
"""Obtain the pinned llama.cpp, patch it, and lay it out for the build.

The source is the llama.cpp tree vendored in the llama-cpp-python sdist (fetched with pip, checked by
sha256, cached outside the repository). The pristine tree is unpacked once; the patched tree is updated
file by file, and a file is rewritten only when its content changes, so an edit to one patch recompiles
only what that patch touches.

Exit status is non-zero with a message naming the file and the reason on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python"
VENDOR_PREFIX = "vendor/llama.cpp/"


class FetchError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_cache() -> Path:
    env = os.environ.get("OTT_GGUF_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ott-gguf"


def fetch_sdist(version: str, sha256: str, cache: Path) -> Path:
    """Return the cached sdist, downloading it with pip if needed; verify its sha256 either way."""
    name = f"llama_cpp_python-{version}.tar.gz"
    path = cache / "sdist" / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--no-build-isolation",
                "--disable-pip-version-check",
                "-d",
                tmp,
                f"{PACKAGE}=={version}",
            ]
            print("ott-gguf: fetching", " ".join(cmd[3:]), flush=True)
            # pip may fail while preparing metadata (no build deps in this environment) after the
            # download itself succeeded; the file on disk and its hash are what count.
            res = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / name
            if not got.exists():
                raise FetchError(
                    f"pip could not download {PACKAGE}=={version} (exit {res.returncode}):\n"
                    f"{res.stdout[-2000:]}{res.stderr[-2000:]}"
                )
            os.replace(got, path)
    actual = sha256_file(path)
    if actual != sha256:
        raise FetchError(
            f"{path}: sha256 is {actual}, the pin expects {sha256}. The cached or served sdist is not the "
            f"pinned {PACKAGE} {version}; delete the file to refetch, or update the pin (and the patches) on purpose."
        )
    return path


def unpack_pristine(sdist: Path, sha256: str, dest: Path) -> None:
    stamp = dest / ".ott-pristine"
    if stamp.exists() and stamp.read_text() == sha256:
        return
    if dest.exists():
        shutil.rmtree(dest)
    tmp = dest.with_name(dest.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        top = f"llama_cpp_python-{sdist.name.split('-')[1].removesuffix('.tar.gz')}/"
        prefix = top + VENDOR_PREFIX
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and (m.isfile() or m.isdir()):
                m.name = m.name[len(prefix) :]
                # the sdist keeps the submodule's .git pointer file; it would confuse git in the build tree
                if m.name and m.name.split("/")[0] != ".git":
                    members.append(m)
        if not members:
            raise FetchError(f"{sdist}: no {VENDOR_PREFIX} inside the sdist")
        tar.extractall(tmp, members=members, filter="data")
    (tmp / ".ott-pristine").write_text(sha256)
    os.replace(tmp, dest)


def patch_targets(patch: Path) -> list[str]:
    files = []
    for line in patch.read_text().splitlines():
        if line.startswith("+++ "):
            p = line[4:].split("\t")[0].strip()
            if p == "/dev/null":
                continue
            files.append(p[2:] if p.startswith("b/") else p)
    if not files:
        raise FetchError(f"{patch}: not a unified diff (no '+++ ' lines)")
    return files


def apply_patches(pristine: Path, work: Path, patches: list[Path]) -> None:
    """Make `work` equal pristine + patches, touching only files whose content changes."""
    manifest_path = work / ".ott-patched.json"
    if (
        not (work / ".ott-copied").exists()
        or (work / ".ott-copied").read_text() != (pristine / ".ott-pristine").read_text()
    ):
        if work.exists():
            shutil.rmtree(work)
        # new mtimes (shutil.copy, not copy2): objects built from an earlier tree must not look newer than these
        shutil.copytree(pristine, work, copy_function=shutil.copy)
        (work / ".ott-copied").write_text((pristine / ".ott-pristine").read_text())
    old = set(json.loads(manifest_path.read_text())) if manifest_path.exists() else set()

    touched: set[str] = set()
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for patch in patches:
            for rel in patch_targets(patch):
                if rel in touched:
                    continue
                touched.add(rel)
                src = pristine / rel
                if src.exists():
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, tmp / rel)
        for patch in patches:
            res = subprocess.run(
                [
                    "patch",
                    "-p1",
                    "--forward",
                    "--batch",
                    "--no-backup-if-mismatch",
                    "-r",
                    "-",
                    "-d",
                    str(tmp),
                    "-i",
                    str(patch),
                ],
                capture_output=True,
                text=True,
            )
            if res.returncode != 0:
                raise FetchError(
                    f"{patch}: does not apply to the pinned llama.cpp:\n{res.stdout}{res.stderr}"
                    "Rebase this patch on the pinned tree (see native/patches/README.md)."
                )
        for rel in sorted(touched):
            new = (tmp / rel).read_bytes()
            dst = work / rel
            if not dst.exists() or dst.read_bytes() != new:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(new)
    # files a previous run patched that no patch touches now go back to pristine, with a new mtime: the pristine
    # file's own (older than the objects built from the patched one) would leave those objects stale
    for rel in sorted(old - touched):
        src, dst = pristine / rel, work / rel
        if src.exists():
            if not dst.exists() or dst.read_bytes() != src.read_bytes():
                shutil.copyfile(src, dst)
        elif dst.exists():
            dst.unlink()
    manifest_path.write_text(json.dumps(sorted(touched)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--version", required=True)
    ap.add_argument("--sha256", required=True)
    ap.add_argument("--patches", type=Path, required=True, help="directory of *.patch files, applied in name order")
    ap.add_argument("--dest", type=Path, required=True, help="where the patched tree goes (build tree)")
    ap.add_argument("--cache", type=Path, default=None)
    args = ap.parse_args()
    try:
        cache = args.cache or default_cache()
        pristine = cache / f"llama.cpp-{args.sha256[:16]}"
        stamp = pristine / ".ott-pristine"
        # a tree unpacked (and so verified) before needs no sdist: rebuilds work offline, with the sdist deleted
        if not (stamp.exists() and stamp.read_text() == args.sha256):
            sdist = fetch_sdist(args.version, args.sha256, cache)
            unpack_pristine(sdist, args.sha256, pristine)
        patches = sorted(args.patches.glob("*.patch"))
        apply_patches(pristine, args.dest, patches)
    except FetchError as e:
        print(f"ott-gguf: error: {e}", file=sys.stderr)
        return 1
    print(f"ott-gguf: llama.cpp from {PACKAGE} {args.version} with {len(patches)} patch(es) at {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
