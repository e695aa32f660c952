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


class ReleaseError(EvoESAPError):
    """A release could not be handed on: a model registry cannot be reached, or refused the request."""


class ResourceError(EvoESAPError):
    """A stage would need more memory or disk than the machine has (predicted before any work)."""


class WorkerLost(EvoESAPError):
    """A collective of a multi-worker search failed: another worker of the group ended or stopped answering."""


class Interrupted(EvoESAPError):
    """A signal stopped the run before it finished; the command exits 128 + its number, as a shell reports it."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum
