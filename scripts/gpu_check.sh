#!/usr/bin/env bash
# On a machine with NVIDIA GPUs and a CUDA toolkit (nvcc): build Horovod with NCCL against a CUDA build of torch
# in its own venv, then allreduce CUDA tensors across every local GPU through HorovodRunner(np=-N).
#
#   scripts/gpu_check.sh            # venv in .venv-gpu (kept for the next run), wheel cached as usual
#
# It prints what each rank saw (CUDA_VISIBLE_DEVICES, its device) and the allreduced values, and exits non-zero
# if any rank's result is wrong.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${GPU_VENV:-$ROOT/.venv-gpu}
PYTHON=${PYTHON:-python3}

command -v nvidia-smi >/dev/null || { echo "gpu_check: no nvidia-smi: this machine has no NVIDIA driver" >&2; exit 2; }
command -v nvcc >/dev/null || { echo "gpu_check: no nvcc: install a CUDA toolkit to build Horovod with NCCL" >&2; exit 2; }
nvidia-smi -L

test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
# PyPI's torch for Linux x86_64 is the CUDA build; the constraints pin the rest as `make setup` does
PIP_CONSTRAINT="$ROOT/constraints.txt" $PIP install --upgrade pip setuptools wheel packaging
$PIP install "torch==2.13.0"
"$VENV/bin/python" -c "import torch, sys; print('torch', torch.__version__, 'CUDA', torch.version.cuda); sys.exit(not torch.cuda.is_available())" \
  || { echo "gpu_check: this torch cannot use the GPUs" >&2; exit 2; }
PIP_CONSTRAINT="$ROOT/constraints.txt" "$VENV/bin/python" "$ROOT/scripts/install_horovod.py" --python "$VENV/bin/python"
PIP_CONSTRAINT="$ROOT/constraints.txt" $PIP install -e "$ROOT"
"$VENV/bin/python" -c "import horovod.torch as hvd; import sys; print('horovod NCCL built:', hvd.nccl_built()); sys.exit(not hvd.nccl_built())"

"$VENV/bin/python" - <<'EOF'
import os
import sys

import torch

from airflow_provider_hvd import HorovodRunner


def allreduce_on_gpus() -> list:
    import os

    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    value = torch.full((1024, 1024), float(hvd.rank() + 1), device="cuda")
    total = hvd.allreduce(value, op=hvd.Sum, name="sum")
    seen = (hvd.rank(), os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.current_device(),
            torch.cuda.get_device_name(), float(total[0, 0]))
    return hvd.allgather_object(seen)


gpus = torch.cuda.device_count()
results = HorovodRunner(np=-gpus).run(allreduce_on_gpus)
expected = gpus * (gpus + 1) / 2
for rank, visible, device, name, value in results:
    print(f"rank {rank}: CUDA_VISIBLE_DEVICES={visible} cuda:{device} {name}: allreduced {value} (expected {expected})")
sys.exit(0 if all(value == expected for *_, value in results) else 1)
EOF
