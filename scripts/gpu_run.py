"""Run a module as `python -m MODULE ARGS...` would (or call MODULE:FUNCTION, an entry point such as
`services.cli:main`, with ARGS as its command line), then write the top-level names of every
module the run imported to IMPORTS_FILE (one a line): scripts/gpu-check runs each step through
this, and tests/gpu/test_gpu_check.py checks that the wheels it brings cover them.

usage: python scripts/gpu_run.py IMPORTS_FILE MODULE[:FUNCTION] [ARGS...]
"""

from __future__ import annotations

import atexit
import runpy
import sys


def _write(path: str) -> None:
    names = sorted({name.split(".")[0] for name in list(sys.modules) if not name.startswith("_")})
    with open(path, "w") as f:
        f.write("\n".join(names) + "\n")


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    imports_file, module = sys.argv[1], sys.argv[2]
    atexit.register(_write, imports_file)
    if ":" in module:
        import importlib

        name, function = module.split(":")
        sys.argv = [name, *sys.argv[3:]]
        sys.exit(getattr(importlib.import_module(name), function)())
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
