"""The README's real-vLLM command as a newcomer runs it: from the repository root, the default run dir.

`fleetward up --backend vllm` writes the tiny model under `.fleetward/models/` (a relative path) and starts
vLLM workers whose working directory is their log folder; a relative model path there was taken for a
Hugging Face repo id. The other vLLM tests use absolute temporary paths, which hid that. This file runs
first in the folder (its name), before the session's two servers take the CPU.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import openai

from fleetward.fleet.procs import ManagedProcess

ROOT = Path(__file__).resolve().parents[2]
FLEETWARD = str(Path(sys.executable).parent / "fleetward")  # the console script, as the README runs it


async def test_up_with_the_vllm_backend_from_the_repository_root_serves_through_its_router(
        tmp_path: Path, wait_until: Any) -> None:
    cluster = f"readme-{uuid.uuid4().hex[:6]}"  # the default run dir is shared with the developer's own runs
    up = ManagedProcess("fleetward up", [FLEETWARD, "up", "--backend", "vllm", "--workers", "1", "--cluster",
                                         cluster],
                        log_path=tmp_path / "up.log", cwd=ROOT, env={"PYTHONSAFEPATH": "1"}).start()
    try:
        def serving() -> dict[str, Any] | None:
            r = subprocess.run([FLEETWARD, "status", "--json", "--cluster", cluster], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
            assert up.is_running, up.log_tail()
            if r.returncode != 0:
                return None
            data: dict[str, Any] = json.loads(r.stdout)
            ready = [w for w in data["workers"] if w["health"] == "ready"]
            return data if ready and data["routers"] else None

        data = await wait_until(serving, timeout=300, interval=1.0, message="a ready vLLM worker and a router")
        assert (ROOT / ".fleetward" / cluster / "fleet.json").exists(), "the default run dir, under the root"
        (worker,) = data["workers"]
        client = openai.AsyncOpenAI(base_url=f"{data['routers'][0]['url']}/v1", api_key="unused", max_retries=0)
        completion = await client.completions.create(model=worker["model"], prompt="Hello", max_tokens=8)
        await client.close()
        assert completion.usage is not None and completion.usage.completion_tokens == 8
        assert completion.choices[0].text
        up.signal(signal.SIGTERM)
        assert await up.wait_exit() == 0, up.log_tail()
        assert "no process left behind" in up.log_tail()
        assert not (ROOT / ".fleetward" / cluster / "fleet.json").exists()
    finally:
        await up.stop()
        shutil.rmtree(ROOT / ".fleetward" / cluster, ignore_errors=True)
