"""Hypothesis settings and JSON-value strategies shared by the property-based tests of what parses untrusted input."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FAST = settings(max_examples=100, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


# -- JSON values ------------------------------------------------------------------------------


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)


json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
