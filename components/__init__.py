"""KFP components: one thin lightweight Python component per stage, each a call into `evoesap.steps`."""

from evoesap.components.stages import DEFAULT_IMAGE, StageComponents, make_components

__all__ = ["DEFAULT_IMAGE", "StageComponents", "make_components"]
