"""CPU variant choice (skippy/runtime/backends.py) and the wheel flavour rewrite (scripts/wheel_flavour.py).

The variants build itself is for wheels only (``make wheel``); here the choice rules run on variant
lists, and this build (the CPU backend linked in) is checked to load no modules.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from skippy.runtime.backends import UNTRUSTED, CpuVariant, _choose, cpu_variants

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = [CpuVariant(name, Path(f"/lib/libggml-cpu-{name}.so"), score) for name, score in
            (("x64", 1), ("sse42", 5), ("haswell", 64), ("icelake", 0), ("sapphirerapids", 200))]


def test_the_best_trusted_variant_wins() -> None:
    assert "sapphirerapids" in UNTRUSTED
    assert _choose(VARIANTS, None).name == "haswell"  # AMX scores higher but is not trusted; icelake cannot run


def test_a_named_variant_is_loaded_as_asked() -> None:
    assert _choose(VARIANTS, "sapphirerapids").name == "sapphirerapids"
    assert _choose(VARIANTS, "x64").name == "x64"
    with pytest.raises(ImportError, match="SKIPPY_CPU_VARIANT=icelake: this CPU lacks instructions"):
        _choose(VARIANTS, "icelake")
    with pytest.raises(ImportError, match="SKIPPY_CPU_VARIANT=zen9: no such CPU variant"):
        _choose(VARIANTS, "zen9")


def test_no_runnable_variant_is_an_import_error() -> None:
    with pytest.raises(ImportError, match="no CPU variant"):
        _choose([VARIANTS[3], VARIANTS[4]], None)


def test_this_build_links_its_cpu_backend() -> None:
    from skippy.runtime import ffi

    assert cpu_variants(ROOT / "skippy" / "lib") == [] and ffi.BACKENDS is None


def _fake_wheel(path: Path) -> None:
    files = {"pkg/__init__.py": b"x = 1\n",
             "pkg-0.1.0.dist-info/METADATA": b"Metadata-Version: 2.4\nName: pkg\nVersion: 0.1.0\n"
                                             b"Requires-Dist: numpy\n\nA description.\n",
             "pkg-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp311-cp311-linux_x86_64\n"}
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("pkg/", b"")  # a directory entry, as auditwheel's repaired wheels have
        record = []
        for name, data in files.items():
            wheel.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        wheel.writestr("pkg-0.1.0.dist-info/RECORD", "\n".join(record + ["pkg-0.1.0.dist-info/RECORD,,"]) + "\n")


def test_the_cuda_flavour_rewrite(tmp_path: Path) -> None:
    source = tmp_path / "pkg-0.1.0-cp311-cp311-linux_x86_64.whl"
    _fake_wheel(source)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "wheel_flavour.py"), str(source), "--local", "cu130",
                           "--requires", "nvidia-cublas>=13.0,<14", "--outdir", str(tmp_path / "out")],
                          capture_output=True, text=True, check=True)
    target = Path(done.stdout.strip())
    assert target.name == "pkg-0.1.0+cu130-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(target) as wheel:
        names = set(wheel.namelist())
        metadata = wheel.read("pkg-0.1.0+cu130.dist-info/METADATA").decode()
        record = wheel.read("pkg-0.1.0+cu130.dist-info/RECORD").decode()
        assert wheel.read("pkg/__init__.py") == b"x = 1\n"
    assert "pkg-0.1.0.dist-info/METADATA" not in names
    assert "pkg/" in names and "\npkg/," not in "\n" + record  # RECORD lists files, never directories
    assert "Version: 0.1.0+cu130\n" in metadata
    assert metadata.index("Requires-Dist: nvidia-cublas>=13.0,<14") < metadata.index("A description.")
    for line in record.strip().splitlines()[:-1]:  # every file's hash is the one stored
        name, digest, size = line.split(",")
        with zipfile.ZipFile(target) as wheel:
            data = wheel.read(name)
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert int(size) == len(data)


@pytest.fixture
def native_build():  # type: ignore[no-untyped-def]
    """native/build.py as a module of its own (the name ``build`` is also PyPA's package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("skippy_native_build", ROOT / "native" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _libs(directory: Path, names: list[str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(name.encode())


def test_a_variants_build_installs_every_module_and_drops_the_linked_in_backend(
        native_build, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SKIPPY_CPU_VARIANTS", "all")
    built = ["libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu-x64.so", "libggml-cpu-haswell.so"]
    _libs(tmp_path / "bin", built)
    _libs(tmp_path / "dest", ["libggml-cpu.so", "libllama.so"])
    (tmp_path / "dest" / "SOURCE").write_text("x")
    assert native_build.install_libraries(tmp_path / "bin", tmp_path / "dest") == sorted(built)
    assert sorted(p.name for p in (tmp_path / "dest").iterdir()) == sorted([*built, "SOURCE"])
    assert (tmp_path / "dest" / "libllama.so").read_bytes() == b"libllama.so"
    assert "cpu-variants" in native_build.build_dir().name


def test_builds_without_their_cpu_backend_fail(native_build, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _libs(tmp_path / "bin", ["libllama.so", "libggml.so", "libggml-base.so"])
    monkeypatch.delenv("SKIPPY_CPU_VARIANTS", raising=False)
    with pytest.raises(native_build.NativeBuildError, match="libggml-cpu.so"):
        native_build.install_libraries(tmp_path / "bin", tmp_path / "dest")
    monkeypatch.setenv("SKIPPY_CPU_VARIANTS", "all")
    with pytest.raises(native_build.NativeBuildError, match="no libggml-cpu-"):
        native_build.install_libraries(tmp_path / "bin", tmp_path / "dest")
    monkeypatch.setenv("SKIPPY_CPU_VARIANTS", "avx512")
    with pytest.raises(native_build.NativeBuildError, match="use 'all'"):
        native_build.install_libraries(tmp_path / "bin", tmp_path / "dest")
