"""Ray support for the `ray` backend: the actor behind each instance and the cluster plumbing
(Ray is imported lazily)."""
