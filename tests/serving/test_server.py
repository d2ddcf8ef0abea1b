"""The server runner's port handling (``sgl_kvtier.serving.server``), with a stand-in for SGLang's launcher:
a process that binds ``--port`` on 127.0.0.1 as SGLang's HTTP server does, answers ``/health``, and exits
printing uvicorn's "address already in use" line where the port is taken. The real launcher is driven by
every real-server test (``tests/sglang``)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from sgl_kvtier.serving import server as srv

STAND_IN = r'''
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

try:
    httpd = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError as exc:
    print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    sys.exit(3)
httpd.serve_forever()
'''


def stand_in(tmp_path: Path, port: int | None) -> srv.SGLangServer:
    server = srv.SGLangServer(tmp_path, port=port, cpu=False, log_path=tmp_path / "server.log",
                              startup_timeout_s=60.0, stop_grace_s=5.0)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    server.command = [sys.executable, str(script), "--port", str(server.port)]
    return server


def held(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_picked_port_is_below_the_ephemeral_range_and_free():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {srv.free_port() for _ in range(20)}
    assert all(p in srv.PORT_RANGE and p < low for p in ports) and len(ports) > 1
    for port in ports:
        held(port).close()  # each one binds


def test_a_picked_port_taken_before_start_up_is_replaced(tmp_path):
    server = stand_in(tmp_path, None)
    taken = server.port
    with held(taken):  # someone binds the picked port between the pick and the server's bind
        with server:
            assert server.port != taken and server.url.endswith(f":{server.port}")
            assert server.command[server.command.index("--port") + 1] == str(server.port)
            assert server.request("GET", "/health")[0] == 200
            assert server.gc_frozen is False  # the stand-in has no /freeze_gc (501): started all the same


def test_a_port_the_caller_chose_is_never_replaced(tmp_path):
    port = srv.free_port()
    server = stand_in(tmp_path, port)
    with held(port):
        with pytest.raises(srv.ServerError, match="exited with code 3 during start-up"):
            server.start()
    assert server.port == port
