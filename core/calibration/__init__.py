"""Fitting a performance profile from measured runs: the pure fits behind `sibyl-console calibrate`."""
