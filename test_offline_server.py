"""offline_server.py: the offline engine's loopback server refuses hostile requests with 4xx JSON and
keeps answering.
Vendors with: offline_server.py offline.py defenses.py metrics.py tfsg.py geodef.py conftest.py
Run: python -m pytest -q test_offline_server.py
"""
import threading
import time

import metrics
import offline_server
from conftest import _raw


def test_offline_server_answers_every_hostile_request():
    """serve-offline answers bodies of the wrong shape with 4xx JSON, and a client that promises more
    body than it sends is dropped after the socket timeout; the server keeps answering."""
    import requests
    srv = offline_server.make_server(0)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}/v1/chat/completions"
    try:
        for body in (b"[1]", b'"s"', b'{"messages": 3}', b'{"messages": [{"role": "user", "content": ["a"]}]}',
                     b'{"messages": [{"role": "user", "content": null}]}', b"[" * 100000 + b"]" * 100000, b"\xff"):
            r = requests.post(url, data=body, timeout=10)
            assert r.status_code == 400 and "error" in r.json(), body[:40]
        for head in (b"Content-Length: -1\r\n", b""):
            status, _ = _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n")
            assert status == 400
        old = offline_server._Handler.timeout
        offline_server._Handler.timeout = 1
        try:
            t0 = time.monotonic()
            _raw(srv, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{", timeout=5)
            assert time.monotonic() - t0 < 4
        finally:
            offline_server._Handler.timeout = old
        ok_ = requests.post(url, json={"messages": [{"role": "user",
                                                     "content": metrics.asi_prompt("q", "a b c", "x")}]},
                            timeout=10)
        assert ok_.status_code == 200
    finally:
        srv.shutdown()
