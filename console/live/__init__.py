"""The running console: its controller and collaborators, the live request, the typed state."""
