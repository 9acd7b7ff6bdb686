"""The API must run in an image without torch (and without transformers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from scripts.localstack import ROOT

PROGRAM = """
import sys
sys.modules["torch"] = None          # any `import torch` now raises ImportError
sys.modules["transformers"] = None
from schemas.config import load_settings
from app import create_app
app = create_app(load_settings({"MODEL_PATH": sys.argv[1], "MODEL_NAME": "demo", "REDIS_URL": sys.argv[2]}))
client = app.test_client()
assert client.get("/v1/models").json["data"][0]["id"] == "demo"
bad = client.post("/v1/chat/completions", json={"model": "demo", "messages": []})
assert bad.status_code == 400 and bad.json["error"]["param"] == "messages", bad.json
print("ok")
"""


def test_the_api_imports_and_validates_without_torch(demo_model: Path, redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(demo_model), redis_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
