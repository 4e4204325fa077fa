"""The simulated worker: vLLM 0.32's OpenAI-compatible HTTP API over :class:`~.engine.SimEngine`, with fault switches.

Run it as its own process::

    python -m fleetward.sim.server --host H --port P [--config-json '{...SimConfig...}'] [--model-name M]

or build the ASGI app in-process with :func:`create_app` (or :class:`SimWorker`). The admin token comes from
``FLEETWARD_ADMIN_TOKEN`` (a random one when unset; never logged).

This module assembles the worker, as vLLM's ``api_server.py`` does; each family of endpoints is its own module:

==========================================================  ===============================================
``POST /v1/completions``, ``POST /v1/chat/completions``     :mod:`.serving` (parsing: :mod:`.protocol`,
                                                            :mod:`.sampling`; streams: :mod:`.sse`)
``GET /health``                                             here: 200, empty body, also while hung
``GET /v1/models``                                          here, the card from :mod:`.servedmodel`
``GET /metrics``                                            :mod:`.metrics` (vLLM's metric names and labels)
``GET|POST /admin/faults``, ``GET /admin/state``            :mod:`.admin` (the fault switches)
``GET /kv/{transfer_id}``                                   :mod:`.kvtransfer` (prefill/decode)
tokenize, version, embeddings, score, audio, Responses ...  :mod:`.endpoints`
==========================================================  ===============================================

Failures look like vLLM's: ``{"error": {"message", "type", "param", "code"}}``. Unknown routes and methods get
FastAPI's ``{"detail": ...}`` 404 and 405, as from vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import uvicorn
from fastapi import FastAPI
from pydantic import SecretStr, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from fleetward.fleet.clock import SYSTEM_CLOCK, Clock
from fleetward.fleet.config import SimConfig, admin_token_from_env
from fleetward.sim.admin import Admin, parse_faults
from fleetward.sim.endpoints import mount
from fleetward.sim.engine import Faults, SimEngine
from fleetward.sim.kvtransfer import KvTransfer
from fleetward.sim.lora import Adapters
from fleetward.sim.metrics import metrics_endpoint
from fleetward.sim.protocol import ApiError
from fleetward.sim.responses import json_response
from fleetward.sim.servedmodel import ServedModel
from fleetward.sim.serving import CompletionServing

__all__ = ["SimWorker", "create_app", "main"]

log = logging.getLogger("fleetward.simworker")

CRASH_EXIT_CODE = 137  # what a shell reports for a SIGKILLed process


def _crash_process() -> None:
    logging.getLogger("fleetward.simworker").warning("crash requested through /admin/faults: exiting now")
    for h in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            h.flush()
    os._exit(CRASH_EXIT_CODE)


class SimWorker:
    """One simulated worker: its config, engine and the ASGI app (:attr:`app`) serving them.

    ``crash`` is what ``{"crash": true}`` calls after answering, and what a spent ``crash_after_tokens``
    budget calls (default: end the process at once); tests running the app in-process pass something
    harmless. ``faults`` are the switches the worker starts with (a worker can start already faulty).
    """

    def __init__(self, config: SimConfig, *, admin_token: SecretStr | str | None = None,
                 clock: Clock = SYSTEM_CLOCK, crash: Callable[[], None] = _crash_process,
                 faults: Faults | None = None) -> None:
        self.config = config
        self.model_name = config.model_name
        self.clock = clock
        self.engine = SimEngine(config, clock=clock, crash=self._crash_after_tokens, faults=faults)
        self._crash = crash
        self.served = ServedModel(config, self.engine.scheduler.vocab)
        self.kv = KvTransfer(config, self.engine, clock, die=crash)
        admin = Admin(admin_token if admin_token is not None else admin_token_from_env(), self.engine, self.kv,
                      self.model_name, crash)
        serving = CompletionServing(self.served, self.engine, self.kv, clock)

        app = FastAPI(lifespan=self._lifespan, openapi_url=None, docs_url=None, redoc_url=None)
        app.state.worker = self
        app.state.engine = self.engine
        r = app.router
        r.add_route("/v1/completions", serving.completions, methods=["POST"])
        r.add_route("/v1/chat/completions", serving.chat, methods=["POST"])
        r.add_route("/health", self._health, methods=["GET"])
        r.add_route("/metrics", metrics_endpoint(self.engine.stats, self.model_name), methods=["GET"])
        r.add_route("/v1/models", self._models, methods=["GET"])
        r.add_route("/admin/faults", admin.get_faults, methods=["GET"])
        r.add_route("/admin/faults", admin.post_faults, methods=["POST"])
        r.add_route("/admin/state", admin.state, methods=["GET"])
        r.add_route("/kv/{transfer_id}", self.kv.endpoint, methods=["GET"])
        if config.runtime_lora:
            lora = Adapters(self.served)
            r.add_route("/v1/load_lora_adapter", lora.load, methods=["POST"])
            r.add_route("/v1/unload_lora_adapter", lora.unload, methods=["POST"])
        self.app = app
        mount(r, self.served, self.engine, config, clock)

    @property
    def system_fingerprint(self) -> str:
        return self.served.system_fingerprint

    @property
    def vocab_size(self) -> int:
        return self.served.vocab_size

    def _crash_after_tokens(self) -> None:
        log.warning("crash_after_tokens: the token budget is spent and handed to the HTTP server")
        self._crash()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        async with asyncio.TaskGroup() as tg:
            engine = tg.create_task(self.engine.run(), name="sim-engine")
            try:
                yield
            finally:
                engine.cancel()
                await self.kv.aclose()

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _models(self, request: Request) -> Response:
        return json_response({"object": "list", "data": self.served.cards(int(self.clock.wall()))})


def create_app(config: SimConfig, *, admin_token: SecretStr | str | None = None, clock: Clock = SYSTEM_CLOCK,
               crash: Callable[[], None] = _crash_process) -> FastAPI:
    """The simulated worker's ASGI app (the engine runs in its lifespan; ``app.state.engine`` is it).

    ``admin_token`` defaults to :func:`~fleetward.fleet.config.admin_token_from_env`.
    """
    return SimWorker(config, admin_token=admin_token, clock=clock, crash=crash).app


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal which asked for a graceful shutdown is not raised again
    afterwards: a worker stopped by SIGTERM exits 0, which is what "stopped cleanly" means to a supervisor.
    Signal handlers only record (uvicorn's ``handle_exit``); a second Ctrl-C forces the exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m fleetward.sim.server",
        description="A simulated vLLM worker (OpenAI-compatible API, fault switches).")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--config-json", default=None, help="a SimConfig as JSON")
    ap.add_argument("--model-name", default=None, help="served model name (overrides the config's)")
    ap.add_argument("--faults-json", default=None, help="fault switches to start with, as POST /admin/faults "
                    "takes them (e.g. {\"crash_after_tokens\": 100})")
    ap.add_argument("--access-log", action="store_true", help="log every HTTP request")
    ap.add_argument("--log-level", default="info")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Serve one simulated worker until SIGTERM/SIGINT; return the exit code."""
    args = _parser().parse_args(argv)
    try:
        config = SimConfig.model_validate_json(args.config_json) if args.config_json else SimConfig()
        if args.model_name:
            config = SimConfig.model_validate({**config.model_dump(), "model_name": args.model_name})
    except ValidationError as exc:
        print(f"simworker: bad --config-json: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(stream=sys.stdout, level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    token_from_env = bool(os.environ.get("FLEETWARD_ADMIN_TOKEN"))
    worker = SimWorker(config, admin_token=admin_token_from_env())
    if args.faults_json:
        try:
            faults, *_ = parse_faults(json.loads(args.faults_json), worker.engine.faults)
        except (ValueError, ApiError) as exc:
            print(f"simworker: bad --faults-json: {exc}", file=sys.stderr)
            return 2
        worker.engine.update_faults(faults)
    log.info("fleetward sim worker starting: model %r on http://%s:%d, pid %d, max_model_len %d, "
             "max_num_seqs %d, kv %d tokens, admin token %s", config.model_name, args.host, args.port,
             os.getpid(), config.max_model_len, config.max_num_seqs, config.kv_capacity_tokens,
             "from FLEETWARD_ADMIN_TOKEN" if token_from_env
             else "random (set FLEETWARD_ADMIN_TOKEN to use the admin endpoints)")
    server = _Server(uvicorn.Config(
        worker.app, host=args.host, port=args.port, log_config=None, log_level=args.log_level,
        access_log=args.access_log, timeout_graceful_shutdown=3, lifespan="on"))
    server.run()
    log.info("fleetward sim worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
