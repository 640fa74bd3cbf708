"""A small reference reward server (the other end of `RemoteReward`), on the standard library.

    python -m megatron_rl.rewards.server --reward math --port 8000
    python -m megatron_rl.rewards.server --reward my_pkg.rewards:compute_score [--batched]

POST / (or /score) takes OpenRLHF's remote-RM JSON and answers {"rewards": [...]}; a reward
function that raises gives HTTP 500 with the error, so the client's retry and failure
accounting can be exercised for real. GET /health answers 200. With --port 0 the chosen port
is printed on the first line of stdout: "listening on http://HOST:PORT".
"""

from __future__ import annotations

import argparse
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_rl.plugins import load_callable
from megatron_rl.rewards.math_reward import math_reward


def make_scorer(reward: str, batched: bool):
    if reward == "math":
        return lambda prompts, responses, labels: [
            math_reward(r, label) for r, label in zip(responses, labels, strict=True)
        ]
    fn = load_callable(reward)
    if batched:
        return fn
    return lambda prompts, responses, labels: [
        fn(p, r, label) for p, r, label in zip(prompts, responses, labels, strict=True)
    ]


def make_handler(scorer):
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self._reply(200, {"status": "ok"})
            else:
                self._reply(404, {"error": f"no route {self.path}"})

        def do_POST(self):  # noqa: N802
            if self.path not in ("/", "/score"):
                return self._reply(404, {"error": f"no route {self.path}"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                responses = body["responses"]
                prompts = body.get("prompts", [""] * len(responses))
                labels = body.get("labels", [None] * len(responses))
            except (ValueError, KeyError, TypeError) as e:
                return self._reply(400, {"error": f"bad request: {type(e).__name__}: {e}"})
            try:
                rewards = [float(r) for r in scorer(prompts, responses, labels)]
            except Exception as e:
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})
            self._reply(200, {"rewards": rewards})

        def log_message(self, format, *args):  # quiet: one line per request is noise
            pass

    return Handler


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reward", default="math", help="'math' or package.module:function")
    p.add_argument("--batched", action="store_true", help="the function takes lists")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    a = p.parse_args(argv)
    try:
        scorer = make_scorer(a.reward, a.batched)
    except ValueError as e:
        raise SystemExit(f"reward server: {e}") from None
    server = ThreadingHTTPServer((a.host, a.port), make_handler(scorer))
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
