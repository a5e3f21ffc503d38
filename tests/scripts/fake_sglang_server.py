#!/usr/bin/env python3
"""Stands in for `python -m sglang.launch_server` where SGLang cannot run (no GPU): set as rollout.sglang.python.

Records its arguments and environment in $MEGARL_FAKE_SGLANG_DIR/node<rank>.json. Node-rank 0 answers SGLang's
health endpoints on --host/--port (as a real server does once every node of the engine has joined), after
$MEGARL_FAKE_SGLANG_READY_AFTER_S seconds if set; other node ranks serve nothing, as SGLang's do, and wait until
stopped, or exit at once with code 3 when $MEGARL_FAKE_SGLANG_FAIL_RANK names them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def main() -> None:
    argv = sys.argv[1:]
    if argv[:2] == ["-m", "sglang.launch_server"]:
        argv = argv[2:]
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--node-rank", type=int, default=0)
    known, _ = parser.parse_known_args(argv)
    record = {"argv": argv, "pid": os.getpid(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    folder = os.environ["MEGARL_FAKE_SGLANG_DIR"]
    with open(os.path.join(folder, f"node{known.node_rank}.json"), "w") as f:
        json.dump(record, f)
    if os.environ.get("MEGARL_FAKE_SGLANG_FAIL_RANK") == str(known.node_rank):
        print(f"node-rank {known.node_rank}: NCCL error: unhandled system error", flush=True)
        sys.exit(3)
    if known.node_rank == 0:
        time.sleep(float(os.environ.get("MEGARL_FAKE_SGLANG_READY_AFTER_S", "0")))
        HTTPServer((known.host, known.port), Health).serve_forever()
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
