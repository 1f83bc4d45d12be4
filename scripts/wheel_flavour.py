"""Give a built wheel its flavour: a local version (``0.1.0+cu130``) and the extra runtime
requirements that flavour needs (NVIDIA's CUDA runtime and cuBLAS wheels for the CUDA build).

Strategy: the package metadata is static (pyproject.toml), so the CUDA wheel is built like the CPU
one and rewritten here: the ``.dist-info`` directory is renamed to the new version, ``METADATA``
gets the new ``Version`` and one ``Requires-Dist`` line per requirement, and ``RECORD`` is written
again with every file's sha256 and size (files only, as the wheel spec asks: auditwheel reads every
RECORD row as a file, and a directory row made ``auditwheel show`` fail with IsADirectoryError).
Everything else is copied byte for byte.

    python scripts/wheel_flavour.py dist/raw/skippy_llm-0.1.0-...whl --local cu130 \
        --requires 'nvidia-cuda-runtime==13.0.*' --requires 'nvidia-cublas==13.*' --outdir dist
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def flavour(wheel: Path, local: str, requires: list[str], outdir: Path) -> Path:
    """Write the flavoured copy of ``wheel`` into ``outdir``; returns its path."""
    if not re.fullmatch(r"[a-z0-9]+(?:\.[a-z0-9]+)*", local):
        raise ValueError(f"local version {local!r}: use letters, digits and dots (e.g. cu130)")
    name, version, rest = wheel.name.split("-", 2)
    new_version = f"{version.split('+')[0]}+{local}"
    old_info, new_info = f"{name}-{version}.dist-info/", f"{name}-{new_version}.dist-info/"
    target = outdir / f"{name}-{new_version}-{rest}"
    outdir.mkdir(parents=True, exist_ok=True)
    records = []
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as out:
        for item in source.infolist():
            path = item.filename
            if path == old_info + "RECORD":
                continue
            data = source.read(item)
            if path.startswith(old_info):
                path = new_info + path[len(old_info):]
            if path == new_info + "METADATA":
                text = data.decode()
                text = re.sub(r"^Version: .*$", f"Version: {new_version}", text, count=1, flags=re.MULTILINE)
                head, sep, body = text.partition("\n\n")
                head += "".join(f"\nRequires-Dist: {requirement}" for requirement in requires)
                data = (head + sep + body).encode()
            info = zipfile.ZipInfo(path, date_time=item.date_time)
            info.external_attr = item.external_attr
            if item.is_dir():  # a directory entry: kept, stored, and never in RECORD (it lists files)
                info.compress_type = zipfile.ZIP_STORED
                out.writestr(info, data)
                continue
            info.compress_type = zipfile.ZIP_DEFLATED
            out.writestr(info, data)
            records.append(f"{path},{_digest(data)},{len(data)}")
        records.append(f"{new_info}RECORD,,")
        out.writestr(new_info + "RECORD", "\n".join(records) + "\n")
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--local", required=True, help="local version label, e.g. cu130")
    parser.add_argument("--requires", action="append", default=[], help="a Requires-Dist to add (repeatable)")
    parser.add_argument("--outdir", type=Path, required=True)
    args = parser.parse_args()
    print(flavour(args.wheel, args.local, args.requires, args.outdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
