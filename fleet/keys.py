"""The etcd key space, all under ``/fleetward/<cluster>/``.

docs/architecture.md ("etcd key space") says who writes what, and for how long it lives.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Keys"]


@dataclass(frozen=True)
class Keys:
    cluster: str

    @property
    def root(self) -> str:
        return f"/fleetward/{self.cluster}/"

    @property
    def workers(self) -> str:
        return self.root + "workers/"

    def worker(self, worker_id: str) -> str:
        return self.workers + worker_id

    @property
    def routers(self) -> str:
        return self.root + "routers/"

    def router(self, router_id: str) -> str:
        return self.routers + router_id

    @property
    def health(self) -> str:
        return self.root + "health/"

    def health_of(self, worker_id: str) -> str:
        return self.health + worker_id

    @property
    def requests(self) -> str:
        return self.root + "requests/"

    def request(self, request_id: str) -> str:
        return self.requests + request_id

    @property
    def signals(self) -> str:
        return self.root + "signals/"

    def signal(self, worker_id: str, detector: str) -> str:
        """``signals/<worker>/<detector>``: what a node agent's detector last said about a worker."""
        return f"{self.signals}{worker_id}/{detector}"

    @property
    def actions(self) -> str:
        return self.root + "actions/"

    def actions_of(self, node: str) -> str:
        return f"{self.actions}{node}/"

    def action(self, node: str, action_id: str) -> str:
        """``actions/<node>/<id>``: a remediation the supervisor leader asked this node's agent to carry out."""
        return f"{self.actions}{node}/{action_id}"

    @property
    def attach(self) -> str:
        return self.root + "attach/"

    def attached(self, worker_id: str) -> str:
        """``attach/<id>``: a server fleetward did not start, to adopt (what ``attach:`` and ``worker add`` say)."""
        return self.attach + worker_id

    @property
    def agents(self) -> str:
        return self.root + "agents/"

    def agent(self, node: str) -> str:
        """``agents/<node>``: a node agent's ``/metrics`` address, bound to its lease."""
        return self.agents + node

    def leader(self, role: str) -> str:
        return f"{self.root}leader/{role}/"

    @property
    def quarantine(self) -> str:
        return self.root + "quarantine/"

    def quarantine_of(self, node: str, gpu: int | str) -> str:
        return f"{self.quarantine}{node}/{gpu}"

    @property
    def moves(self) -> str:
        return self.root + "moves/"

    def move(self, order_id: str) -> str:
        return self.moves + order_id

    @property
    def scale(self) -> str:
        return self.root + "scale/"

    def scale_of(self, pool: str) -> str:
        return self.scale + pool

    def tail(self, key: str, prefix: str) -> str:
        """The part of ``key`` after ``prefix`` (e.g. the worker id of a ``workers/<id>`` key)."""
        if not key.startswith(prefix):
            raise ValueError(f"{key!r} is not under {prefix!r}")
        return key[len(prefix):]
