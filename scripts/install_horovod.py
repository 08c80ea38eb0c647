#!/usr/bin/env python3
"""Build horovod 0.28.1 (once, cached) and install it into a Python environment that already has torch.

    python scripts/install_horovod.py [--python /path/to/venv/bin/python]

Used by `make setup` and by docker/Dockerfile; runs on the standard library alone, so it also works in an
existing Airflow deployment before this package is installed (see the README).

horovod 0.28.1 is the last release and, as published, does not build against torch >= 2.1 (torch's headers
need C++17). Its PyPI sdist is built with CMAKE_CXX_STANDARD raised to 17, with PyTorch and Gloo and without
MPI, TensorFlow or MXNet; with NCCL for GPU tensors too (HOROVOD_GPU_OPERATIONS=NCCL) when a CUDA toolkit
(nvcc) and a CUDA build of torch are found, linked against the NCCL that torch brings. The wheel is cached
outside the repository under ``$HVD_WHEEL_CACHE`` (default ``~/.cache/airflow-provider-hvd``) in a folder
named by horovod's, torch's and Python's versions and the build variant (``cpu``, ``cuda12.8``), so that
only the first run pays the ~5 minutes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HOROVOD_VERSION = "0.28.1"
CMAKE_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")


class InstallError(RuntimeError):
    """What is missing or failed, with the fix."""


@dataclass(frozen=True)
class Target:
    """The environment horovod is built for."""

    python: str
    torch_version: str  # torch.__version__, e.g. "2.13.0+cpu"
    torch_cuda: str | None  # torch.version.cuda: None for a CPU-only torch
    py_tag: str  # "cp311"
    nccl_dir: str | None = None  # the NCCL that a CUDA torch brings (the nvidia-nccl-cu* package), if any


@dataclass(frozen=True)
class Variant:
    """What horovod is built with: its name is part of the wheel cache key ("cpu", later "cuda12.4")."""

    name: str
    env: dict[str, str] = field(default_factory=dict)  # HOROVOD_* build switches


def cpu_variant() -> Variant:
    return Variant("cpu", {
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITHOUT_MPI": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
    })


def nccl_variant(target: Target) -> Variant:
    """Gloo for CPU tensors, NCCL for GPU tensors (shared NCCL: the one torch loads)."""
    return Variant(
        f"cuda{target.torch_cuda}",
        {**cpu_variant().env, "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED"},
    )


def choose_variant(target: Target) -> Variant:
    """NCCL when a CUDA toolkit (nvcc) and a CUDA build of torch are found, else the CPU build (Gloo)."""
    if target.torch_cuda and shutil.which("nvcc"):
        return nccl_variant(target)
    return cpu_variant()


def nccl_of_torch(target: Target, work: Path) -> dict[str, str]:
    """Build settings that point Horovod at the NCCL torch brought (pip's nvidia-nccl-cu*), unless told otherwise."""
    if not target.nccl_dir or os.environ.get("HOROVOD_NCCL_HOME"):
        return {}
    lib = work / "nccl-lib"  # the package has libnccl.so.2 only; CMake's find_library(nccl) needs libnccl.so
    lib.mkdir()
    (lib / "libnccl.so").symlink_to(Path(target.nccl_dir, "lib", "libnccl.so.2"))
    return {"HOROVOD_NCCL_INCLUDE": str(Path(target.nccl_dir, "include")), "HOROVOD_NCCL_LIB": str(lib)}


def probe(python: str) -> Target:
    code = (
        "import sys, torch; "
        "print(torch.__version__); print(torch.version.cuda or ''); "
        "print(f'cp{sys.version_info[0]}{sys.version_info[1]}')\n"
        "try:\n import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])\n"
        "except ImportError:\n print('')"
    )
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise InstallError(f"torch must be installed in {python}'s environment before horovod (it is built against "
                           f"it): {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}")
    torch_version, cuda, py_tag, nccl_dir = proc.stdout.split("\n")[:4]
    return Target(python, torch_version, cuda or None, py_tag, nccl_dir or None)


def cache_dir(root: Path, target: Target, variant: Variant) -> Path:
    torch = target.torch_version.replace("+", "_")
    return root / f"horovod-{HOROVOD_VERSION}-torch-{torch}-{target.py_tag}-{variant.name}"


def horovod_installed(python: str) -> bool:
    check = f"import horovod.torch, sys; sys.exit(horovod.__version__ != {HOROVOD_VERSION!r})"
    return subprocess.run([python, "-c", check], capture_output=True).returncode == 0


def check_toolchain() -> None:
    if shutil.which("cmake") is None:
        raise InstallError("cmake is missing; install it (Debian: apt-get install cmake) and run again.")
    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise InstallError("a C++17 compiler is missing; install g++ >= 9 (Debian: apt-get install g++) and run again.")


def python_headers_missing(python: str) -> str | None:
    """The directory where ``python``'s Python.h should be, if it is not there (torch's headers include it)."""
    code = "import sysconfig; print(sysconfig.get_paths()['include'])"
    include = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    return None if Path(include, "Python.h").exists() else include


def check_python_headers(target: Target) -> None:
    missing = python_headers_missing(target.python)
    if missing:
        version = target.py_tag[2] + "." + target.py_tag[3:]
        raise InstallError(f"Python's headers are missing ({missing}/Python.h); install them (Debian, Ubuntu: "
                           f"apt-get install python{version}-dev) and run again.")


def raise_cxx_standard(src: Path) -> None:
    for name in CMAKE_FILES:
        path = src / name
        text = path.read_text()
        path.write_text(text.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"))
        if "CMAKE_CXX_STANDARD 14" in path.read_text():
            raise InstallError(f"could not raise the C++ standard in horovod's {name}")


def unpack_sdist(archive: Path, dest: Path) -> None:
    """Extract ``archive`` into ``dest``, refusing members that would land outside it."""
    with tarfile.open(archive) as sdist:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            try:
                sdist.extractall(dest, filter="data")
            except tarfile.FilterError as exc:
                raise InstallError(f"{archive.name} is not a plain source archive: {exc}") from None
            return
        # older 3.11 releases, such as Debian bookworm's python3 (3.11.2): check the members' paths first
        root = dest.resolve()
        for member in sdist.getmembers():
            target = (root / member.name).resolve()
            link = target
            if member.issym():
                link = (target.parent / member.linkname).resolve()
            elif member.islnk():  # a hard link names a member of the archive
                link = (root / member.linkname).resolve()
            if not (target.is_relative_to(root) and link.is_relative_to(root)) or member.isdev():
                raise InstallError(f"{archive.name} is not a plain source archive: {member.name!r} would be "
                                   f"extracted outside {dest} (or is a device)")
        sdist.extractall(dest)


def build_wheel(target: Target, variant: Variant, cache: Path) -> Path:
    check_toolchain()
    check_python_headers(target)
    print(f"install_horovod: building horovod {HOROVOD_VERSION} ({variant.name}) against torch "
          f"{target.torch_version} (about 5 minutes on 2 cores)...", flush=True)
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        subprocess.run([target.python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"horovod=={HOROVOD_VERSION}", "-d", str(work)], check=True)
        unpack_sdist(work / f"horovod-{HOROVOD_VERSION}.tar.gz", work)
        src = work / f"horovod-{HOROVOD_VERSION}"
        raise_cxx_standard(src)
        nccl = nccl_of_torch(target, work) if "HOROVOD_GPU_OPERATIONS" in variant.env else {}
        env = {**os.environ, **variant.env, **nccl, "MAKEFLAGS": f"-j{os.cpu_count() or 1}"}
        proc = subprocess.run([target.python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                               "-w", str(work / "dist"), str(src)], env=env)
        if proc.returncode != 0:
            raise InstallError("building horovod failed (see the compiler output above).")
        built = next((work / "dist").glob("horovod-*.whl"))
        cache.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(str(built), cache / built.name))


def install(python: str, cache_root: Path) -> None:
    """Install horovod into ``python``'s environment, building the wheel first if the cache has none."""
    if horovod_installed(python):
        return
    target = probe(python)
    variant = choose_variant(target)
    cache = cache_dir(cache_root, target, variant)
    wheel = next(iter(sorted(cache.glob("horovod-*.whl"))), None) or build_wheel(target, variant, cache)
    subprocess.run([python, "-m", "pip", "install", "--quiet", str(wheel)], check=True)
    if not horovod_installed(python):
        raise InstallError(f"horovod was installed from {wheel} but 'import horovod.torch' fails in {python}.")


def default_cache() -> Path:
    if os.environ.get("HVD_WHEEL_CACHE"):
        return Path(os.environ["HVD_WHEEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "airflow-provider-hvd"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable, help="the environment's python (default: this one)")
    parser.add_argument("--cache", type=Path, default=default_cache(), help="where built wheels are kept")
    args = parser.parse_args(argv)
    try:
        install(args.python, args.cache)
    except (InstallError, subprocess.CalledProcessError) as exc:
        print(f"install_horovod: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
