"""The gRPC stubs of serving/api/fusionserve.proto and grpc_predict_v2.proto (the Open Inference Protocol), generated with
grpcio-tools (the dev extra pins its version).

The generated files are committed (the package then installs and runs with grpcio and protobuf only, and the
Docker images need no code generator); ``python -m tests.grpc_stubs`` regenerates them after a change to the
.proto, and tests/test_builder.py (test_grpc_stubs_are_what_the_proto_generates) checks that the committed files
are what the .protos generate.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "serving" / "api" / "fusionserve.proto"
PROTOS = (PROTO, ROOT / "serving" / "api" / "grpc_predict_v2.proto")
GENERATED = tuple(f"{p.stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate(out: Path) -> dict[str, str]:
    """Run protoc (grpcio-tools) on each .proto as the installed package names it (fusionserve/serving/api/...), so
    the generated code imports ``fusionserve.serving.api.fusionserve_pb2``; returns file name -> text."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "fusionserve" / "serving" / "api"
        src.mkdir(parents=True)
        for proto in PROTOS:
            shutil.copy(proto, src / proto.name)
            args = ["protoc", f"-I{tmp}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}",
                    f"fusionserve/serving/api/{proto.name}"]  # fmt: skip
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on {proto}")
    return {name: (out / "fusionserve" / "serving" / "api" / name).read_text() for name in GENERATED}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (ROOT / "serving" / "api" / name).write_text(text)
            print(f"wrote serving/api/{name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
