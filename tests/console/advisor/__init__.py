"""Tests of console/advisor/: the window, the re-simulation, the worker process and the canaries."""
