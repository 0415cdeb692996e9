"""What people and clients touch: the CLI, the dashboard, the gateway and its controller."""
