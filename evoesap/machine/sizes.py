"""Sizes as people write them in settings and on the command line ('80GB', '64Gi'), read once for everyone."""

from __future__ import annotations

import re

from evoesap.errors import ConfigError


def parse_bytes(text: str | int) -> int:
    """'80GB', '64Gi', '512M' or 300000 -> bytes (decimal and binary suffixes, as Kubernetes writes them)."""
    units = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?)?B?\s*", str(text).upper())
    if match is None:
        raise ConfigError(f"{text!r} is not a size: write e.g. 80GB, 64Gi or 512M")
    return int(float(match.group(1)) * units[match.group(2) or ""])
