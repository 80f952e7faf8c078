"""A stand-in for ``vllm serve``'s HTTP surface, for the bench client's failure tests.

Serves ``/v1/models``, ``/metrics`` (with ``vllm:cache_config_info``) and
streaming ``/v1/completions``; it can demand an API key, fail chosen requests
(an HTTP error, or an error in the middle of the stream) and be slow.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeConfig:
    block_size: int = 16
    max_model_len: int = 4096
    api_key: str | None = None
    fail_http: set[int] = field(default_factory=set)  # n-th completion request (0-based) gets a 500
    fail_stream: set[int] = field(default_factory=set)  # n-th completion request errors mid-stream
    delay_s: float = 0.0
    odd_usage: dict[int, str] = field(default_factory=dict)  # n-th request: this payload instead of its usage chunk
    cut_short: set[int] = field(default_factory=set)  # n-th request: aborted after one token
    stream_s: float = 0.0  # every reply streams a token each 0.05 s for this long before its last
    models_body: str | None = None  # /v1/models answers this instead
    gone_after: int | None = None  # the server shuts down after answering this many completion requests
    received: list[dict] = field(default_factory=list)


def _metrics(cfg: FakeConfig, hits: int, queries: int) -> str:
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{cfg.block_size}",enable_prefix_caching="True",engine="0",'
        f'num_gpu_blocks="100"}} 1.0\n'
        "# TYPE vllm:prefix_cache_queries counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="fake"}} {queries}\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="fake"}} {hits}\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="fake"} 0.0\n'
    )


class FakeServer:
    def __init__(self, cfg: FakeConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.n = 0
        self.hits = 0
        self.queries = 0
        self.closed = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, body: str, ctype: str = "application/json") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                key = server.cfg.api_key
                return key is None or self.headers.get("Authorization") == f"Bearer {key}"

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, "")
                elif self.path == "/v1/models":
                    if not self._authorized():
                        self._send(401, json.dumps({"error": "Unauthorized"}))
                        return
                    models = {"data": [{"id": "fake", "max_model_len": server.cfg.max_model_len}]}
                    self._send(200, server.cfg.models_body or json.dumps(models))
                elif self.path == "/metrics":
                    self._send(200, _metrics(server.cfg, server.hits, server.queries), "text/plain")
                else:
                    self._send(404, json.dumps({"detail": "Not Found"}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                if not self._authorized():
                    self._send(401, json.dumps({"error": "Unauthorized"}))
                    return
                with server.lock:
                    i = server.n
                    server.n += 1
                    server.cfg.received.append(body)
                if server.cfg.gone_after is not None and i >= server.cfg.gone_after:
                    # It came in before the shutdown thread stopped the listener (a few ms, a
                    # scheduling hiccup): a server going down drops it unanswered, never serves it.
                    self.close_connection = True
                    return
                if i in server.cfg.fail_http:
                    self._send(500, json.dumps({"error": {"message": "injected failure"}}))
                    return
                time.sleep(server.cfg.delay_s)
                n_prompt = len(body["prompt"])
                cached = (n_prompt // server.cfg.block_size // 2) * server.cfg.block_size
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                going = server.cfg.gone_after is not None and i + 1 >= server.cfg.gone_after
                if going:  # no kept-alive connection outlives the server
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()

                def chunk(s: str) -> None:
                    data = s.encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

                rid = "cmpl-" + body.get("request_id", str(i))
                chunk(f'data: {{"id": "{rid}", "choices": [{{"index": 0, "text": "x", "finish_reason": null}}]}}\n\n')
                end = time.monotonic() + server.cfg.stream_s
                while time.monotonic() < end:
                    time.sleep(0.05)
                    chunk(f'data: {{"id": "{rid}", "choices": [{{"index": 0, "text": "x", "finish_reason": null}}]}}\n\n')
                short = i in server.cfg.cut_short
                last = {"index": 0, "text": "x", "finish_reason": "abort" if short else "length"}
                chunk(f'data: {{"id": "{rid}", "choices": [{json.dumps(last)}]}}\n\n')
                if i in server.cfg.fail_stream:
                    chunk('data: {"error": {"message": "injected stream failure", "code": 500}}\n\n')
                elif i in server.cfg.odd_usage:
                    chunk(f"data: {server.cfg.odd_usage[i]}\n\n")
                else:
                    usage = {"prompt_tokens": n_prompt, "completion_tokens": 1 if short else body["max_tokens"],
                             "prompt_tokens_details": {"cached_tokens": cached}}
                    metrics = {"time_to_first_token_ms": 1.0, "queue_time_ms": 0.5, "generation_time_ms": 2.0}
                    chunk(f'data: {{"id": "{rid}", "choices": [], "usage": {json.dumps(usage)}, '
                          f'"metrics": {json.dumps(metrics)}}}\n\n')
                    with server.lock:
                        server.hits += cached
                        server.queries += n_prompt
                chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                if going:
                    threading.Thread(target=server.close, daemon=True).start()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def close(self) -> None:
        """Stop answering: later connections are refused."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.httpd.shutdown()
        self.httpd.server_close()

    def __exit__(self, *exc) -> None:
        self.close()
