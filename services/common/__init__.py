"""Wiring shared by every service process: start-up, health endpoint, shutdown."""
