"""Per-file checksums of an iteration dir: written at save, verified at load.

DCP stores tensors as raw bytes with no checksum, so a flipped bit in a
`.distcp` file loads silently and trains on. Each save writes
`checksums.json` into the iteration dir, last (after meta.json):

    {"algorithm": "xxh3_64", "files": {"__0_0.distcp": {"bytes": 1234, "xxh3_64": "9f0c..."}, ...}}

covering every other file of the dir. xxh3 hashes at memory speed (several
GB/s per core), so hashing costs a fraction of writing the same bytes; the
files are hashed right after they are written, from the page cache. Ranks
split the files between them (`files_for_rank`) at save and at load.

A dir without the manifest (written before checksums existed) loads
unverified with a warning.
"""
from __future__ import annotations

import json
import os
from typing import Optional

import xxhash

from .tracker import CheckpointError, write_file_atomic

MANIFEST = "checksums.json"
ALGORITHM = "xxh3_64"
_CHUNK = 8 << 20


def file_digest(path: str) -> str:
    """Hex xxh3_64 of a file's bytes, read in 8 MiB chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def checksummed_files(it_dir: str) -> list[str]:
    """Names of the files a manifest covers: every regular file but the manifest, sorted."""
    return sorted(n for n in os.listdir(it_dir) if n != MANIFEST and os.path.isfile(os.path.join(it_dir, n)))


def files_for_rank(names: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's share of `names` (round robin) for hashing or verifying."""
    return names[rank::world_size]


def checksum_files(it_dir: str, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, "xxh3_64": hex}} for files of `it_dir`."""
    out = {}
    for name in names:
        path = os.path.join(it_dir, name)
        out[name] = {"bytes": os.path.getsize(path), ALGORITHM: file_digest(path)}
    return out


def write_manifest(it_dir: str, entries: Optional[dict[str, dict]] = None) -> None:
    """Write the manifest of `it_dir` (atomically); `entries` default: checksum every file now."""
    if entries is None:
        entries = checksum_files(it_dir, checksummed_files(it_dir))
    body = {"algorithm": ALGORITHM, "files": dict(sorted(entries.items()))}
    write_file_atomic(os.path.join(it_dir, MANIFEST), json.dumps(body, indent=1).encode())


def read_manifest(it_dir: str) -> Optional[dict[str, dict]]:
    """The manifest's file entries, or None when the dir has no manifest."""
    path = os.path.join(it_dir, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            body = json.load(f)
        files = body["files"]
        if body.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {body.get('algorithm')!r}, expected {ALGORITHM!r}")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"checksum manifest {path} is unreadable ({type(exc).__name__}: {exc}); "
                              "restore it, or load with --no-verify-checkpoint to skip verification") from None
    return files


def verify_files(it_dir: str, manifest: dict[str, dict], names: list[str]) -> None:
    """Check files of `it_dir` against the manifest; raises CheckpointError naming the first bad one."""
    fix = ("the checkpoint is damaged: restore it from a copy or resume from an earlier iteration "
           "(or load with --no-verify-checkpoint to skip this check)")
    for name in names:
        path = os.path.join(it_dir, name)
        want = manifest[name]
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing ({want['bytes']} bytes expected); {fix}")
        size = os.path.getsize(path)
        if size != want["bytes"]:
            raise CheckpointError(f"{path} has {size} bytes, {want['bytes']} were written (truncated or "
                                  f"overwritten); {fix}")
        got = file_digest(path)
        if got != want[ALGORITHM]:
            raise CheckpointError(f"{path} fails its checksum ({ALGORITHM} {got}, written as "
                                  f"{want[ALGORITHM]}); {fix}")
