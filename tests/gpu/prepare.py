"""What a bare GPU machine lacks for the GPU checks, carried in one folder (< 64 MiB), and its offline install.

``python -m tests.gpu.prepare DIR`` (``run_gpu_checks.sh --prepare DIR``, where pip reaches an index) writes

* ``DIR/wheels``: the Python 3.12 manylinux wheels of :data:`WHEELS`, downloaded with ``--no-deps``; every
  ``Requires-Dist`` of every wheel must be one of these wheels or a package of the GPU image (:data:`IMAGE`),
  else it fails naming the requirement;
* ``DIR/models/tiny-llama``: the built-in ``builtin:tiny-llama`` (``builtin_models``; 2 layers, fp32), which the
  checks load through ``GTPO_CACHE_DIR=DIR/models``;

and prints the folder's size in MiB (it fails above :data:`LIMIT_MIB`). ``python -m tests.gpu.prepare --install DIR
TARGET`` (on the GPU machine) installs the wheels into ``TARGET`` with ``pip --no-index --no-deps`` (``packaging``
only when the image's is older than megatron-core needs).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEELS = (
    "megatron-core==0.19.2",  # requires torch, numpy, packaging>=24.2
    "math-verify==0.9.0",  # the trainer imports it (rewards); requires latex2sympy2_extended==1.11.0
    "latex2sympy2_extended==1.11.0",  # requires sympy (a torch dependency) and antlr4-python3-runtime<=4.13.2
    "antlr4-python3-runtime==4.13.2",
    "packaging==26.4",  # fallback (see FALLBACKS)
    "setuptools==84.2.1",  # fallback: torch's Requires-Dist on 3.12; megatron-core imports torch.utils.cpp_extension
)
IMAGE = frozenset(
    ("torch", "triton", "numpy", "sympy", "transformers", "tokenizers", "huggingface-hub", "safetensors", "pyyaml",
     "tqdm", "filelock", "matplotlib", "pytest", "pytest-timeout", "packaging", "setuptools")
)  # fmt: skip
"""What the GPU image has (one H200, Python 3.12, torch 2.11 + CUDA 13, Triton 3.6, transformers 5.17; the torch and
transformers dependencies come with them). No megatron-core, vLLM, math-verify, Transformer Engine, or network."""
TARGET_PLATFORM = ("--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64")
LIMIT_MIB = 64
FALLBACKS = {"packaging": (24, 2), "setuptools": (77, 0)}
"""Wheels installed only when the interpreter lacks the package or has an older (major, minor) than this:
megatron-core needs packaging >= 24.2; torch (hence megatron-core's import of ``torch.utils.cpp_extension``) needs
setuptools >= 77.0.3 on Python 3.12, which an image installed without dependencies may lack."""


def _requirements(wheel: Path):
    """The ``Requires-Dist`` entries of ``wheel`` (``packaging`` ``Requirement`` s) that apply on Python 3.12."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(name).decode().splitlines()
    environment = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.3", "extra": ""}
    found = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [r for r in found if r.marker is None or r.marker.evaluate(environment)]


def check_requirements(wheels: list[Path]) -> None:
    """Every requirement of every wheel is one of ``wheels`` (at a version it admits) or a package of the image.

    Raises:
        SystemExit: naming each unmet requirement.
    """
    from packaging.utils import canonicalize_name
    from packaging.version import Version

    versions = {canonicalize_name(w.name.split("-")[0]): Version(w.name.split("-")[1]) for w in wheels}
    unmet = []
    for wheel in wheels:
        for requirement in _requirements(wheel):
            name = canonicalize_name(requirement.name)
            if name in versions and requirement.specifier.contains(versions[name], prereleases=True):
                print(f"  {wheel.name.split('-')[0]} requires {requirement}: wheel {name} {versions[name]}")
            elif name in IMAGE and name not in versions:
                print(f"  {wheel.name.split('-')[0]} requires {requirement}: on the GPU image")
            else:
                unmet.append(f"{wheel.name} requires {requirement}")
    if unmet:
        raise SystemExit("prepare: requirements neither downloaded nor on the GPU image: " + "; ".join(unmet))


def _size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def prepare(out: Path) -> None:
    """Download the wheels, copy the tiny model and check the size (see the module docstring)."""
    from gtpo_megatron.builtin_models import resolve_model_path

    wheels_dir, model_dir = out / "wheels", out / "models" / "tiny-llama"
    shutil.rmtree(out, ignore_errors=True)
    wheels_dir.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    *TARGET_PLATFORM, "-d", str(wheels_dir), *WHEELS], check=True)  # fmt: skip
    wheels = sorted(wheels_dir.glob("*.whl"))
    print(f"prepare: {len(wheels)} wheels in {wheels_dir}")
    check_requirements(wheels)
    shutil.copytree(resolve_model_path("builtin:tiny-llama"), model_dir)
    for path in sorted(out.rglob("*")):
        if path.is_file():
            print(f"  {path.relative_to(out)}  {path.stat().st_size / 2**20:.2f} MiB")
    size = _size_mib(out)
    print(f"prepare: {out} holds {size:.1f} MiB (limit {LIMIT_MIB} MiB)")
    if size >= LIMIT_MIB:
        raise SystemExit(
            f"prepare: {out} is {size:.1f} MiB, over the {LIMIT_MIB} MiB that may travel to the GPU machine"
        )


def install(folder: Path, target: Path) -> None:
    """``pip install --no-index --no-deps --target target`` of the folder's wheels (:data:`FALLBACKS` when needed)."""
    wheels = sorted((folder / "wheels").glob("*.whl"))
    if not wheels:
        raise SystemExit(f"install: no wheels in {folder}/wheels; run `run_gpu_checks.sh --prepare {folder}` first")

    def needed(wheel: Path) -> bool:
        name = wheel.name.split("-")[0].lower()
        return name not in FALLBACKS or _installed_version(name) < FALLBACKS[name]

    wheels = [w for w in wheels if needed(w)]
    shutil.rmtree(target, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target),
                    *map(str, wheels)], check=True)  # fmt: skip
    print(f"install: {', '.join(w.name.split('-')[0] + ' ' + w.name.split('-')[1] for w in wheels)} -> {target}")


def _installed_version(name: str) -> tuple[int, ...]:
    """The (major, minor) of the interpreter's own distribution ``name``; (0,) when it has none."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(part) for part in version(name).split(".")[:2])
    except PackageNotFoundError:
        return (0,)


def main(argv: list[str] | None = None) -> None:
    """``DIR`` prepares; ``--install DIR TARGET`` installs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--install", metavar="TARGET", type=Path, help="install DIR's wheels into TARGET")
    parser.add_argument("dir", type=Path, help="the folder that travels to the GPU machine (e.g. .gpu_prep)")
    args = parser.parse_args(argv)
    if args.install:
        install(args.dir, args.install)
    else:
        prepare(args.dir)


if __name__ == "__main__":
    main()
