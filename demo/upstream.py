#!/usr/bin/env python3
"""A trivial upstream for the demo: answers every request with 200 and what it received;
/reports takes a second (a slow report, for the global concurrency limit); /llm answers like an
LLM API, a stream of events whose last one reports the tokens used (x-demo-usage, default 300)."""
import http.server
import json
import sys
import time


class Echo(http.server.BaseHTTPRequestHandler):
    def _llm(self):
        used = int(self.headers.get("x-demo-usage", "300"))
        events = [{"choices": [{"delta": {"content": word}}]} for word in ("Hello", " there")]
        events.append({"choices": [], "usage": {"prompt_tokens": used // 3,
                       "completion_tokens": used - used // 3, "total_tokens": used}})
        body = "".join("data: " + json.dumps(e) + "\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def _answer(self):
        if self.path.startswith("/llm"):
            return self._llm()
        if self.path.startswith("/reports"):
            time.sleep(1)
        body = json.dumps({"method": self.command, "path": self.path,
                           "headers": dict(self.headers)}, indent=1).encode() + b"\n"
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _answer

    def log_message(self, *args):
        pass


if __name__ == "__main__":
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8081
    host = sys.argv[2] if len(sys.argv) > 2 else "127.0.0.1"
    http.server.ThreadingHTTPServer((host, port), Echo).serve_forever()
