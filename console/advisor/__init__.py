"""The what-if advisor and policy canaries: window of recorded arrivals, re-simulation, worker process, arm split."""
