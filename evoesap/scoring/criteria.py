"""The importance criteria by name: the one list that the scores, the search, the prune and the configuration read.

Kept apart from `importance` (which imports torch) so that a parameter class or the configuration names the
criteria without loading a model library."""

from typing import Literal, get_args

Criterion = Literal["frequency", "seer", "ean", "reap"]
CRITERIA: tuple[str, ...] = get_args(Criterion)
