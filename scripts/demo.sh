#!/usr/bin/env bash
# The demo: an Airflow home in the repo (SQLite), spark_default on local[*], `airflow dags test` of the
# example DAG, then rank 0's result as the train task's XCom.
set -euo pipefail
PY=${1:?usage: demo.sh PATH/TO/venv/bin/python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=$(dirname "$PY")
export AIRFLOW_HOME=${AIRFLOW_HOME:-$ROOT/airflow_home}
export AIRFLOW__CORE__DAGS_FOLDER=$ROOT/dags
export AIRFLOW__CORE__LOAD_EXAMPLES=False
export AIRFLOW_CONN_SPARK_DEFAULT='{"conn_type": "spark", "host": "local[*]"}'
export SPARK_LOCAL_IP=${SPARK_LOCAL_IP:-127.0.0.1}
mkdir -p "$AIRFLOW_HOME"
"$BIN/airflow" db migrate >"$AIRFLOW_HOME/db-migrate.log" 2>&1 || { cat "$AIRFLOW_HOME/db-migrate.log"; exit 1; }
"$BIN/airflow" dags test horovod_train_example
"$PY" "$ROOT/scripts/show_result.py" horovod_train_example train
