"""Writes mmad/grpc/generated/ from the vendored Triton protos in mmad/grpc/protos/ (grpcio-tools,
the version in constraints.txt: ``pip install -e .[dev]``).

    .venv/bin/python scripts/generate_grpc.py            # rewrite the modules
    .venv/bin/python scripts/generate_grpc.py --check    # exit 1 if they differ from what it writes

The modules are committed, so that installing mmad needs no code generator. Two lines of
protoc's output are rewritten: the imports between the modules point into the package, and the
messages go into a descriptor pool of mmad's own (``mmad.grpc.generated.POOL``) rather than
protobuf's default pool, where tritonclient puts its copy of the same files: a process holding
both (a test, a benchmark, an application that serves and calls) would otherwise fail at import
whenever the two copies differ.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = REPO / "mmad" / "grpc" / "protos"
GENERATED = REPO / "mmad" / "grpc" / "generated"
FILES = ("model_config.proto", "grpc_service.proto")
PACKAGE = "mmad.grpc.generated"
POOL_IMPORT = f"from {PACKAGE} import POOL as _MMAD_POOL\n"


def rewrite(text: str) -> str:
    text = re.sub(r"^import (\w+_pb2) as (\w+)$", rf"from {PACKAGE} import \1 as \2", text, flags=re.M)
    if "_descriptor_pool.Default().AddSerializedFile(" in text:
        text = text.replace("_descriptor_pool.Default().AddSerializedFile(", "_MMAD_POOL.AddSerializedFile(")
        text = text.replace("# @@protoc_insertion_point(imports)\n", "# @@protoc_insertion_point(imports)\n" + POOL_IMPORT)
    return text


def generate(out: Path) -> dict[str, str]:
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTOS}", f"--python_out={out}", f"--grpc_python_out={out}", *FILES]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # model_config.proto declares no service: its (empty) _grpc module is left out
    return {p.name: rewrite(p.read_text()) for p in sorted(out.glob("*_pb2*.py"))
            if not p.name.endswith("_grpc.py") or "Stub" in p.read_text()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        modules = generate(Path(tmp))
    differ = [name for name, text in modules.items()
              if not (GENERATED / name).exists() or (GENERATED / name).read_text() != text]
    if args.check:
        for name in differ:
            print(f"mmad/grpc/generated/{name} differs from what scripts/generate_grpc.py writes", file=sys.stderr)
        return 1 if differ else 0
    for name, text in modules.items():
        (GENERATED / name).write_text(text)
    print(f"wrote {', '.join(sorted(modules))} in mmad/grpc/generated/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
