"""EvoESAP: non-uniform expert pruning for sparse MoE language models."""

from pathlib import Path as _Path

__version__ = "0.1.0"

# The repository's top-level components/ and pipeline/ folders install as evoesap.components and
# evoesap.pipeline (pyproject's package-dir). Run from a source checkout (PYTHONPATH or an editable
# install), the same names resolve to those folders of this checkout, never to another copy.
_CHECKOUT = _Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "pipeline" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 (a package's own __path__)
