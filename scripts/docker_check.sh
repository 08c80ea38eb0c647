#!/usr/bin/env bash
# docker/ built and run for real, as a user would: build the image, start the whole compose file (PostgreSQL,
# airflow-init, api-server, scheduler, dag-processor, triggerer, Spark master and 2 workers), wait for health,
# trigger horovod_train_example through the REST API and check its run (state, where the ranks ran, the rank
# lines in the task log, rank 0's XCom, the "Spark UI" link), mark a long training task failed and check that
# its ranks are gone from the workers, then tear everything down, volumes included.
#
#   scripts/docker_check.sh            (or: make docker-check)
#
# Runs with `docker compose` where Docker is installed, else with podman + podman-compose (>= 1.1: `name:`).
# Settings (environment):
#   TORCH_WHEELS=DIR   a directory holding the torch wheel, for builds without access to PyTorch's index
#                      (default: $PIP_FIND_LINKS when it is a directory with a torch 2.13.0 wheel; else the
#                      Dockerfile's TORCH_INDEX, PyTorch's CPU index)
#   TORCH_INDEX=URL    another index for torch (a mirror, a CUDA index)
#   TENSORFLOW=true    build the image with TensorFlow too (default false)
#   SKIP_BUILD=1       use the airflow-provider-hvd:local image already built
#   KEEP=1             leave the deployment running at the end (or after a failure) to look at it
#   LOG_DIR=DIR        where the build log and the containers' logs go (default: a new temporary directory)
#
# It needs the host ports the compose file publishes (8080, 8090, 7078-7081) and a python3 (for JSON).
set -euo pipefail
{  # read whole before it runs: an edit of this file during a run cannot change the run

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
COMPOSE_FILE=docker/docker-compose.yml
PROJECT=airflow-provider-hvd
IMAGE=airflow-provider-hvd:local
DAG=horovod_train_example
API=http://127.0.0.1:8080
MASTER_UI=http://127.0.0.1:8090
WORKERS=(spark-worker-1 spark-worker-2)
SERVICES=(postgres airflow-apiserver airflow-scheduler airflow-dag-processor airflow-triggerer spark-master
          "${WORKERS[@]}" spark-connect)
DURABLE_DAG=torch_durable_example  # on the Spark Connect server: a run that outlives its task
RANK_PROCESS=' -m airflow_provider_hvd\.runner\.rank$'  # the rank itself, not its reaper (whose args end alike)
LOG_DIR=${LOG_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/docker-check.XXXXXX")}
mkdir -p "$LOG_DIR"

say() { printf '[docker-check %s] %s\n' "$(date +%T)" "$*"; }
fail() { say "FAILED: $*" >&2; exit 1; }
now() { date +%s; }

# --- the engine ----------------------------------------------------------------------------------------------
if command -v docker >/dev/null && docker compose version >/dev/null 2>&1; then
  ENGINE=docker
  COMPOSE=(docker compose -p "$PROJECT" -f "$COMPOSE_FILE")
elif command -v podman >/dev/null; then
  ENGINE=podman
  pc=${PODMAN_COMPOSE:-${HVD_CTR:-/var/tmp/hvd-containers}/pc-venv/bin/podman-compose}
  [ -x "$pc" ] || pc=$(command -v podman-compose) || fail "podman is here but podman-compose is not: pip install podman-compose"
  # no pod: every service in a container of its own, on the project's network, as with Docker
  COMPOSE=("$pc" --in-pod false -p "$PROJECT" -f "$COMPOSE_FILE")
else
  fail "neither docker (with the compose plugin) nor podman is installed"
fi
command -v python3 >/dev/null || fail "python3 is needed to read the REST API's JSON"
command -v curl >/dev/null || fail "curl is needed to talk to the REST API"

compose() { "${COMPOSE[@]}" "$@"; }
container_of() {  # the container of a compose service, by the labels both docker compose and podman-compose set
  "$ENGINE" ps -a --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -n 1
}
project_containers() { "$ENGINE" ps -a -q --filter "label=com.docker.compose.project=$PROJECT"; }
project_volumes() { "$ENGINE" volume ls -q | grep -E "^${PROJECT}_" || true; }

healthy() {
  local c
  c=$(container_of "$1")
  [ -n "$c" ] || return 1
  if [ "$ENGINE" = podman ]; then
    # podman 4.3 runs no healthcheck by itself (it would need systemd timers): run it now
    "$ENGINE" healthcheck run "$c" >/dev/null 2>&1
  else
    [ "$("$ENGINE" inspect -f '{{.State.Health.Status}}' "$c" 2>/dev/null)" = healthy ]
  fi
}

wait_healthy() {  # wait_healthy TIMEOUT SERVICE...
  local timeout=$1 deadline pending s i pids
  shift
  deadline=$(( $(now) + timeout ))
  pending=("$@")
  while :; do
    pids=()
    for s in "${pending[@]}"; do healthy "$s" & pids+=($!); done  # at once: an airflow CLI check takes seconds
    local still=()
    for i in "${!pids[@]}"; do wait "${pids[$i]}" || still+=("${pending[$i]}"); done
    pending=(${still[@]+"${still[@]}"})
    [ ${#pending[@]} -eq 0 ] && return 0
    if [ "$(now)" -ge "$deadline" ]; then
      for s in "${pending[@]}"; do
        say "--- $s (not healthy), last lines of its log ---"
        "$ENGINE" logs --tail 30 "$(container_of "$s")" 2>&1 || true
      done
      fail "not healthy after ${timeout}s: ${pending[*]}"
    fi
    sleep 3
  done
}

save_logs() {
  local s c
  for s in airflow-init "${SERVICES[@]}"; do
    c=$(container_of "$s")
    [ -n "$c" ] && "$ENGINE" logs "$c" > "$LOG_DIR/$s.log" 2>&1 || true
  done
}

teardown() {
  local rc=$?
  if [ "${KEEP:-0}" = 1 ]; then
    say "KEEP=1: the deployment is still running; end it with: ${COMPOSE[*]} down -v"
    return
  fi
  [ -z "$(project_containers)" ] && [ -z "$(project_volumes)" ] && return
  [ "$rc" -ne 0 ] && save_logs && say "the containers' logs: $LOG_DIR"
  say "tearing down (containers, network, volumes)"
  compose down -v >"$LOG_DIR/down.log" 2>&1 || true
}

# --- the REST API ----------------------------------------------------------------------------------------------
json() {  # json EXPR: print EXPR of the JSON document on stdin (`d`), e.g. json 'd["state"]'
  python3 -c "import json, sys; d = json.load(sys.stdin); v = $1; print(v if isinstance(v, str) else json.dumps(v))"
}
quote() { python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "$1"; }
api() {  # api METHOD PATH [JSON BODY]
  curl -sS --fail-with-body -X "$1" -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' \
    -H 'Accept: application/json' ${3:+--data "$3"} "$API/api/v2$2"
}
run_path() { echo "/dags/$DAG/dagRuns/$(quote "$1")"; }
run_state() { api GET "$(run_path "$1")" | json 'd["state"]'; }
ti_state() { api GET "$(run_path "$1")/taskInstances/$2" | json 'd["state"]'; }

wait_for_run() {  # wait_for_run RUN_ID TIMEOUT: prints the final state
  local deadline state
  deadline=$(( $(now) + $2 ))
  while state=$(run_state "$1"); [ "$state" != success ] && [ "$state" != failed ]; do
    [ "$(now)" -lt "$deadline" ] || fail "run $1 still $state after $2s"
    sleep 2
  done
  echo "$state"
}

task_log_text() {  # task_log_text RUN_ID TASK: the task log's events, one a line
  api GET "$(run_path "$1")/taskInstances/$2/logs/1" |
    python3 -c 'import json, sys; print("\n".join(str(r.get("event", "")) for r in json.load(sys.stdin)["content"]))'
}

rank_processes() {  # rank_processes SERVICE: the rank processes running in its container, one a line
  "$ENGINE" exec "$(container_of "$1")" ps -eo pid=,args= | grep -E "$RANK_PROCESS" || true
}
runner_processes() {  # ranks and their reapers
  "$ENGINE" exec "$(container_of "$1")" ps -eo pid=,args= | grep -E 'airflow_provider_hvd[./]runner' || true
}
count_lines() { if [ -z "$1" ]; then echo 0; else printf '%s\n' "$1" | wc -l; fi; }
active_apps() { curl -sS "$MASTER_UI/json/" | json '[a["name"] for a in d["activeapps"]]'; }
# the training task's own application (the operator names it DAG.TASK); the Connect server's is active for as long
# as the server runs
task_apps() { curl -sS "$MASTER_UI/json/" | json "[a['name'] for a in d['activeapps'] if a['name'] == '$DAG.train']"; }

# --- before anything starts ---------------------------------------------------------------------------------------
[ -z "$(project_containers)" ] || fail "containers of $PROJECT exist already; end them first: ${COMPOSE[*]} down -v"
for port in 8080 8090 7078 7079 7080 7081; do
  if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
    fail "port $port of this host is taken; the compose file publishes it (stop what listens there)"
  fi
done
trap teardown EXIT
say "engine: $ENGINE ($("$ENGINE" --version | head -n 1)); compose: ${COMPOSE[0]}; logs: $LOG_DIR"

# --- 1. build -----------------------------------------------------------------------------------------------------
if [ -z "${TORCH_WHEELS:-}" ] && [ -z "${TORCH_INDEX:-}" ] && [ -d "${PIP_FIND_LINKS:-}" ] \
    && compgen -G "$PIP_FIND_LINKS/torch-2.13.0*.whl" >/dev/null; then
  TORCH_WHEELS=$PIP_FIND_LINKS
fi
build=("$ENGINE" build -t "$IMAGE" -f docker/Dockerfile --build-arg "TENSORFLOW=${TENSORFLOW:-false}")
if [ -n "${TORCH_WHEELS:-}" ]; then
  build+=(--build-context "torch-wheels=$TORCH_WHEELS" --build-arg TORCH_INDEX=)
  torch_from="the wheels in $TORCH_WHEELS"
elif [ -n "${TORCH_INDEX:-}" ]; then
  build+=(--build-arg "TORCH_INDEX=$TORCH_INDEX")
  torch_from=$TORCH_INDEX
else
  torch_from="the Dockerfile's TORCH_INDEX"
fi
build+=(.)
if [ "${SKIP_BUILD:-0}" = 1 ]; then
  "$ENGINE" image inspect "$IMAGE" >/dev/null 2>&1 || fail "SKIP_BUILD=1 but there is no image $IMAGE"
  say "build skipped (SKIP_BUILD=1)"
  build_s="(skipped)"
else
  say "building $IMAGE, torch from $torch_from (log: $LOG_DIR/build.log); 20-40 minutes on 2 cores"
  say "  ${build[*]}"
  t0=$(now)
  if ! "${build[@]}" >"$LOG_DIR/build.log" 2>&1; then
    tail -n 40 "$LOG_DIR/build.log" >&2
    fail "the build failed (log: $LOG_DIR/build.log)"
  fi
  build_s="$(( $(now) - t0 ))s"
  say "built in $build_s"
fi
image_mb=$(( $("$ENGINE" image inspect "$IMAGE" --format '{{.Size}}') / 1000000 ))
say "image $IMAGE: $image_mb MB"

# --- 2. start, in the order of the compose file's depends_on ---------------------------------------------------
# podman 4.3 skips `condition: service_healthy` (podman-compose needs podman >= 4.6 for it), and fails to start a
# container whose dependency depends on another ("not found in input list"): start each group of services
# without their dependencies (--no-deps), in the file's order, waiting for health here. Docker does the same.
t0=$(now)
up() { compose up -d --no-build --no-deps "$@" >>"$LOG_DIR/up.log" 2>&1 || { tail -n 40 "$LOG_DIR/up.log" >&2; fail "compose up $*"; }; }
say "starting postgres and spark-master"
up postgres spark-master
wait_healthy 180 postgres spark-master
say "running airflow-init (the database's migration)"
up airflow-init
init=$(container_of airflow-init)
init_rc=$("$ENGINE" wait "$init")
[ "$init_rc" = 0 ] || { "$ENGINE" logs --tail 40 "$init" >&2; fail "airflow-init exited with $init_rc"; }
say "starting the Airflow components and the Spark workers"
up airflow-apiserver airflow-scheduler airflow-dag-processor airflow-triggerer "${WORKERS[@]}"
# the Spark Connect server once both workers have registered, as its depends_on says: the master spreads its
# executors over both then, and each worker keeps a core for the classic jobs (one rank on each)
deadline=$(( $(now) + 420 ))
until [ "$(curl -sS "$MASTER_UI/json/" 2>/dev/null | json 'd["aliveworkers"]' 2>/dev/null)" = 2 ]; do
  [ "$(now)" -lt "$deadline" ] || fail "fewer than 2 Spark workers registered with the master after 420s"
  sleep 2
done
say "2 Spark workers registered; starting spark-connect"
up spark-connect
wait_healthy 420 "${SERVICES[@]}"
healthy_s=$(( $(now) - t0 ))
say "all ${#SERVICES[@]} services healthy ${healthy_s}s after the start"

# --- 3. the REST API: log in, wait for the DAG and the workers ---------------------------------------------------
password=${AIRFLOW_ADMIN_PASSWORD:-}
[ -n "$password" ] || [ ! -f docker/.env ] || password=$(sed -n 's/^AIRFLOW_ADMIN_PASSWORD=//p' docker/.env | tail -n 1)
TOKEN=$(curl -sS --fail-with-body -X POST "$API/auth/token" -H 'Content-Type: application/json' \
  --data "{\"username\": \"admin\", \"password\": \"${password:-admin}\"}" | json 'd["access_token"]')
deadline=$(( $(now) + 180 ))
until api GET "/dags/$DAG" >/dev/null 2>&1; do
  [ "$(now)" -lt "$deadline" ] || fail "the dag-processor has not parsed $DAG after 180s"
  sleep 2
done
until [ "$(curl -sS "$MASTER_UI/json/" | json 'd["aliveworkers"]')" = 2 ]; do
  [ "$(now)" -lt "$deadline" ] || fail "fewer than 2 Spark workers registered with the master"
  sleep 2
done
ready_s=$(( $(now) - t0 ))
say "$DAG parsed and 2 Spark workers registered ${ready_s}s after the start"
api PATCH "/dags/$DAG" '{"is_paused": false}' >/dev/null  # DAGs are paused at creation in this compose file

# --- 4. a training run ----------------------------------------------------------------------------------------------
t0=$(now)
run_id=$(api POST "/dags/$DAG/dagRuns" '{"logical_date": null}' | json 'd["dag_run_id"]')
say "triggered $DAG: run $run_id"
state=$(wait_for_run "$run_id" 900)
run_s=$(( $(now) - t0 ))
train_s=$(api GET "$(run_path "$run_id")/taskInstances/train" | json 'round(d["duration"] or 0, 1)')
log_text=$(task_log_text "$run_id" train)
if [ "$state" != success ]; then
  printf '%s\n' "$log_text" | tail -n 60 >&2
  fail "run $run_id ended $state (the train task's log above)"
fi
say "run $run_id: $state in ${run_s}s (trigger to end; the train task ${train_s}s)"

# the value as stored (JSON), or its string form where the API stringifies it
xcom=$(api GET "$(run_path "$run_id")/taskInstances/train/xcomEntries/return_value" |
  json '__import__("ast").literal_eval(d["value"]) if isinstance(d["value"], str) else d["value"]')
say "rank 0's XCom: $xcom"
rank_hosts=$(printf '%s' "$xcom" | json '" ".join(sorted(d["hosts"]))')
printf '%s' "$xcom" | json 'd["ranks"] == 2 and d["accuracy"] >= 0.8' | grep -qx true \
  || fail "rank 0's XCom is not 2 ranks' trained model: $xcom"
worker_hosts=$(for w in "${WORKERS[@]}"; do "$ENGINE" exec "$(container_of "$w")" cat /proc/sys/kernel/hostname; done | sort | xargs)
scheduler_host=$("$ENGINE" exec "$(container_of airflow-scheduler)" cat /proc/sys/kernel/hostname)
[ "$rank_hosts" = "$worker_hosts" ] \
  || fail "the ranks ran on [$rank_hosts], not one on each Spark worker [$worker_hosts] (scheduler: $scheduler_host)"
say "the ranks ran on [$rank_hosts] = the hostnames of ${WORKERS[*]} (the scheduler's: $scheduler_host)"

for line in "[rank 0] epoch 1/8: loss=" "[rank 0] epoch 8/8: loss=" "HorovodRunner: 2 ranks started"; do
  grep -qF "$line" <<<"$log_text" || { printf '%s\n' "$log_text" | tail -n 60 >&2; fail "no '$line' in the train task's log"; }
done
say "the train task's log has the rank lines, e.g.: $(grep -F '[rank 0] epoch 8/8' <<<"$log_text" | head -n 1)"

link=$(api GET "$(run_path "$run_id")/taskInstances/train/links" | json 'd["extra_links"]["Spark UI"]')
case "$link" in http://spark-master:8090/*) ;; *) fail "the Spark UI link is $link, not the master's page" ;; esac
# from this host the master's name resolves as /etc/hosts would make it (docs/docker.md): to the published port
page=$(curl -sS --fail --resolve spark-master:8090:127.0.0.1 "$link") || fail "the Spark UI link $link does not answer"
grep -qF "$DAG.train" <<<"$page" || fail "the Spark UI link $link does not show the application $DAG.train"
say "the Spark UI link answers: $link"

# --- 4b. a run that outlives its task, on the Spark Connect server -------------------------------------------------
api PATCH "/dags/$DURABLE_DAG" '{"is_paused": false}' >/dev/null
durable_id=$(api POST "/dags/$DURABLE_DAG/dagRuns" '{"logical_date": null}' | json 'd["dag_run_id"]')
durable_state=$(DAG=$DURABLE_DAG wait_for_run "$durable_id" 900)
durable_log=$(DAG=$DURABLE_DAG task_log_text "$durable_id" train)
[ "$durable_state" = success ] || { printf '%s\n' "$durable_log" | tail -n 60 >&2; fail "$DURABLE_DAG ended $durable_state"; }
grep -qF "Submitted the run: {" <<<"$durable_log" || fail "$DURABLE_DAG's train task did not submit its run (durable)"
say "$DURABLE_DAG: $durable_state, its run submitted to the Spark Connect server (durable)"

# --- 5. a long training task marked failed: its ranks end on the workers ---------------------------------------
long_id=$(api POST "/dags/$DAG/dagRuns" '{"logical_date": null, "conf": {"epochs": 100000}}' | json 'd["dag_run_id"]')
say "triggered a long run (100000 epochs): $long_id; waiting for its ranks"
deadline=$(( $(now) + 600 ))
while :; do
  on_workers=0
  for w in "${WORKERS[@]}"; do [ "$(count_lines "$(rank_processes "$w")")" -ge 1 ] && on_workers=$((on_workers + 1)); done
  [ "$on_workers" = 2 ] && break
  [ "$(now)" -lt "$deadline" ] || fail "the long run's ranks did not start on both workers in 600s ($(run_state "$long_id"))"
  sleep 2
done
[ "$(count_lines "$(rank_processes airflow-scheduler)")" = 0 ] || fail "rank processes run in the scheduler's container"
say "a rank process runs in each of ${WORKERS[*]}, none in airflow-scheduler; Spark apps: $(active_apps)"
api PATCH "$(run_path "$long_id")/taskInstances/train" '{"new_state": "failed"}' >/dev/null
t0=$(now)
deadline=$(( t0 + 60 ))
while left=$(for w in "${WORKERS[@]}"; do runner_processes "$w"; done); [ -n "$left" ] || [ "$(task_apps)" != "[]" ]; do
  [ "$(now)" -lt "$deadline" ] || fail "60s after the task was marked failed, still running: ${left:-(no process)}; its Spark app: $(task_apps)"
  sleep 1
done
gone_s=$(( $(now) - t0 ))
long_state=$(wait_for_run "$long_id" 120)
[ "$long_state" = failed ] || fail "the run whose task was marked failed ended $long_state"
say "marked failed: its ranks and reapers were gone from both workers and its Spark app ($DAG.train) from the master in ${gone_s}s; run $long_state; Spark apps: $(active_apps)"

# --- 6. tear down ------------------------------------------------------------------------------------------------
if [ "${KEEP:-0}" != 1 ]; then
  trap - EXIT
  save_logs
  t0=$(now)
  compose down -v >"$LOG_DIR/down.log" 2>&1 || { cat "$LOG_DIR/down.log" >&2; fail "compose down -v"; }
  [ -z "$(project_containers)" ] || fail "containers of $PROJECT are left after down -v"
  [ -z "$(project_volumes)" ] || fail "volumes of $PROJECT are left after down -v: $(project_volumes | xargs)"
  say "torn down in $(( $(now) - t0 ))s: no container, no volume of $PROJECT left"
fi

cat <<EOF
docker-check passed ($ENGINE)
  build:           $build_s (torch from $torch_from)
  image:           $IMAGE, $image_mb MB
  start → healthy: ${healthy_s}s (${#SERVICES[@]} services), DAG parsed and workers registered: ${ready_s}s
  DAG run:         $state in ${run_s}s from the trigger (train task ${train_s}s)
  ranks ran on:    $rank_hosts (the Spark workers' containers; the scheduler's is $scheduler_host)
  marked failed:   ranks gone from the workers in ${gone_s}s
EOF
exit 0
}
