"""The adapters layer's error root: every failure talking to the outside world is one of these."""

from core.errors import SibylError


class AdapterError(SibylError):
    """Instances, processes, HTTP upstreams or the run store could not do what was asked."""


class BackendError(AdapterError):
    """Instances could not be started, reached, added, removed or flipped."""


class CapabilityError(BackendError):
    """The backend does not declare the capability an operation needs (it says which it has)."""
