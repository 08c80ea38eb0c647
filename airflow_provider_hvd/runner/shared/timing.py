"""The runner's timings that depend on each other, in one place, each with its reason (driver and agents).

Where one is used it is imported from here; tests that shorten one patch it where it is used. The relations
below are checked in ``tests/test_timing.py``; the threads that wait on them are in ``docs/internals.md``.
"""

from __future__ import annotations

# Not here: the reaper's two graces, TERMINATE_GRACE_S (a rank's time to end after SIGTERM) and LEFTOVER_GRACE_S
# (what a rank left running, once it exited). The reaper runs as a plain script (``python -I -S reaper.py``,
# standard library only) and cannot import this module; this one does not import it either, so that a rank
# process, which imports ..shared, does not load it.

# -- the link between the driver and each agent --------------------------------------------------------------

# Heartbeats, each way (..shared.liveness; spark.horovodRunner.heartbeatInterval/-Timeout override them): a
# link silent for the timeout is cut. The timeout spans at least MIN_BEATS_PER_TIMEOUT intervals, so one late
# beat ends no healthy link, and stays well below Gloo's own timeout, so that a vanished host is named as the
# cause before the ranks' collectives fail with a Gloo error that blames a healthy peer.
HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TIMEOUT_S = 10.0
MIN_BEATS_PER_TIMEOUT = 3
GLOO_DEFAULT_TIMEOUT_S = 30.0  # Horovod's HOROVOD_GLOO_TIMEOUT_SECONDS when the driver's environment has none

# A connection must prove the run's secret within this (both sides): an unproven one costs the driver a socket
# for at most this long; an agent's handshake with a live driver takes milliseconds.
HANDSHAKE_TIMEOUT_S = 10.0

# An agent's TCP connect to the driver: a Spark task may start on an executor whose route to the driver is
# still coming up; after this the task fails and the run's start fails with it.
CONNECT_TIMEOUT_S = 30.0

# A Start or an Abort written to an agent that reads nothing (its host gone, its link cut) gives up after this;
# the heartbeat timeout names such an agent first.
SEND_TIMEOUT_S = 30.0

# -- how a run starts -----------------------------------------------------------------------------------------

# start_timeout's default: every rank's agent has connected and said hello within this (its Spark task has its
# slot and reaches the driver). A DataFrame's rows are not counted in it: the time Spark spends computing them for
# the barrier job and streaming them into the shards goes by before the ranks' clock starts (docs/dataframes.md).
DEFAULT_START_TIMEOUT_S = 120.0

# A barrier task streaming its rows into its ranks' shards tells the driver how far it got at most this often
# (and once it is done): the driver's log of the DataFrame's progress, and its start clock, read these reports.
FEED_REPORT_S = 2.0

# A Spark Connect server reports an operation's progress (its stages' tasks) every
# spark.connect.progress.reportInterval, 2 s by default: until its first report, at most this long, the barrier
# job's operation counts as at work on a DataFrame's rows (else a short start_timeout would run out before the
# server said a word).
CONNECT_FIRST_PROGRESS_S = 5.0

# While a DataFrame's rows are prepared (counted, computed for the barrier job, streamed into the shards), the
# driver logs how far they got this often: a real table takes minutes, and the log must not look hung.
FEED_LOG_S = 10.0

# -- how a run ends -------------------------------------------------------------------------------------------

# After the first failure, the reports racing it are awaited this long before the cause is named: the failing
# rank's own report comes within milliseconds of its peers' shutdown errors (they follow it), but behind them
# often enough; 1 s covers that on a loaded host and delays the end of a failed run by 1 s.
SETTLE_S = 1.0

# A Spark task that failed is a cause only this long after Spark said so: its agent's connection ends about
# then, and that names the rank (a lost agent) rather than the task.
LAUNCH_FAILURE_SETTLE_S = 1.0

# Once the cause is named, the driver waits this long for the other ranks to end: their agents' SIGTERM grace
# (TERMINATE_GRACE_S, then SIGKILL), what the ranks left running (LEFTOVER_GRACE_S), and some margin.
ABORT_WAIT_S = 15.0

# Once every rank of a run has succeeded, its launch's end is waited for this long (a Spark barrier job's tasks
# end moments after their agents' reports), still hearing hellos: a task's own agent that comes late, after an
# intruder took its place, fails the run before rank 0's result is read (docs/security.md). Then the run goes on.
LAUNCH_END_WAIT_S = 30.0

# A successful run's job broadcast is destroyed with each executor's answer awaited (none is still on its way when
# the application stops), but this long at most: an executor whose host vanished answers only at Spark's ask
# timeout (spark.rpc.askTimeout, 120 s by default), and Spark asks it until it declares it lost. A live executor
# answers within moments, a second or two on a loaded host. Below LAUNCH_END_WAIT_S, which covers this wait.
BROADCAST_DROP_WAIT_S = 10.0

# A rank that reported its error but does not exit (a thread main left running) is ended after this. A rank
# whose main returned is waited for instead: its exit work gets exit_timeout, once every rank returned.
EXIT_AFTER_REPORT_S = 10.0

# exit_timeout's default: atexit handlers, an experiment tracker's flush, DataLoader workers and TensorBoard
# writers after main returned; generous, since the run has already succeeded by then.
DEFAULT_EXIT_TIMEOUT_S = 120.0

