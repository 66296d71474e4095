"""Install wheels without pip (a python without pip on the GPU machine): a wheel is a zip of its
package folders; its `*.data/purelib|platlib` go beside them and `*.data/scripts` to bin/.

usage: python scripts/gpu_unzip_wheels.py WHEEL_DIR REQUIREMENTS TARGET
"""

from __future__ import annotations

import re
import shutil
import sys
import zipfile
from pathlib import Path


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def main() -> None:
    wheel_dir, requirements, target = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    wanted = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            wanted[normalize(name)] = version
    wheels = {}
    for w in wheel_dir.glob("*.whl"):
        name, version = w.name.split("-")[:2]
        if wanted.get(normalize(name)) == version:
            wheels[normalize(name)] = w
    missing = sorted(set(wanted) - set(wheels))
    if missing:
        sys.exit(f"no wheel in {wheel_dir} for {missing}")
    target.mkdir(parents=True, exist_ok=True)
    for w in wheels.values():
        with zipfile.ZipFile(w) as z:
            z.extractall(target)
    for data in target.glob("*.data"):
        for kind in ("purelib", "platlib"):
            if (data / kind).is_dir():
                shutil.copytree(data / kind, target, dirs_exist_ok=True)
        if (data / "scripts").is_dir():
            (target / "bin").mkdir(exist_ok=True)
            for s in (data / "scripts").iterdir():
                shutil.copy2(s, target / "bin" / s.name)
                (target / "bin" / s.name).chmod(0o755)
        shutil.rmtree(data)


if __name__ == "__main__":
    main()
