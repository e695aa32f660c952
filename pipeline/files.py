"""Files the pipeline commands write for the user (a compiled spec, a log): never over a file they did not make."""

from __future__ import annotations

import os
from pathlib import Path

from evoesap.errors import ConfigError

LOG_HEADER = "# evoesap pipeline log\n"  # the first line of every log we start; we append only to such a file
SPEC_MARKER = "# PIPELINE DEFINITION\n"  # the first line of every pipeline spec kfp's compiler writes


def claim_output_file(path: Path, option: str, marker: str, inputs: tuple[Path, ...] = ()) -> Path:
    """`path`, checked before any work: not a directory, not one of `inputs`, and either new or a file this
    command made before (it starts with `marker`). A user's file is never overwritten or appended to."""
    where = f"{option} {path}"
    blocking = next((p for p in path.absolute().parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise ConfigError(f"{where} lies under {blocking}, which is a file, not a directory: choose another path")
    if path.is_dir():
        raise ConfigError(f"{where} is a directory: give a file path (for example {path / 'pipeline.yaml'})")
    for source in inputs:
        if path.exists() and source.exists() and os.path.samefile(path, source):
            raise ConfigError(f"{where} is the input {source}: writing there would destroy it; choose another file")
    if path.exists():
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                head = f.read(len(marker))
        except OSError as exc:
            raise ConfigError(f"{where} cannot be read ({exc.strerror}): choose another file") from None
        if head != marker:
            raise ConfigError(
                f"{where} is an existing file that this command did not write: choose a new file (or delete it); "
                "nothing was changed"
            )
    return path


def claim_output_dir(path: Path, option: str) -> Path:
    """`path` as a directory to write into, checked before any work: not a file, not under a file."""
    for place in (path, *path.parents):
        if place.exists() and not place.is_dir():
            what = "is a file" if place == path else f"goes through the file {place}"
            raise ConfigError(f"{option} {path} {what}: give a directory")
    return path