# At the run's end, the progress still due (the last checkpoint and metrics) is tried once more, and the outcome
# waits at most this on the progress sink (Airflow's client retries for minutes while its API server is
# unreachable); then the write in progress is abandoned with one warning.
FINAL_WRITE_S = 5.0

# The most an agent waits, once done, for the driver to have its report (it closes its end then): the end of a
# large result may still be on its way on a slow link; closing first would lose it.
REPORT_DELIVERY_S = 600.0

# -- stalls -----------------------------------------------------------------------------------------------------

# When a run stalls, the driver asks every agent for its rank's Python stacks and waits this long for them all;
# each agent gives up on its rank after STACKS_ANSWER_WAIT_S (faulthandler answers from its signal handler, in
# milliseconds, unless the rank is stopped), so that a dead rank costs no more than a live one.
STACKS_WAIT_S = 5.0
STACKS_ANSWER_WAIT_S = 2.0

# -- runs that outlive the submitting process (runner/durable/) ---------------------------------------------------

# A submitted run with nobody attached for this long ends itself (its lease): a lost Airflow worker's retry starts
# ~10 minutes later on Airflow's defaults (heartbeat timeout 300 s + retry delay 300 s), and must find the run.
DEFAULT_DETACHED_TIMEOUT_S = 900.0

# A finished run's outcome (rank 0's value, or its error) is kept this long after the run ended for the client that
# owns it, attached or not (outcome_timeout): a deferred Airflow task resumes on a worker once the run ended, and
# may wait hours for a worker slot or a pool first; a retry may come after the run ended. Meanwhile the host holds
# its one task slot and the value's memory, so it is bounded: the host ends at once when a client fetched it.
DEFAULT_OUTCOME_TIMEOUT_S = 21600.0  # 6 hours

# The run's host makes an RPC in each of its Connect sessions this often: a session with no RPC for the server's
# spark.connect.session.manager.defaultSessionTimeout (60 min by default) is closed, and its operations with it.
SESSION_KEEPALIVE_S = 60.0

# submit() waits this long, beyond the slot wait, for the run's host to publish its link (a Python worker's
# start, pyspark's imports and a Connect session of its own: seconds; a fresh server's first Python job: ~20 s).
HOST_START_TIMEOUT_S = 120.0

# A run with mlflow= has its host wait this long for the submitting client's MLflow tracking URI and credentials
# (they come over the link, never in the host's plan, which the server may log) before it makes the MLflow run:
# the client attaches as soon as the host publishes its link, its connect and handshake within CONNECT_TIMEOUT_S
# and HANDSHAKE_TIMEOUT_S; a client killed meanwhile never sends them, and the run ends before any rank starts.
CREDENTIALS_WAIT_S = 60.0

# A cancelled run's host keeps its outcome this long for the clients attached then (each has it within the
# writer's wake, 0.5 s), not until one fetches it: who cancelled wants no value, and a watcher never fetches;
# the host's task slot is free for the next run within it.
CANCELLED_OUTCOME_GRACE_S = 5.0

# A host that could not start publishes its failure in the run's session, where submit() and attach() read it
# (they look every 0.25 s), then waits until one of them released the session, at most this long, before it
# releases it itself: a client that comes later finds nothing of the run, and the task slot is freed soon.
HOST_FAILURE_SHOWN_S = 10.0

# A host whose published link does not take the connection, while the run's session and operation are there: one
# that is ending releases its session within its 10 s release call; one that was lost (its Python worker or
# executor died) Spark names within seconds: its operation ends, or the task's next attempt marks the run lost
# (after HEARTBEAT_TIMEOUT_S of its first attempt not answering). attach() waits this long for either before it
# says that this process cannot reach the host (a route), or that Spark has not noticed the loss yet.
HOST_UNREACHABLE_WAIT_S = 30.0

__all__ = [
    "ABORT_WAIT_S",
    "BROADCAST_DROP_WAIT_S",
    "CANCELLED_OUTCOME_GRACE_S",
    "CONNECT_FIRST_PROGRESS_S",
    "CONNECT_TIMEOUT_S",
    "CREDENTIALS_WAIT_S",
    "DEFAULT_DETACHED_TIMEOUT_S",
    "DEFAULT_EXIT_TIMEOUT_S",
    "DEFAULT_OUTCOME_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "EXIT_AFTER_REPORT_S",
    "FEED_LOG_S",
    "FEED_REPORT_S",
    "FINAL_WRITE_S",
    "GLOO_DEFAULT_TIMEOUT_S",
    "HANDSHAKE_TIMEOUT_S",
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_TIMEOUT_S",
    "HOST_FAILURE_SHOWN_S",
    "HOST_START_TIMEOUT_S",
    "HOST_UNREACHABLE_WAIT_S",
    "LAUNCH_END_WAIT_S",
    "LAUNCH_FAILURE_SETTLE_S",
    "MIN_BEATS_PER_TIMEOUT",
    "REPORT_DELIVERY_S",
    "SEND_TIMEOUT_S",
    "SESSION_KEEPALIVE_S",
    "SETTLE_S",
    "STACKS_ANSWER_WAIT_S",
    "STACKS_WAIT_S",
]
