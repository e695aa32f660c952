"""KFP components: one thin lightweight Python component per stage, each a call into `evoesap.steps`.

The compiled single-stage components (`<stage>.yaml` beside this file) are made by
`evoesap pipeline components` (`make components`) and checked by a test to be up to date.
"""

from evoesap.components.stages import (
    DEFAULT_IMAGE,
    DEFAULT_REGISTRY,
    StageComponents,
    make_components,
    qualified,
    stage_image,
    write_component_yamls,
)

__all__ = [
    "DEFAULT_IMAGE",
    "DEFAULT_REGISTRY",
    "StageComponents",
    "make_components",
    "qualified",
    "stage_image",
    "write_component_yamls",
]
