"""The kernel backend: iptables rules that drop or reset loopback TCP traffic.

:class:`IptablesFilter` is the optional kernel backend (root and the ``iptables`` command): it drops or
resets TCP traffic to or from loopback ports. This kernel has no netem, so latency and bandwidth exist only
in the proxy.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from typing import Literal

from fleetward.fleet.claims import claim, release

__all__ = ["IptablesFilter"]


class IptablesFilter:
    """Drop or reset loopback TCP traffic to or from ports, in a chain of its own (root and ``iptables``).

    Every rule lives in the chain ``FW-<name>``, jumped to from ``OUTPUT`` for the loopback interface;
    :meth:`clear` removes the jump and the chain, so nothing is left behind. It affects every process that
    talks to those ports, not only one link.
    """

    def __init__(self, name: str) -> None:
        self.chain = ("FW-" + "".join(c if c.isalnum() else "-" for c in name))[:28]
        self._installed = False

    @staticmethod
    def unavailable_reason() -> str | None:
        """Why the kernel backend cannot be used here, or None when it can."""
        if os.geteuid() != 0:
            return "the iptables backend needs root"
        if shutil.which("iptables") is None:
            return "the iptables command is not installed (Debian: apt-get install iptables)"
        return None

    @staticmethod
    async def _run(*args: str, check: bool = True) -> int:
        proc = await asyncio.create_subprocess_exec("iptables", "-w", *args, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        if check and proc.returncode:
            raise RuntimeError(f"iptables {' '.join(args)}: {err.decode().strip()}")
        return proc.returncode or 0

    async def _ensure(self) -> None:
        if self._installed:
            return
        reason = self.unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        claim("iptables", self.chain)  # a run killed before clear() leaves it to the next one's reclaim
        await self._run("-N", self.chain, check=False)
        await self._run("-I", "OUTPUT", "-o", "lo", "-j", self.chain)
        self._installed = True

    async def block(self, port: int, *, action: Literal["drop", "reset"] = "drop",
                    direction: Literal["to", "from", "both"] = "both") -> None:
        """Drop (silently: a partition) or reset (RST) TCP segments to and/or from ``port`` on loopback."""
        await self._ensure()
        target = ["-j", "DROP"] if action == "drop" else ["-j", "REJECT", "--reject-with", "tcp-reset"]
        if direction in ("to", "both"):
            await self._run("-A", self.chain, "-p", "tcp", "--dport", str(port), *target)
        if direction in ("from", "both"):
            await self._run("-A", self.chain, "-p", "tcp", "--sport", str(port), *target)

    async def clear(self) -> None:
        """Remove every rule, the jump and the chain (idempotent)."""
        if shutil.which("iptables") is None:
            return
        while await self._run("-D", "OUTPUT", "-o", "lo", "-j", self.chain, check=False) == 0:
            pass
        await self._run("-F", self.chain, check=False)
        await self._run("-X", self.chain, check=False)
        release("iptables", self.chain)
        self._installed = False
