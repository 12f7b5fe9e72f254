"""The manifest of the shipped trained checkpoint: how it was made and the sha256 of each file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder` except the manifest itself."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def write_manifest(folder: Path, training: dict[str, Any]) -> Path:
    config = json.loads((folder / "config.json").read_text())
    manifest = {"training": training, "config": config, "sha256": file_digests(folder)}
    path = folder / MANIFEST
    path.write_text(json.dumps(manifest, indent=2) + "\n")
    return path


def read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST).read_text())


def mismatched_files(folder: Path) -> list[str]:
    """Files whose sha256 differs from the manifest's, or that are missing or not listed."""
    listed, actual = read_manifest(folder)["sha256"], file_digests(folder)
    return sorted(name for name in set(listed) | set(actual)
                  if listed.get(name) != actual.get(name))
