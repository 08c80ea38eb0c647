"""The "Spark UI" extra link points at a page that outlives the task (the driver's own UI does not)."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

import pytest

from airflow_provider_hvd.hooks.spark_ui import HISTORY_SERVER_CONF, YARN_PROXY_CONF, lasting_ui_url
from airflow_provider_hvd.runner.driver.launch.spark.server_ui import PORT_RETRIES, UI_PROBE_TIMEOUT_S, server_ui_url

APP = "app-20260101000000-0007"
YARN_APP = "application_1767225600000_0042"


@pytest.mark.parametrize(
    ("master", "app_id", "conf", "options", "link"),
    [
        # standalone: the master's application page, while the master answers
        ("spark://m:7077", APP, {}, {"master_ui": "http://m:8080"}, f"http://m:8080/app/?appId={APP}"),
        ("spark://m:7077", APP, {}, {}, None),
        # YARN: the ResourceManager's proxy of the application (its tracking URL), set by Spark on the driver
        (
            "yarn",
            YARN_APP,
            {YARN_PROXY_CONF: f"http://rm1:8088/proxy/{YARN_APP},http://rm2:8088/proxy/{YARN_APP}"},
            {},
            f"http://rm1:8088/proxy/{YARN_APP}/",
        ),
        # a History Server, configured on the connection or as YARN's, wins: it outlives the cluster's own pages
        (
            "yarn",
            YARN_APP,
            {YARN_PROXY_CONF: "http://rm:8088/proxy/x", HISTORY_SERVER_CONF: "shs:18080"},
            {"attempt_id": "1"},
            f"http://shs:18080/history/{YARN_APP}/1/",
        ),
        (
            "spark://m:7077",
            APP,
            {},
            {"history_server": "https://shs.example.com/", "master_ui": "http://m:8080"},
            f"https://shs.example.com/history/{APP}/",
        ),
        # local masters: the driver's UI dies with the task, and there is nothing else
        ("local[2]", "local-1767225600000", {}, {}, None),
        ("k8s://https://k8s:6443", "spark-0123", {}, {}, None),
    ],
)
def test_lasting_link(master, app_id, conf, options, link):
    assert lasting_ui_url(master, app_id, conf, **options) == link


def _consecutive_ports(count: int) -> list[socket.socket]:
    """``count`` listening loopback sockets on consecutive ports."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
                sock.listen(8)
            return sockets
        except OSError:
            for sock in sockets:
                sock.close()


def test_the_connect_servers_ui_is_the_first_that_lists_its_application():
    """Another application's UI holds the first port; the next one is the server's application's."""
    sockets = _consecutive_ports(2)
    servers = []
    for sock, app in zip(sockets, ["app-other", APP], strict=True):
        body = json.dumps([{"id": app}]).encode()

        class Applications(http.server.BaseHTTPRequestHandler):
            def do_GET(self, body: bytes = body) -> None:
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.HTTPServer(sock.getsockname(), Applications, bind_and_activate=False)
        server.socket.close()
        server.socket = sock
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        first = sockets[0].getsockname()[1]
        assert server_ui_url("127.0.0.1", first, 16, APP) == (f"http://127.0.0.1:{first + 1}", "")
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_a_ui_host_that_never_answers_holds_the_job_back_seconds_at_most():
    """Every UI port accepts and never answers, as behind a firewall that drops packets: it took 51 s (17 ports
    x 3 s, before the job started) when they were asked one after the other."""
    sockets = _consecutive_ports(PORT_RETRIES + 1)
    try:
        first = sockets[0].getsockname()[1]
        started = time.monotonic()
        link, why = server_ui_url("127.0.0.1", first, PORT_RETRIES, APP)
        took = time.monotonic() - started
    finally:
        for sock in sockets:
            sock.close()
    assert link is None and why == (
        f"no Spark UI from http://127.0.0.1:{first} on lists the Spark Connect server's application {APP}"
    )
    assert took < UI_PROBE_TIMEOUT_S + 4  # one probe's timeout, with room for a loaded machine
