"""Benchmarks and paper reproductions, each run from the repository root as
`python -m benchmarks.NAME [--help]` (see benchmarks/README.md for what each measures)."""
