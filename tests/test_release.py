"""The release set (issue 32, docs/wheels.md): the workflow passes actionlint, cibuildwheel reads the
configuration the workflow runs it with, the distribution name is ours everywhere, the CUDA wheels'
index is one pip can install from, and (slow) a wheel per supported CPython found on this machine,
built against one native build, installs into a fresh venv with no compiler and no pip cache and
runs a split exactly.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
NAME = PYPROJECT["project"]["name"]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT / "scripts"))
import release  # noqa: E402  (scripts/release.py)

SUPPORTED = ["cp311", "cp312", "cp313"]


def _tool(name: str) -> str:
    """A tool of the test extra, next to this interpreter."""
    path = shutil.which(name, path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} is not installed: it comes with the test extra (pip install -e '.[test]')")
    return path


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_the_workflow_passes_actionlint() -> None:
    result = subprocess.run([_tool("actionlint"), "-no-color", str(WORKFLOW)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(WORKFLOW.read_text().replace("needs: [publish-pypi]", "needs: [no-such-job]"))
    result = subprocess.run([_tool("actionlint"), "-no-color", str(broken)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0 and "no-such-job" in result.stdout, result.stdout


def _identifiers(env: dict[str, str]) -> list[str]:
    result = subprocess.run([_tool("cibuildwheel"), "--print-build-identifiers", "--platform", "linux",
                             "--archs", "x86_64", str(ROOT)], capture_output=True, text=True, timeout=120,
                            env=env, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_cibuildwheel_builds_every_supported_python_for_both_flavours() -> None:
    """cibuildwheel validates [tool.cibuildwheel] (unknown keys are errors) and lists what it builds:
    one manylinux x86_64 wheel per supported CPython, for the CPU job and for the CUDA job's
    overrides; the same list as the classifiers and scripts/release.py."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("CIBW_")}
    wanted = [f"{tag}-manylinux_x86_64" for tag in SUPPORTED]
    assert _identifiers(base) == wanted
    jobs = _workflow()["jobs"]
    (cuda_step,) = [s for s in jobs["cuda-wheels"]["steps"] if "cibuildwheel" in s.get("uses", "")]
    assert {"CIBW_BEFORE_ALL", "CIBW_ENVIRONMENT", "CIBW_REPAIR_WHEEL_COMMAND_LINUX"} <= set(cuda_step["env"])
    assert all("cu130" in cuda_step["env"][key] for key in ("CIBW_BEFORE_ALL", "CIBW_REPAIR_WHEEL_COMMAND_LINUX"))
    assert _identifiers({**base, **cuda_step["env"]}) == wanted
    assert release.CPYTHONS == SUPPORTED
    versions = [c.rsplit(" ", 1)[1] for c in PYPROJECT["project"]["classifiers"] if re.fullmatch(r".* :: 3\.\d+", c)]
    assert [f"cp{v.replace('.', '')}" for v in versions] == SUPPORTED
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    config = PYPROJECT["tool"]["cibuildwheel"]
    assert config["manylinux-x86_64-image"] == "manylinux_2_28"
    # one native build per flavour, every Python's wheel linked against it
    assert "release.py native" in (ROOT / "scripts" / "cibw_before_all.sh").read_text()
    assert config["environment"]["SKIPPY_LLAMA_LIB_DIR"] == "/project/build/wheel-lib/cpu"


def test_the_workflow_publishes_on_a_tag_through_trusted_publishing() -> None:
    workflow = _workflow()
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["push"]["tags"] == ["v*"]
    jobs = workflow["jobs"]
    publish = jobs["publish-pypi"]
    assert publish["permissions"] == {"id-token": "write"}  # OIDC, no token secret
    assert publish["environment"]["name"] == "pypi" and publish["environment"]["url"].endswith(f"/p/{NAME}")
    assert set(publish["needs"]) == {"sdist", "cpu-wheels", "cuda-wheels"}
    assert "refs/tags/v" in publish["if"]
    assert any(s.get("uses", "").startswith("pypa/gh-action-pypi-publish@") for s in publish["steps"])
    assert "secrets." not in WORKFLOW.read_text()
    pinned = {s["uses"].split("@")[1] for job in jobs.values() for s in job["steps"]
              if s.get("uses", "").startswith("pypa/cibuildwheel@")}
    from importlib.metadata import version

    _tool("cibuildwheel")
    assert pinned == {"v" + version("cibuildwheel")}, "the workflow runs the cibuildwheel the tests check"


def test_the_cuda_wheels_cover_data_centre_and_consumer_gpus() -> None:
    architectures = {a.split("-")[0] for a in release.CUDA_ARCHITECTURES.split(";")}
    assert {"80", "90", "100"} <= architectures  # A100, H100/H200, B200
    assert {"86", "89", "120"} <= architectures  # RTX 30, RTX 40, RTX 50
    assert any("-" not in a for a in release.CUDA_ARCHITECTURES.split(";")), "PTX for later GPUs"
    assert release.CUDA_REQUIRES == ["nvidia-cuda-runtime>=13.0,<14", "nvidia-cublas>=13.0,<14"]


