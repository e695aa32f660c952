"""EvoESAP: non-uniform expert pruning for sparse MoE language models.

The repository's top-level components/ and pipeline/ folders install as `evoesap.components` and
`evoesap.pipeline` (pyproject's package-dir): in a wheel, and in a checkout through its editable
install (`make install`), so each module has exactly one name.
"""

__version__ = "0.1.0"
