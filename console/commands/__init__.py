"""One module per CLI noun; each exposes `register(app)` to add its commands to the root app."""
