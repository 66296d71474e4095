"""Benchmarks (`layercast bench ...`): each prints one JSON object with its baseline and bound.

Imported lazily by the CLI; nothing in libs/ or services/ imports this package."""
