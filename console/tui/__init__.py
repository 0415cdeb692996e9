"""The live dashboard: a Textual TUI that watches and steers a console through its control API."""
