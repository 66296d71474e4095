"""The dev-cluster launcher and the network emulator (stdlib only): used by the CLI, benchmarks and tests."""
