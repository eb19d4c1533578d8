"""The admin side: a token-protected HTTP API on its own port, and the dashboard."""
