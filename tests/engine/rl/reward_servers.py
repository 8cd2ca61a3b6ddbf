"""Real HTTP servers on 127.0.0.1 for the judge and remote-reward tests: a
``ThreadingHTTPServer`` in a thread, each POST answered by a handler function of the request's
path and JSON body, every request recorded."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# handler(path, body, request number from 0) -> (status, JSON-able reply or raw str)
Handler = Callable[[str, Any, int], tuple[int, Any]]


@contextmanager
def serve(handler: Handler) -> Iterator[tuple[str, list]]:
    """Run a server whose POSTs ``handler`` answers; yields ``(http://127.0.0.1:PORT, requests)``,
    ``requests`` the ``(path, body)`` of each POST in arrival order."""
    requests: list = []
    lock = threading.Lock()

    class Reply(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                number = len(requests)
                requests.append((self.path, body))
            status, reply = handler(self.path, body, number)
            data = (reply if isinstance(reply, str) else json.dumps(reply)).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                pass

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Reply)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests
    finally:
        server.shutdown()
        server.server_close()


def chat_completion(text: str, model: str = "judge") -> dict:
    """An OpenAI ``/v1/chat/completions`` reply whose one choice says ``text``."""
    return {
        "id": "chatcmpl-test",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def completion(text: str, model: str = "judge") -> dict:
    """An OpenAI ``/v1/completions`` reply whose one choice says ``text``."""
    return {
        "id": "cmpl-test",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
