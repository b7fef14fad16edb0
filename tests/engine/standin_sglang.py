"""A stand-in for ``python -m sglang.launch_server`` in supervisor tests (stdlib only).

It accepts ``--host``/``--port`` like SGLang, answers ``GET /health`` with 503 for ``--delay``
seconds and 200 after that, and can misbehave on purpose:

- ``--crash-times N --state-file F``: the first N starts (counted in F) crash with exit code 3,
  after ``--crash-after`` seconds (0: before serving anything);
- ``--ignore-sigterm``: survive SIGTERM (the supervisor must SIGKILL);
- ``--grandchild``: spawn a long ``sleep`` child, to check that nothing is orphaned.

Every start appends ``<pid> <monotonic time> [<grandchild pid>]`` to ``--log`` when given.
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

__all__: list[str] = []


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--crash-times", type=int, default=0)
    p.add_argument("--crash-after", type=float, default=0.0)
    p.add_argument("--state-file", default=None)
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--grandchild", action="store_true")
    p.add_argument("--log", default=None)
    args = p.parse_args()

    started = time.monotonic()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = None
    if args.grandchild:
        grandchild = subprocess.Popen(["sleep", "600"])
    if args.log:
        with open(args.log, "a") as f:
            extra = f" {grandchild.pid}" if grandchild else ""
            f.write(f"{os.getpid()} {time.monotonic()}{extra}\n")

    crash = False
    if args.crash_times and args.state_file:
        count = 0
        if os.path.exists(args.state_file):
            with open(args.state_file) as f:
                count = int(f.read() or 0)
        with open(args.state_file, "w") as f:
            f.write(str(count + 1))
        crash = count < args.crash_times
    if crash and args.crash_after <= 0:
        sys.exit(3)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/health" and time.monotonic() - started >= args.delay
            self.send_response(200 if ok else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if crash:
        time.sleep(args.crash_after)
        os._exit(3)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
