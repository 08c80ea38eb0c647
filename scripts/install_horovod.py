#!/usr/bin/env python3
"""Build horovod 0.28.1 (once, cached) and install it into a Python environment that already has torch.

    python scripts/install_horovod.py [--python /path/to/venv/bin/python]

Used by `make setup` and by docker/Dockerfile; runs on the standard library alone, so it also works in an
existing Airflow deployment before this package is installed (see the README).

horovod 0.28.1 is the last release and, as published, does not build against torch >= 2.1 (torch's headers
need C++17). Its PyPI sdist is built with CMAKE_CXX_STANDARD raised to 17, with PyTorch and Gloo and without
MPI or MXNet; with NCCL for GPU tensors too (HOROVOD_GPU_OPERATIONS=NCCL) when a CUDA toolkit (nvcc) and a
CUDA build of torch are found, linked against the NCCL that torch brings.

With TensorFlow too, in the same wheel, when the environment has TensorFlow (unless HOROVOD_WITHOUT_TENSORFLOW=1;
CPU builds only). Three changes to horovod's source make it build and work with TensorFlow 2.21 (docs/tensorflow.md):
- ``xla_mpi_ops.cc`` is left out of ``horovod/tensorflow/CMakeLists.txt``: it does not compile against TF 2.21's
  XLA headers, and in a CPU build its whole body is under ``#if HAVE_GPU`` anyway.
- horovod's Keras modules take ``keras`` from ``tensorflow`` (``tf.keras``: tf-keras, Keras 2, when
  TF_USE_LEGACY_KERAS=1) instead of the standalone ``keras`` package, which is Keras 3 with TF >= 2.16 and
  breaks ``MetricAverageCallback`` (``keras.backend`` has no ``constant``).
- ``DistributedOptimizer`` given a Keras 3 optimizer says that horovod's Keras integration needs Keras 2 and
  what to use, instead of failing later with ``'Variable' object has no attribute 'ref'``.

The wheel is cached outside the repository under ``$HVD_WHEEL_CACHE`` (default ``~/.cache/airflow-provider-hvd``)
in a folder named by horovod's, torch's, TensorFlow's (if any) and Python's versions and the build variant
(``cpu``, ``cuda12.8``), so that only the first run pays the build: 3 minutes on 2 cores, 4 with TensorFlow
(measured with the machine shared: 181 s and 233 s).
"""

from __future__ import annotations

import argparse
import os
import re
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
    tf_version: str | None = None  # tensorflow.__version__ if horovod is built with TensorFlow too, e.g. "2.21.0"


@dataclass(frozen=True)
class Variant:
    """What horovod is built with: its name is part of the wheel cache key ("cpu", later "cuda12.4")."""

    name: str
    env: dict[str, str] = field(default_factory=dict)  # HOROVOD_* build switches


def cpu_variant(tensorflow: bool = False) -> Variant:
    return Variant(
        "cpu",
        {
            "HOROVOD_WITH_PYTORCH": "1",
            "HOROVOD_WITH_GLOO": "1",
            "HOROVOD_WITHOUT_MPI": "1",
            "HOROVOD_WITH_TENSORFLOW" if tensorflow else "HOROVOD_WITHOUT_TENSORFLOW": "1",
            "HOROVOD_WITHOUT_MXNET": "1",
        },
    )


def nccl_variant(target: Target) -> Variant:
    """Gloo for CPU tensors, NCCL for GPU tensors (shared NCCL: the one torch loads)."""
    return Variant(
        f"cuda{target.torch_cuda}",
        {**cpu_variant().env, "HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_NCCL_LINK": "SHARED"},
    )


def choose_variant(target: Target) -> Variant:
    """NCCL when a CUDA toolkit (nvcc) and a CUDA build of torch are found, else the CPU build (Gloo).

    With TensorFlow when ``target`` has it; CPU builds only (see :func:`drop_xla_ops`).
    """
    if target.torch_cuda and shutil.which("nvcc"):
        if target.tf_version:
            raise InstallError(
                f"a GPU (NCCL) build of horovod with TensorFlow is not supported: horovod {HOROVOD_VERSION}'s "
                f"xla_mpi_ops.cc does not compile against TensorFlow {target.tf_version}'s headers. Set "
                "HOROVOD_WITHOUT_TENSORFLOW=1 to build it for PyTorch only (with NCCL), or uninstall tensorflow."
            )
        return nccl_variant(target)
    return cpu_variant(tensorflow=target.tf_version is not None)


def nccl_of_torch(target: Target, work: Path) -> dict[str, str]:
    """Build settings that point Horovod at the NCCL torch brought (pip's nvidia-nccl-cu*), unless told otherwise."""
    if not target.nccl_dir or os.environ.get("HOROVOD_NCCL_HOME"):
        return {}
    lib = work / "nccl-lib"  # the package has libnccl.so.2 only; CMake's find_library(nccl) needs libnccl.so
    lib.mkdir()
    (lib / "libnccl.so").symlink_to(Path(target.nccl_dir, "lib", "libnccl.so.2"))
    return {"HOROVOD_NCCL_INCLUDE": str(Path(target.nccl_dir, "include")), "HOROVOD_NCCL_LIB": str(lib)}


