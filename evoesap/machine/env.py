"""Switches set in the environment (`EVOESAP_COPY_MODELS=1`), read one way: the words people write for on and off,
anything else refused in one line rather than taken for either."""

from __future__ import annotations

import os

from evoesap.errors import ConfigError

ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")  # "": set but empty, as unset


def flag(variable: str, default: bool = False) -> bool:
    """The switch `variable`: on for 1/true/yes/on, off for 0/false/no/off or empty (any case, spaces ignored),
    `default` when unset; a ConfigError naming the variable and its value otherwise."""
    value = os.environ.get(variable)
    if value is None:
        return default
    word = value.strip().lower()
    if word in ON or word in OFF:
        return word in ON
    raise ConfigError(
        f"{variable}={value!r} is neither on nor off: set it to one of {', '.join(ON)} (on) or "
        f"{', '.join(w for w in OFF if w)} (off), or leave it empty or unset"
    )
