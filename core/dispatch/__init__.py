"""One dispatcher, three worlds: told the time and the events, it answers decisions (see dispatcher.py)."""

from core.dispatch.base import AssignmentScore, PolicySetting
from core.dispatch.dispatcher import Dispatcher

__all__ = ["AssignmentScore", "Dispatcher", "PolicySetting"]
