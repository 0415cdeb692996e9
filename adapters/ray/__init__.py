"""The `ray` backend (`backend`, registered with adapters/backends/ by name), the actor behind each instance
and the cluster plumbing (Ray is imported lazily)."""
