"""The pure domain of sibyl-console: types, performance models, estimators, dispatcher, policies,
SLOs, traces, simulator."""
