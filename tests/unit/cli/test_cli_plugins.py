"""`layercast bench ...` reaches the benchmarks through the `layercast.cli` entry point group that
pyproject.toml declares, resolved by name: services/ never imports benchmarks/ (the layers contract)."""

import importlib
import re
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

# the module, not the typer app that services.cli re-exports under the same name
cli_module = importlib.import_module("services.cli.app")

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def declared(group: str) -> dict[str, str]:
    return tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"][group]


def installed_as(monkeypatch, value: str | None) -> None:
    """The CLI sees `bench` declared as VALUE by the installed metadata (None: not declared)."""
    def entry_points(group: str, name: str) -> list[EntryPoint]:
        assert group == cli_module.PLUGIN_GROUP
        return [EntryPoint(name, value, group)] if value and name == "bench" else []
    monkeypatch.setattr(cli_module, "entry_points", entry_points)


def test_pyproject_declares_bench_as_the_benchmarks_typer_app():
    target = declared(cli_module.PLUGIN_GROUP)["bench"]
    assert target == "benchmarks.cli:bench_app"
    app = EntryPoint("bench", target, cli_module.PLUGIN_GROUP).load()
    assert isinstance(app, typer.Typer)
    commands = {c.name for c in app.registered_commands}
    assert documented_bench_commands() <= commands


def documented_bench_commands() -> set[str]:
    """Every `layercast bench X` that the README, the docs, the Makefile and the deploy files name."""
    root = PYPROJECT.parent
    texts = [root / "README.md", root / "Makefile", *root.glob("docs/**/*.md"), *root.glob("deploy/**/*"),
             *root.glob("k8s/**/*"), *root.glob("docker-compose*.yml")]
    found = {m for f in texts if f.is_file() for m in re.findall(r"layercast bench ([a-z][a-z-]*)", f.read_text())}
    assert {"plan", "load", "engine", "serve", "multicast", "scale", "trace", "mesh"} <= found  # the finder works
    return found


stand_in = typer.Typer()


@stand_in.command()
def hello(who: str, loud: bool = False) -> None:
    print(f"hello {who}".upper() if loud else f"hello {who}")


@stand_in.command()
def other() -> None:
    pass


def test_bench_runs_the_app_the_entry_point_names(monkeypatch):
    installed_as(monkeypatch, f"{__name__}:stand_in")
    r = CliRunner().invoke(cli_module.app, ["bench", "hello", "world", "--loud"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == "HELLO WORLD"  # its arguments and options passed through as they are


@pytest.mark.parametrize("value", [None, "benchmarks_absent_here.cli:bench_app"], ids=["not declared", "not here"])
def test_bench_without_the_benchmarks_says_so(monkeypatch, value):
    installed_as(monkeypatch, value)
    r = CliRunner().invoke(cli_module.app, ["bench", "plan"])
    assert r.exit_code == 1
    assert "no benchmarks here" in " ".join(r.output.split())


def test_a_failing_import_inside_the_benchmarks_is_not_hidden(monkeypatch, tmp_path):
    (tmp_path / "broken_bench_plugin.py").write_text("import a_dependency_that_is_missing\nbench_app = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed_as(monkeypatch, "broken_bench_plugin:bench_app")
    r = CliRunner().invoke(cli_module.app, ["bench", "plan"])
    assert isinstance(r.exception, ModuleNotFoundError) and r.exception.name == "a_dependency_that_is_missing"
