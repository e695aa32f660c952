"""Progress bars that switch off when stderr is not a terminal or the user asked for quiet output."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm.auto import tqdm

_quiet = False


def is_quiet() -> bool:
    """Whether progress bars (and the CLI's chatter) are off: `--quiet`, passed on to worker processes."""
    return _quiet


def set_quiet(quiet: bool) -> None:
    """Quiet our bars and those of the libraries we call (transformers' loading and saving, the hub's)."""
    global _quiet
    _quiet = quiet
    if quiet:
        import huggingface_hub.utils
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        huggingface_hub.utils.disable_progress_bars()


def progress(iterable: Iterable[Any] | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar, disabled under --quiet or when nobody is watching."""
    kwargs.setdefault("disable", _quiet or not sys.stderr.isatty())
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(iterable, **kwargs)
