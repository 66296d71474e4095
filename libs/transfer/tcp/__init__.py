"""The TCP data plane: its wire frames and its transport."""
