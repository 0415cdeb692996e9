"""The console layer's error root: what a running console, its CLI or its control API refuses."""

from core.errors import SibylError


class ConsoleError(SibylError):
    """A request to the console (or to find one) that cannot be carried out; the message says why."""
