"""`make run`: Redis, one worker and the API on 127.0.0.1:$PORT; Ctrl-C or SIGTERM stops them all.

`make run-https` (--https) puts nginx from deploy/nginx in front, on https://127.0.0.1:$HTTPS_PORT
(default 8443; plain HTTP on $HTTP_PORT, default 8080, redirects there), with a self-signed
certificate made under .run/https/certs; it prints the CA file that clients must trust.

Honours MODEL_PATH, MODEL_NAME, REDIS_URL (an existing Redis; otherwise one is started on a free
port) and PORT (default 8000). Without MODEL_PATH it serves the demo model (random weights: noise).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scripts import localstack

DEMO_MODEL = localstack.ROOT / "models" / "demo"


def main(argv: list[str] | None = None) -> int:
    https = "--https" in (sys.argv[1:] if argv is None else argv)
    port = int(os.environ.get("PORT", "8000"))
    model_path = os.environ.get("MODEL_PATH") or str(DEMO_MODEL)
    demo = "MODEL_PATH" not in os.environ or not os.environ["MODEL_PATH"]
    if demo and not (DEMO_MODEL / "config.json").is_file():
        from scripts.build_demo_model import main as build

        build([str(DEMO_MODEL)])
    model_name = os.environ.get("MODEL_NAME") or Path(model_path).resolve().name
    redis_proc = None
    redis_url = os.environ.get("REDIS_URL")
    if not redis_url:
        redis_port = localstack.free_port()
        redis_proc = localstack.start_redis(redis_port)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = localstack.environment(MODEL_PATH=model_path, MODEL_NAME=model_name, REDIS_URL=redis_url)
    worker = localstack.start_worker(env, model_name)
    api = localstack.start_api(env, port)
    nginx = None
    stopping = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        localstack.wait_for_api(port, api)
        localstack.wait_for(lambda: localstack.worker_count(redis_url, model_name) > 0, 120, "the worker")
        print(f"\ntokenline is serving model '{model_name}' at http://127.0.0.1:{port}  (Redis: {redis_url})")
        if https:
            https_port = int(os.environ.get("HTTPS_PORT", "8443"))
            http_port = int(os.environ.get("HTTP_PORT", "8080"))
            nginx, ca_file = localstack.start_nginx(localstack.ROOT / ".run" / "https", port, https_port, http_port)
            print(
                f"nginx serves it at https://127.0.0.1:{https_port} (http://127.0.0.1:{http_port} redirects there)\n"
                f"CA file to trust: {ca_file}\n"
                f"  curl --cacert {ca_file} https://127.0.0.1:{https_port}/v1/models"
            )
        if demo:
            print(
                "This is the demo model: random weights, its output is noise. To serve real weights:\n"
                "  MODEL_PATH=/path/to/hf-model-dir MODEL_NAME=my-model make run"
            )
        print("Ctrl-C stops everything.\n", flush=True)
        while not stopping and all(p.poll() is None for p in (worker, api, nginx) if p is not None):
            time.sleep(0.2)
        if not stopping:
            print("a tokenline process exited; stopping the rest", file=sys.stderr)
            return 1
        return 0
    finally:
        localstack.stop(nginx, api, worker)
        localstack.stop(redis_proc)


if __name__ == "__main__":
    sys.exit(main())