def with_tensorflow() -> bool:
    """False when the user asked for a build without TensorFlow (horovod's own switch)."""
    return os.environ.get("HOROVOD_WITHOUT_TENSORFLOW", "") != "1"


def last_line(proc: subprocess.CompletedProcess) -> str:
    return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit status {proc.returncode}"


def probe_tensorflow(python: str) -> str | None:
    """TensorFlow's version in ``python``'s environment, or None if it has none (or it is not wanted)."""
    if not with_tensorflow():
        return None
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('tensorflow') is None)"
    if subprocess.run([python, "-c", code], capture_output=True).returncode != 0:
        return None
    proc = subprocess.run(
        [python, "-c", "import tensorflow; print(tensorflow.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    if proc.returncode != 0:
        raise InstallError(
            f"tensorflow is installed in {python}'s environment but does not import "
            f"({last_line(proc)}); repair it, or set HOROVOD_WITHOUT_TENSORFLOW=1 to build horovod "
            "for PyTorch only."
        )
    return proc.stdout.strip().splitlines()[-1]


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
        raise InstallError(
            f"torch must be installed in {python}'s environment before horovod (it is built against "
            f"it): {last_line(proc)}"
        )
    torch_version, cuda, py_tag, nccl_dir = proc.stdout.split("\n")[:4]
    return Target(python, torch_version, cuda or None, py_tag, nccl_dir or None, probe_tensorflow(python))


def cache_dir(root: Path, target: Target, variant: Variant) -> Path:
    torch = target.torch_version.replace("+", "_")
    tensorflow = f"-tf-{target.tf_version.replace('+', '_')}" if target.tf_version else ""
    return root / f"horovod-{HOROVOD_VERSION}-torch-{torch}{tensorflow}-{target.py_tag}-{variant.name}"


def horovod_import_error(python: str) -> str | None:
    """Why horovod does not import for torch (and TensorFlow, if the environment has it); None if it does."""
    check = (
        "import importlib.util, sys\n"
        "import horovod.torch\n"
        f"if {with_tensorflow()} and importlib.util.find_spec('tensorflow') is not None:\n"
        "    import horovod.tensorflow\n"
        "import horovod\n"
        f"if horovod.__version__ != {HOROVOD_VERSION!r}:\n"
        f"    sys.exit('horovod ' + horovod.__version__ + ' is installed, not {HOROVOD_VERSION}')"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = subprocess.run([python, "-c", check], capture_output=True, text=True, env=env)
    return None if proc.returncode == 0 else last_line(proc)


def horovod_installed(python: str) -> bool:
    """horovod is installed for torch, and for TensorFlow too if the environment has it."""
    return horovod_import_error(python) is None


def install_wheel(python: str, wheel: Path) -> None:
    """Install ``wheel`` with its dependencies, replacing any installed horovod (even of the same version)."""
    # An installed horovod of the same version but another variant (built before TensorFlow was installed, say)
    # would be kept by a plain install; --force-reinstall would reinstall its dependencies too, and --no-deps
    # would leave a fresh environment without them (cloudpickle, psutil, ...). So: remove it, then install.
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "uninstall", "--quiet", "--yes", "horovod"], check=True, capture_output=True)
    subprocess.run([*pip, "install", "--quiet", str(wheel)], check=True)


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
        raise InstallError(
            f"Python's headers are missing ({missing}/Python.h); install them (Debian, Ubuntu: "
            f"apt-get install python{version}-dev) and run again."
        )


def raise_cxx_standard(src: Path) -> None:
    for name in CMAKE_FILES:
        path = src / name
        text = path.read_text()
        path.write_text(text.replace("set(CMAKE_CXX_STANDARD 14)", "set(CMAKE_CXX_STANDARD 17)"))
        if "CMAKE_CXX_STANDARD 14" in path.read_text():
            raise InstallError(f"could not raise the C++ standard in horovod's {name}")


def replace_exactly(path: Path, old: str, new: str, count: int = 1) -> None:
    """Replace ``old`` (found ``count`` times) in ``path``, or fail: the sdist is not the one expected."""
    text = path.read_text()
    if text.count(old) != count:
        raise InstallError(
            f"horovod's {path.name} is not as expected ({old.strip()!r} found {text.count(old)} "
            f"times, not {count}); is this horovod {HOROVOD_VERSION}'s sdist?"
        )
    path.write_text(text.replace(old, new))


def drop_xla_ops(src: Path) -> None:
    """Leave xla_mpi_ops.cc out of the TensorFlow library (CPU builds: its body is all under ``#if HAVE_GPU``).

    It does not compile against TF 2.21's XLA headers (highwayhash headers missing, xla_builder.h moved).
    """
    replace_exactly(
        src / "horovod/tensorflow/CMakeLists.txt",
        'list(APPEND TF_SOURCES "${PROJECT_SOURCE_DIR}/horovod/tensorflow/xla_mpi_ops.cc")\n',
        "",
    )


# horovod's Keras modules import the standalone keras package: Keras 3 with TF >= 2.16, which they do not support
KERAS_MODULES = (
    "horovod/tensorflow/keras/__init__.py",
    "horovod/tensorflow/keras/callbacks.py",
    "horovod/keras/__init__.py",
    "horovod/keras/callbacks.py",
    "horovod/keras/elastic.py",
)
KERAS_IMPORTS = (  # (pattern, replacement) for whole lines
    (re.compile(r"^import keras$", re.MULTILINE), "from tensorflow import keras"),
    (re.compile(r"^import keras\.backend as K$", re.MULTILINE), "K = keras.backend"),
    (re.compile(r"^(\s+)from keras import backend as K$", re.MULTILINE), r"\1K = keras.backend"),
)


def keras_from_tensorflow(src: Path) -> None:
    """Make horovod's Keras modules use ``tf.keras`` (tf-keras under TF_USE_LEGACY_KERAS=1), not ``keras``."""
    for name in KERAS_MODULES:
        path = src / name
        text = path.read_text()
        for pattern, replacement in KERAS_IMPORTS:
            text = pattern.sub(replacement, text)
        if re.search(r"^\s*(import keras|from keras)\b", text, re.MULTILINE):
            raise InstallError(f"horovod's {name} still imports the standalone keras package after patching")
        path.write_text(text)


# create_distributed_optimizer subclasses the optimizer's class: with a Keras 3 one it fails only later, at
# var.ref(); this says why at once, and what to use instead.
KERAS3_CHECK = """    if type(optimizer).__module__.split(".")[0] == "keras" and \\
            int(getattr(__import__("sys").modules.get("keras"), "__version__", "2").split(".")[0]) >= 3:
        raise TypeError(
            f"horovod's DistributedOptimizer needs a Keras 2 optimizer, but got Keras 3's "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}. Build the model and its optimizer with "
            f"tf.keras (tf.keras.optimizers.SGD(...), not keras.optimizers from `import keras`), with the "
            f"tf-keras package installed and TF_USE_LEGACY_KERAS=1 set before TensorFlow is imported "
            f"(HorovodRunner sets it on every rank unless you set it yourself).")
"""
OPTIMIZER_DEF = "                                 scale_local_gradients=True):\n"


def explain_keras3_optimizer(src: Path) -> None:
    replace_exactly(src / "horovod/_keras/__init__.py", OPTIMIZER_DEF, OPTIMIZER_DEF + KERAS3_CHECK)


def patch_for_tensorflow(src: Path) -> None:
    """The changes a TensorFlow 2.21 build needs (module docstring)."""
    drop_xla_ops(src)
    keras_from_tensorflow(src)
    explain_keras3_optimizer(src)


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
                raise InstallError(
                    f"{archive.name} is not a plain source archive: {member.name!r} would be "
                    f"extracted outside {dest} (or is a device)"
                )
        sdist.extractall(dest)


def build_wheel(target: Target, variant: Variant, cache: Path) -> Path:
    check_toolchain()
    check_python_headers(target)
    frameworks = f"torch {target.torch_version}" + (f" and TensorFlow {target.tf_version}" if target.tf_version else "")
    minutes = 4 if target.tf_version else 3  # measured on 2 cores (the module's docstring)
    print(
        f"install_horovod: building horovod {HOROVOD_VERSION} ({variant.name}) against {frameworks} "
        f"(about {minutes} minutes on 2 cores)...",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as work_dir:
        work = Path(work_dir)
        subprocess.run(
            [
                target.python,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"horovod=={HOROVOD_VERSION}",
                "-d",
                str(work),
            ],
            check=True,
        )
        unpack_sdist(work / f"horovod-{HOROVOD_VERSION}.tar.gz", work)
        src = work / f"horovod-{HOROVOD_VERSION}"
        raise_cxx_standard(src)
        if target.tf_version:
            patch_for_tensorflow(src)
        nccl = nccl_of_torch(target, work) if "HOROVOD_GPU_OPERATIONS" in variant.env else {}
        env = {**os.environ, **variant.env, **nccl, "MAKEFLAGS": f"-j{os.cpu_count() or 1}"}
        proc = subprocess.run(
            [
                target.python,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-build-isolation",
                "-w",
                str(work / "dist"),
                str(src),
            ],
            env=env,
        )
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
    install_wheel(python, wheel)
    error = horovod_import_error(python)
    if error is not None:
        modules = "horovod.torch and horovod.tensorflow" if target.tf_version else "horovod.torch"
        raise InstallError(f"horovod was installed from {wheel} but importing {modules} fails in {python}: {error}")


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
