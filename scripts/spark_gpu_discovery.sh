#!/usr/bin/env bash
# Spark GPU discovery script (spark.worker.resource.gpu.discoveryScript, spark.executor.resource.gpu.discoveryScript):
# prints the GPUs this host (or container) sees as Spark's ResourceInformation JSON, e.g.
#   {"name": "gpu", "addresses": ["0", "1"]}
# It lists nvidia-smi's GPU indexes, restricted to CUDA_VISIBLE_DEVICES when that is set (numeric form).
set -euo pipefail
indexes=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr -d ' ' || true)
if [ -n "${CUDA_VISIBLE_DEVICES+x}" ]; then
  indexes=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | tr -d ' ')
fi
addresses=$(echo "$indexes" | sed '/^$/d' | sed 's/.*/"&"/' | paste -sd, -)
echo "{\"name\": \"gpu\", \"addresses\": [${addresses}]}"
