"""Regenerate the Python code for the wire contract: ``python proto/generate.py``.

``--check`` regenerates into a temporary folder and fails if the committed files differ, which
is how the test suite proves the generated code is current.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent
PROTOS = sorted(p.relative_to(ROOT) for p in ROOT.rglob("*.proto"))
GENERATED = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out: Path) -> None:
    args = [
        "protoc",
        f"-I{ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *map(str, PROTOS),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_files(base: Path) -> list[Path]:
    return sorted(p.relative_to(base) for p in base.rglob("*") if p.name.endswith(GENERATED))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed code is stale")
    args = parser.parse_args()
    if not args.check:
        generate(ROOT)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        stale = [
            str(f)
            for f in generated_files(fresh)
            if not (ROOT / f).exists() or not filecmp.cmp(fresh / f, ROOT / f, shallow=False)
        ]
        extra = [str(f) for f in generated_files(ROOT) if not (fresh / f).exists()]
    if stale or extra:
        print(f"generated code is stale: {stale + extra}; run python proto/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
