"""Helpers for tests that start real services (redis-server, pd-metaserver, …)."""
