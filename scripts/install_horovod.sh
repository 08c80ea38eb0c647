#!/usr/bin/env bash
# Installs horovod 0.28.1 (PyTorch + Gloo, no MPI) into the venv whose python is $1.
#
# horovod 0.28.1 is the last release and, as published, does not build against torch >= 2.1 (torch needs
# C++17). We build its PyPI sdist with CMAKE_CXX_STANDARD raised to 17 and cache the wheel outside the
# repository, keyed by horovod, torch and Python versions, so that only the first run pays the ~5 minutes.
set -euo pipefail

PY=${1:?usage: install_horovod.sh PATH/TO/venv/bin/python}
HOROVOD_VERSION=0.28.1
CACHE_ROOT=${HVD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/airflow-provider-hvd}

die() { echo "install_horovod: $*" >&2; exit 1; }

if "$PY" -c "import horovod.torch, sys; sys.exit(0 if horovod.__version__ == '$HOROVOD_VERSION' else 1)" 2>/dev/null; then
  exit 0
fi

command -v cmake >/dev/null || die "cmake is missing; install it (Debian: apt-get install cmake) and run again."
command -v g++ >/dev/null || die "a C++17 compiler is missing; install g++ >= 9 (Debian: apt-get install g++) and run again."
TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__.replace('+', '_'))") \
  || die "torch must be installed in the venv before horovod (it is built against it)."
PY_TAG=$("$PY" -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
CACHE="$CACHE_ROOT/horovod-$HOROVOD_VERSION-torch-$TORCH_VERSION-$PY_TAG"

wheel=$(ls "$CACHE"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
  echo "install_horovod: building horovod $HOROVOD_VERSION against torch $TORCH_VERSION (about 5 minutes on 2 cores)..."
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download --quiet --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
  tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 14' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt" \
    && die "could not raise the C++ standard in horovod's CMakeLists.txt"
  mkdir -p "$CACHE"
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
    "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$work/dist" "$src" \
    || die "building horovod failed (see the compiler output above)."
  mv "$work"/dist/horovod-*.whl "$CACHE/"
  wheel=$(ls "$CACHE"/horovod-*.whl | head -n 1)
fi
"$PY" -m pip install --quiet "$wheel"
"$PY" -c "import horovod.torch" || die "horovod installed but 'import horovod.torch' fails."
