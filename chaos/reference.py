"""The fault-free reference a run is checked against: what every request would have returned.

Three kinds, named in the journal (``journal.json``: ``reference``):

- ``model``: the simulated worker's model, where any continuation is a pure function of the prefix
  (:class:`ModelReference`; the backend says so with :meth:`~fleetward.fleet.backends.Backend.reference`);
- ``recorded``: after the method, every distinct request of the run is sent again through the fault-free
  fleet and its tokens kept in ``reference.jsonl`` (:func:`record_reference`; greedy decoding only, as on
  vLLM where greedy output is exact across workers);
- ``none``: no reference (sampling, or the experiment asks for none); checkers that need one say
  ``unknown``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fleetward.chaos.experiment import WorkloadSpec
from fleetward.chaos.history import Record
from fleetward.chaos.workload import Live, Planned, Workload
from fleetward.sim.model import SimModel

if TYPE_CHECKING:
    from fleetward.chaos.runview import RequestView

__all__ = ["ModelReference", "NoReference", "RecordedReference", "Reference", "record_reference", "reference_key",
           "reference_of"]


def reference_key(prompt: Sequence[int], max_tokens: int, ignore_eos: bool) -> str:
    body = json.dumps([list(prompt), int(max_tokens), bool(ignore_eos)], separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


class Reference(Protocol):
    """The fault-free continuation of a request, where one is known."""

    kind: str

    def expected(self, r: RequestView) -> list[int] | None:
        """The tokens a fault-free run delivers for ``r``; ``None`` when not known (see :meth:`why`)."""
        ...

    def why(self, r: RequestView) -> str: ...

    def follows(self, prefix: Sequence[int], rest: Sequence[int]) -> bool:
        """Whether ``rest`` is what the engine generates after ``prefix`` (False when it cannot tell)."""
        ...


@dataclass
class ModelReference:
    """The simulated worker's model: any continuation is a pure function of the prefix."""

    seed: int = 0
    eos_probability: float = 0.0
    vocab_size: int | None = None
    kind: str = "model"
    _cache: dict[str, list[int]] = field(default_factory=dict)

    def expected(self, r: RequestView) -> list[int] | None:
        prompt, p = r.prompt, r.params
        if prompt is None or "max_tokens" not in p:
            return None
        key = reference_key(prompt, p["max_tokens"], bool(p.get("ignore_eos")))
        if key not in self._cache:
            model = SimModel(self.seed, self.eos_probability, self.vocab_size)
            self._cache[key] = model.continuation(prompt, int(p["max_tokens"]), ignore_eos=bool(p.get("ignore_eos")))
        return self._cache[key]

    def why(self, r: RequestView) -> str:
        return "the invoke record lacks the prompt or max_tokens"

    def follows(self, prefix: Sequence[int], rest: Sequence[int]) -> bool:
        model = SimModel(self.seed, self.eos_probability, self.vocab_size)
        return model.continuation(prefix, len(rest), ignore_eos=True) == list(rest)


@dataclass
class RecordedReference:
    """Tokens from a fault-free run of the same requests (greedy decoding only)."""

    entries: Mapping[str, list[int]]
    kind: str = "recorded"

    def expected(self, r: RequestView) -> list[int] | None:
        prompt, p = r.prompt, r.params
        if prompt is None or float(p.get("temperature", 1.0)) != 0.0:
            return None
        return self.entries.get(reference_key(prompt, int(p.get("max_tokens", 16)), bool(p.get("ignore_eos"))))

    def why(self, r: RequestView) -> str:
        if float(r.params.get("temperature", 1.0)) != 0.0:
            return "the request samples (temperature > 0): its continuation is not determined"
        return "the fault-free reference run has no answer for this request"

    def follows(self, prefix: Sequence[int], rest: Sequence[int]) -> bool:
        return False


@dataclass
class NoReference:
    reason: str
    kind: str = "none"

    def expected(self, r: RequestView) -> list[int] | None:
        return None

    def why(self, r: RequestView) -> str:
        return self.reason

    def follows(self, prefix: Sequence[int], rest: Sequence[int]) -> bool:
        return False


def reference_of(info: Mapping[str, Any], run_dir: Path) -> Reference:
    kind = info.get("kind")
    if kind == "model":
        m = SimModel.of_reference(info)
        return ModelReference(m.seed, m.eos_probability, m.vocab_size)
    if kind == "recorded":
        entries: dict[str, list[int]] = {}
        path = run_dir / str(info.get("file", "reference.jsonl"))
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    body = json.loads(line)
                    entries[body["key"]] = body["tokens"]
        return RecordedReference(entries)
    return NoReference(str(info.get("reason") or "no fault-free reference for this run"))


async def record_reference(records: Iterable[Record], workload: Workload, spec: WorkloadSpec, run_dir: Path, *,
                           say: Callable[[str], None]) -> dict[str, Any]:
    """Run every distinct request of ``records`` again, fault-free, and keep what it returns in
    ``run_dir/reference.jsonl``; the journal's ``reference`` entry."""
    wanted: dict[str, tuple[list[int], int]] = {}
    for rec in records:
        if rec.type == "invoke" and isinstance(rec.get("prompt"), list):
            p = rec.get("params") or {}
            key = reference_key(rec["prompt"], int(p.get("max_tokens", 16)), bool(p.get("ignore_eos")))
            wanted.setdefault(key, (rec["prompt"], int(p.get("max_tokens", 16))))
    say(f"recording the fault-free reference ({len(wanted)} requests)")
    client = workload.client_for(_Memory(), spec.model_copy(update={"api": "completion"}))
    got: dict[str, list[int]] = {}
    # Greedy output is the same batched as alone (vLLM on these CPUs: tests/vllm/test_tiny_model_on_vllm.py),
    # so the requests go side by side, as the run's own did.
    sem = asyncio.Semaphore(16)

    async def one(key: str, prompt: list[int], max_tokens: int, k: int) -> None:
        async with sem:
            p = Planned(k, 0.0, tuple(prompt), max_tokens, source="reference")
            out = await client.run(p, Live(f"ref-{k}", "reference", p), router_index=k)
            if out.ok:
                got[key] = list(out.tokens)

    async with asyncio.TaskGroup() as tg:
        for k, (key, (prompt, n)) in enumerate(wanted.items()):
            tg.create_task(one(key, prompt, n, k))
    with (run_dir / "reference.jsonl").open("w") as f:
        for key, tokens in got.items():
            f.write(json.dumps({"key": key, "tokens": tokens}, separators=(",", ":")) + "\n")
    return {"kind": "recorded", "file": "reference.jsonl", "requests": len(wanted), "answered": len(got)}


class _Memory:
    """A recorder that keeps nothing on disk (the reference run)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self._t0

    def add(self, type_: str, **data: Any) -> None:
        return None
