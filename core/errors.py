"""The project's error root and the core-level error types."""


class SibylError(Exception):
    """Root of every error sibyl-console raises on purpose; the CLI prints it as one line."""


class ConfigError(SibylError):
    """A user-supplied configuration, parameter or name is invalid."""


class PolicyError(ConfigError):
    """An unknown policy name or an invalid policy parameter."""


class TraceError(SibylError):
    """A trace file is unreadable or has a malformed row (the message names file, line and field)."""


class ProfileError(ConfigError):
    """A performance profile is unknown or its file is invalid."""


class NoCapacityError(SibylError):
    """No healthy instance of a needed role is available (the gateway answers 503)."""
