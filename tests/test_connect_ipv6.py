"""Spark Connect where ``localhost`` is IPv6's loopback (``::1``), as on Debian, RHEL and many images with IPv6 up:
a host made as a network namespace whose ``/etc/hosts`` names ``localhost`` (and its hostname) ``::1`` alone
(tests/hosts.py), a Connect server listening on ``::1`` inside it, and a client there reaching it as
``sc://localhost:PORT``, as a user would; then the agents told an IPv6 address."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap

import pytest
from connect_server import ConnectServer
from hosts import LoopbackHost, cannot_make_hosts

_CANNOT = cannot_make_hosts()
pytestmark = [
    pytest.mark.skipif(_CANNOT is not None, reason=f"namespace hosts: {_CANNOT}"),
    pytest.mark.timeout(900),
]

# the user's script: both runners on a Connect session to sc://localhost (their jobs travel by value, as
# __main__'s functions do)
CLIENT = textwrap.dedent(
    """
    import json, logging, sys

    from pyspark.sql.connect.session import SparkSession

    from airflow_provider_hvd import HorovodRunner, TorchDistributor

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)


    def horovod_sum():
        import horovod.torch as hvd
        import torch

        hvd.init()
        return hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()


    def torch_sum():
        import os

        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(total)
        dist.destroy_process_group()
        return {"sum": total.item(), "master_addr": os.environ["MASTER_ADDR"]}


    spark = SparkSession.builder.remote(sys.argv[1]).create()
    try:
        results = {
            "horovod": HorovodRunner(np=2).run(horovod_sum),
            "torch": TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_sum),
        }
        spark.conf.set("spark.horovodRunner.driverHost", "::1")  # the agents are told IPv6's loopback
        results["torch over IPv6"] = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(torch_sum)
        try:
            HorovodRunner(np=2).run(horovod_sum)
        except Exception as exc:
            results["horovod over IPv6"] = f"{type(exc).__name__}: {exc}"
    finally:
        spark.stop()
    print("RESULTS " + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def ipv6_localhost():
    """A host whose names are ``::1`` alone: ``localhost``, and its hostname (Horovod's Gloo looks it up)."""
    host = LoopbackHost(f"::1 localhost {socket.gethostname()}\n").start()
    yield host
    host.stop()


@pytest.fixture(scope="module")
def server_on_ipv6_localhost(ipv6_localhost, tmp_path_factory):
    server = ConnectServer(
        tmp_path_factory.mktemp("spark-connect-ipv6"), "local[2]", host="::1", inside=ipv6_localhost
    ).start()
    yield server
    server.stop()


def test_both_runners_run_over_sc_localhost_where_localhost_is_ipv6(ipv6_localhost, server_on_ipv6_localhost, tmp_path):
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    url = f"sc://localhost:{server_on_ipv6_localhost.port}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        ipv6_localhost.command(sys.executable, str(script), url), env=env, capture_output=True, text=True, timeout=600
    )
    said = done.stderr
    results = next((line for line in done.stdout.splitlines() if line.startswith("RESULTS ")), None)
    assert done.returncode == 0 and results, said[-4000:]
    results = json.loads(results.removeprefix("RESULTS "))
    # on the server's local master its executors reach this host's loopback: IPv4's, also for Horovod's Gloo
    assert results["horovod"] == 3.0 and results["torch"] == {"sum": 3.0, "master_addr": "127.0.0.1"}
    assert "driver channel on 127.0.0.1:" in said, said[-4000:]
    # told ::1, torch's ranks run over IPv6 (the channel, the store); Horovod's are refused, naming the fix
    assert results["torch over IPv6"] == {"sum": 3.0, "master_addr": "::1"}
    assert re.search(r"driver channel on \[::1\]:\d+", said) and "TCPStore) on [::1]:" in said, said[-4000:]
    assert results["horovod over IPv6"] == (
        "JobRefusedError: Horovod's ranks cannot reach the driver at ::1 (spark.horovodRunner.driverHost=::1): "
        "Horovod's Gloo rendezvous takes IPv4 only (its ranks' HTTP client). Set spark.horovodRunner.driverHost to "
        "an IPv4 address of this host that the executors reach (TorchDistributor's ranks work over IPv6 too)."
    )
