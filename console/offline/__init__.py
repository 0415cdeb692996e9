"""Offline work: simulate, sweep, replay (a client of any OpenAI endpoint), analysis, benchmarks, calibration."""
