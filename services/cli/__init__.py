"""The `layercast` command line: cluster lifecycle, models, benchmarks."""

from services.cli.app import app


def main() -> None:
    app()
