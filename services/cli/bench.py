"""`layercast bench ...`: benchmarks. Each prints one JSON object (with --json)."""

import typer

bench_app = typer.Typer(help="Benchmarks; each prints one JSON object with --json.", no_args_is_help=True)
