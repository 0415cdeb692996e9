"""Unit tests of console/live/: each collaborator against fakes."""
