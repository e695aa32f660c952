"""One small error hierarchy, so callers (the CLI, components) can tell user mistakes from bugs."""


class EvoESAPError(Exception):
    """Base of every error this package raises on purpose."""


class ConfigError(EvoESAPError, ValueError):
    """A parameter or configuration value is invalid."""


class DataError(EvoESAPError, ValueError):
    """Input data cannot be used as given."""


class ModelError(EvoESAPError):
    """The model is unsupported or a requested change to it is impossible."""


class ArtifactError(EvoESAPError):
    """An artifact is missing, unfinished, inconsistent or outside its root."""


class ResourceError(EvoESAPError):
    """A stage would need more memory or disk than the machine has (predicted before any work)."""
