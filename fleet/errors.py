"""The exception hierarchy of fleetward: one root, translated at each adapter.

::

    FleetwardError                  root; ``retryable`` says whether trying again may help
    ├── ConfigError                 a config or experiment file is wrong: file, line, field
    ├── UnavailableError            an outside system cannot be reached (retryable)
    │   ├── StoreUnavailable        etcd
    │   └── BusUnavailable          the MQTT broker
    ├── StoreError                  etcd answered, but the operation failed (e.g. compacted revision)
    ├── ProcessError                a process could not be started, or died while starting
    │   └── PortInUseError          a port we were asked to bind is taken
    ├── WorkerError                 a worker answered with an error (status, body)
    └── NoCapacityError             no healthy worker can take a request (retryable)

Foreign exceptions (grpc, aetcd, aiomqtt, httpx, OSError) never cross a module boundary untranslated: the
adapter that talks to the outside system wraps them with ``raise ... from exc``.
"""

from __future__ import annotations

__all__ = [
    "BusUnavailable",
    "ConfigError",
    "FleetwardError",
    "NoCapacityError",
    "PortInUseError",
    "ProcessError",
    "StoreError",
    "StoreUnavailable",
    "UnavailableError",
    "WorkerError",
]


class FleetwardError(Exception):
    """Root of every error fleetward raises on purpose."""

    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(FleetwardError):
    """A config, fleet or experiment file (or a flag) holds a bad value.

    ``str(err)`` reads ``file:line: field: problem`` so editors and terminals can jump to it.
    """

    def __init__(self, problem: str, *, file: str | None = None, line: int | None = None,
                 field: str | None = None) -> None:
        self.problem = problem
        self.file = file
        self.line = line
        self.field = field
        where = ""
        if file is not None:
            where = f"{file}:{line}: " if line is not None else f"{file}: "
        what = f"{field}: " if field else ""
        super().__init__(f"{where}{what}{problem}")


class UnavailableError(FleetwardError):
    """An outside system did not answer after bounded retries."""

    retryable = True

    def __init__(self, message: str, *, endpoint: str, attempts: int = 1) -> None:
        self.endpoint = endpoint
        self.attempts = attempts
        super().__init__(message)


class StoreUnavailable(UnavailableError):
    """etcd could not be reached."""


class BusUnavailable(UnavailableError):
    """The MQTT broker could not be reached."""


class StoreError(FleetwardError):
    """etcd answered but refused the operation."""


class ProcessError(FleetwardError):
    """A process could not be started or died before it became ready."""

    def __init__(self, message: str, *, name: str, exit_code: int | None = None,
                 log_tail: str = "") -> None:
        self.name = name
        self.exit_code = exit_code
        self.log_tail = log_tail
        super().__init__(message)


class PortInUseError(ProcessError):
    """A port that was asked for explicitly is already bound by someone else."""

    def __init__(self, host: str, port: int, *, name: str) -> None:
        self.host = host
        self.port = port
        super().__init__(f"{name}: port {port} on {host} is already in use; pick another port "
                         f"(or stop what holds it: `ss -ltnp 'sport = :{port}'`)", name=name)


class WorkerError(FleetwardError):
    """A worker answered a request with an error status."""

    def __init__(self, message: str, *, status: int, worker: str | None = None) -> None:
        self.status = status
        self.worker = worker
        self.retryable = status >= 500
        super().__init__(message)


class NoCapacityError(FleetwardError):
    """No healthy worker can take the request now."""

    retryable = True
