"""Running code under the peer's Python (llama-cpp-python in its own venv), shared by the
benchmarks that compare against it."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def run_peer(python: str, code: str, job: dict[str, Any]) -> Any:
    """Run `code` with `python`, `job` as JSON on its stdin; its JSON stdout, parsed."""
    out = subprocess.run(
        [python, "-c", code],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)