OLD_INSTALL = re.compile(r"""pip install\b[^\n`]*?(?<![\w./-])['"]?skippy(?:\[[\w,-]+\])?['"]?(?=[\s`)"']|$)""")
OLD_FILE = re.compile(r"\bskippy-\d+\.\d+\.\d+[-+]|dist/skippy-|\bskippy-\*[^/\s]*\.(?:whl|tar\.gz)")


def test_the_distribution_name_is_ours_everywhere() -> None:
    """`skippy` on PyPI is an unrelated 2018 package that pip installed in our place: every install
    command and wheel name uses skippy-llm; the import package and the command keep `skippy`."""
    assert NAME == "skippy-llm"
    assert release.WHEEL_NAME == "skippy_llm"
    assert PYPROJECT["project"]["scripts"] == {"skippy": "skippy.__main__:main"}
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "MANIFEST.in", WORKFLOW, *ROOT.glob("docs/*.md"),
             *ROOT.glob("scripts/*"), *ROOT.glob("skippy/**/*.py"), *ROOT.glob("tests/*.py")]
    offending = []
    for path in files:
        if path.is_file() and path != Path(__file__).resolve():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if OLD_INSTALL.search(line) or OLD_FILE.search(line):
                    offending.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offending == [], "\n".join(offending)
    assert OLD_INSTALL.search("pip install 'skippy[ray]'")
    assert OLD_INSTALL.search("pip install --find-links dist skippy")
    assert OLD_INSTALL.search("""needs cryptography: pip install 'skippy[tls]'")""")
    assert OLD_FILE.search('dist.glob("skippy-*.whl")') and not OLD_FILE.search('glob("skippy_llm-*.whl")')
    assert not OLD_INSTALL.search("pip install 'skippy-llm[ray]'")
    assert not OLD_FILE.search("dist/skippy_llm-0.1.0-cp311")


def _fake_wheel(directory: Path, version: str) -> Path:
    """A minimal pure wheel of our distribution (METADATA, WHEEL, RECORD)."""
    wheel = directory / f"{release.WHEEL_NAME}-{version}-py3-none-any.whl"
    info = f"{release.WHEEL_NAME}-{version}.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {version}\n")
        archive.writestr(f"{info}/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_pip_picks_the_cuda_wheel_from_its_index(tmp_path: Path) -> None:
    """The documented CUDA install: `pip install skippy-llm --extra-index-url <index>`; the +cu130
    version sorts above the plain one, so pip takes it over the CPU wheel."""
    (tmp_path / "wheels").mkdir()
    cuda = _fake_wheel(tmp_path / "wheels", "0.1.0+cu130")
    cpu = _fake_wheel(tmp_path / "wheels", "0.1.0")
    index = release.write_index(tmp_path / "index", [cuda])
    page = (index / NAME / "index.html").read_text()
    assert cuda.name in page and "#sha256=" in page and cpu.name not in page
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull)
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "-d",
                             str(tmp_path / "got"), "--index-url", (index).as_uri(), "--find-links",
                             str(tmp_path / "wheels" / cpu.name), NAME], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert [p.name for p in (tmp_path / "got").iterdir()] == [cuda.name]


@pytest.mark.slow
@pytest.mark.parametrize("tag", SUPPORTED)
def test_a_wheel_for_each_supported_python(tag: str, tmp_path: Path) -> None:
    """The release steps for one CPython (scripts/release.py wheel, then scripts/check_wheel.sh), with
    this tree's native build as the one prebuilt library set (SKIPPY_LLAMA_LIB_DIR, nothing of
    llama.cpp rebuilt): a fresh venv of that Python, CC=false CXX=false, --no-cache-dir,
    `python -m skippy.stage --help`, a 2-stage split decode bitwise equal to unsplit."""
    python = release.find_pythons().get(tag)
    if python is None:
        pytest.skip(f"no {tag} interpreter on this machine (python3.{tag[3:]} on PATH or under pyenv)")
    libs = ROOT / "skippy" / "lib"
    assert (libs / "libllama.so").exists(), "build the tree first (make build)"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SKIPPY_VOCAB_DIR")}
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "release.py"), "wheel", "cpu", python,
                            "--out", str(tmp_path / "dist"), "--lib-dir", str(libs)],
                           capture_output=True, text=True, env=env, timeout=1800)
    assert built.returncode == 0, built.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob(f"{release.WHEEL_NAME}-*-{tag}-{tag}-manylinux_*_x86_64.whl")
    shown = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)], capture_output=True, text=True,
                           env={**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}, timeout=600)
    assert shown.returncode == 0 and "manylinux_" in shown.stdout, shown.stdout + shown.stderr
    checked = subprocess.run(["bash", str(ROOT / "scripts" / "check_wheel.sh"), str(wheel), python],
                             capture_output=True, text=True, env=env, timeout=1800)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-3000:]
    assert "2-stage split decode = unsplit: ok" in checked.stdout and "wheel check ok" in checked.stdout
