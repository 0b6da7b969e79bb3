"""Regenerate the Python modules for ``wire/control.proto``.

Run from the repository root::

    python -m wire.generate            # writes wire/control_pb2.py, _pb2_grpc.py, _pb2.pyi
    python -m wire.generate OUT_DIR    # writes them somewhere else

Output is deterministic for a given grpcio-tools version, so the committed modules can be
compared byte for byte with a fresh generation (``tests/unit/test_proto_drift.py``).
"""

from __future__ import annotations

import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILE = "control.proto"
GENERATED_FILES: tuple[str, ...] = ("control_pb2.py", "control_pb2_grpc.py", "control_pb2.pyi")

# grpc_tools emits `import control_pb2 as control__pb2`, which only works with proto/ on
# sys.path. Make it package-relative so `import wire.control_pb2_grpc` works from the root.
_ABSOLUTE_IMPORT = re.compile(r"^import (control_pb2) as (control__pb2)$", re.MULTILINE)


class GenerationError(RuntimeError):
    """protoc failed or produced unexpected output."""


def _well_known_include() -> str:
    return str(resources.files("grpc_tools") / "_proto")


def generate(out_dir: Path | str = PROTO_DIR, proto_dir: Path | str = PROTO_DIR) -> list[Path]:
    """Generate ``control_pb2.py``, ``control_pb2_grpc.py`` and ``control_pb2.pyi`` into
    ``out_dir`` from ``proto_dir/control.proto``. Returns the written paths.

    protoc runs into a scratch directory first; the files in ``out_dir`` are only replaced
    once generation and post-processing succeeded.
    """
    from grpc_tools import protoc  # build-time dependency; imported lazily

    out = Path(out_dir)
    src = Path(proto_dir)
    if not (src / PROTO_FILE).is_file():
        raise GenerationError(f"{src / PROTO_FILE} not found")
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="dacp-proto-") as scratch:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={src}",
            f"--proto_path={_well_known_include()}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            PROTO_FILE,
        ]
        code = protoc.main(args)
        if code != 0:
            raise GenerationError(f"protoc exited with status {code}")

        contents: dict[str, bytes] = {}
        for name in GENERATED_FILES:
            produced = Path(scratch) / name
            if not produced.is_file():
                raise GenerationError(f"protoc did not produce {name}")
            contents[name] = produced.read_bytes()

    grpc_text = contents["control_pb2_grpc.py"].decode("utf-8")
    fixed, count = _ABSOLUTE_IMPORT.subn(r"from . import \1 as \2", grpc_text)
    if count != 1:
        raise GenerationError("could not rewrite the control_pb2 import in control_pb2_grpc.py")
    contents["control_pb2_grpc.py"] = fixed.encode("utf-8")

    written: list[Path] = []
    for name in GENERATED_FILES:
        target = out / name
        target.write_bytes(contents[name])
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1:
        print("usage: python -m wire.generate [OUT_DIR]", file=sys.stderr)
        return 2
    out_dir = Path(args[0]) if args else PROTO_DIR
    for path in generate(out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
