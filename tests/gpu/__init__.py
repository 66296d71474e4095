"""The gpu tests (a package, so that its conftest is `gpu.conftest`, not a second top-level `conftest`
that `from conftest import ...` in other test modules would find)."""
