"""KV transfer between prefill and decode workers: the wire protocol, its checks, and the hook faults go through.

A prefill worker that computed a prompt's KV keeps it for a lease and answers the router with
``kv_transfer_params`` (:class:`KvOffer`): where to pull it, how many tokens and blocks it covers, and the
digest of what it computed. The decode worker pulls it (``GET <remote_url>/kv/<transfer_id>``) as a stream of
frames, one per KV block, then an end frame::

    header  magic "KV", version, flags (0 block, 1 end), seq, first token, tokens, payload length,
            8-byte check (BLAKE2b of transfer id, seq, first token and payload)
    payload the block's bytes

:func:`pull` checks everything a transfer can get wrong before the decode side uses the KV, and raises
:class:`KvTransferError` with the kind:

=============  =======================================================================================
kind           what happened
=============  =======================================================================================
unreachable    the prefill worker did not answer (gone, or its process died)
expired        it no longer holds the transfer (its lease ran out: the blocks were freed)
timeout        the transfer did not complete within the decode side's deadline (a stall, a slow link)
incomplete     the stream ended before its end frame (the prefill side died mid-transfer)
protocol       not a frame
checksum       a block's bytes are not what the sender framed (corrupted on the way)
duplicate      a block came twice
gap            a block is missing between two others
truncated      the end frame came before every announced block
digest         every frame is sound, but the KV is not the KV computed for this prompt (stale blocks:
               reused, or another request's; or corrupted before framing)
=============  =======================================================================================

With ``verify`` off (what a connector without checks does), :func:`pull` returns whatever arrived, in
order, with missing bytes as zeros; the decode side then decodes from it, and wrong KV gives wrong tokens
with HTTP 200 (docs/pd.md shows vLLM doing exactly that).

KV moved as files (vLLM's ExampleConnector, one safetensors file per layer in a folder per prompt) gets the
same kind of check: :func:`write_manifest` on the producer's side, :func:`check_folder` before the consumer
loads (:mod:`fleetward.fleet.kvconnector` runs both inside vLLM).

The sender passes every transfer's frames through a :class:`KvSendHook` on their way out. Outside chaos runs
it is :class:`PassThrough`; the simulated worker's fault switches put a faulty one in its place
(:mod:`fleetward.sim.kvfaults`), so KV faults happen on the wire and the checks above meet them there.
The sender paces frames by a :class:`KvLink` cost model (latency, bandwidth), so a transfer takes the time
its bytes would.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import struct
from array import array
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, get_args

import aiohttp

from fleetward.fleet.errors import FleetwardError

__all__ = ["KV_ERROR_KINDS", "KV_ERROR_TYPE", "MANIFEST", "KvFrame", "KvLink", "KvOffer", "KvReceived",
           "KvSendHook", "KvSenderDied", "KvTransferError", "PassThrough", "check_folder", "digest", "frames_of",
           "pull", "send", "write_manifest"]

KvErrorKind = Literal["unreachable", "expired", "timeout", "incomplete", "protocol", "checksum", "duplicate", "gap",
                      "truncated", "digest"]
KV_ERROR_KINDS: tuple[str, ...] = get_args(KvErrorKind)
KV_ERROR_TYPE = "KVTransferError"  # the ``error.type`` a decode worker answers a failed transfer with

_HEADER = struct.Struct("<2sBBIIII8s")
_MAGIC, _VERSION = b"KV", 1
_BLOCK, _END = 0, 1


class KvTransferError(FleetwardError):
    """A transfer the decode side must not use: re-prefill, recompute, or fail the request."""

    def __init__(self, kind: KvErrorKind, transfer: str, detail: str = "") -> None:
        super().__init__(f"kv transfer {transfer}: {kind}" + (f" ({detail})" if detail else ""))
        self.kind: KvErrorKind = kind
        self.transfer = transfer


class KvSenderDied(Exception):
    """Raised inside a send hook: the prefill side stops mid-transfer (the connection is cut)."""


def _check(transfer_id: str, seq: int, first: int, payload: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    h.update(transfer_id.encode())
    h.update(struct.pack("<II", seq, first))
    h.update(payload)
    return h.digest()


def digest(token_ids: Sequence[int], payloads: Sequence[bytes]) -> str:
    """What the prefill side computed: the covered prompt tokens and every block, in order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(array("q", token_ids).tobytes())
    for p in payloads:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class KvFrame:
    """One frame: a block (``end`` False) or the end frame (``seq`` is then the number of blocks sent)."""

    transfer_id: str
    seq: int
    first: int = 0  # first token the block covers
    tokens: int = 0
    payload: bytes = b""
    end: bool = False
    check: bytes = b""

    def sealed(self, transfer_id: str | None = None) -> KvFrame:
        """This frame with its check computed (for ``transfer_id``: a sender may reframe another's block)."""
        tid = self.transfer_id if transfer_id is None else transfer_id
        return KvFrame(tid, self.seq, self.first, self.tokens, self.payload, self.end,
                       _check(tid, self.seq, self.first, self.payload))

    def encode(self) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, _END if self.end else _BLOCK, self.seq, self.first, self.tokens,
                            len(self.payload), self.check) + self.payload


def frames_of(transfer_id: str, blocks: Sequence[bytes], block_tokens: int) -> list[KvFrame]:
    """A transfer's frames: one per block, sealed, then the end frame."""
    out = [KvFrame(transfer_id, i, i * block_tokens, len(b) and block_tokens, b).sealed()
           for i, b in enumerate(blocks)]
    out.append(KvFrame(transfer_id, len(blocks), end=True).sealed())
    return out


@dataclass(frozen=True, slots=True)
class KvOffer:
    """The ``kv_transfer_params`` a prefill worker answers with (vLLM's disaggregated-serving field)."""

    remote_url: str
    transfer_id: str
    tokens: int  # prompt tokens the KV covers (whole blocks)
    blocks: int
    digest: str
    nbytes: int = 0  # the blocks' bytes (fleetward's own field: what a move or a transfer carries)

    def params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_url": self.remote_url,
                "transfer_id": self.transfer_id, "num_tokens": self.tokens, "num_blocks": self.blocks,
                "digest": self.digest, "num_bytes": self.nbytes}

    @classmethod
    def of(cls, params: object) -> KvOffer | None:
        """The offer in a request's ``kv_transfer_params``; None when they carry none (nothing to pull)."""
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        try:
            return cls(str(params["remote_url"]).rstrip("/"), str(params["transfer_id"]), int(params["num_tokens"]),
                       int(params["num_blocks"]), str(params["digest"]), int(params.get("num_bytes") or 0))
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class KvLink:
    """The cost model of the link between a prefill and a decode worker."""

    latency_s: float = 0.0005
    bandwidth_bytes_s: float = 1.25e9  # 10 Gbit/s

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bandwidth_bytes_s if self.bandwidth_bytes_s > 0 else 0.0


class KvSendHook(Protocol):
    """Every transfer's frames pass through ``send`` on their way out (in order, the end frame last).

    A hook may alter, drop, repeat, delay or hold frames, or raise :class:`KvSenderDied` to cut the
    transfer. Outside chaos runs it is :class:`PassThrough`.
    """

    def send(self, transfer_id: str, frames: Sequence[KvFrame]) -> AsyncIterator[KvFrame]: ...


class PassThrough:
    """The hook outside chaos runs: every frame, unchanged."""

    async def send(self, transfer_id: str, frames: Sequence[KvFrame]) -> AsyncIterator[KvFrame]:
        for f in frames:
            yield f


async def send(transfer_id: str, frames: Sequence[KvFrame], hook: KvSendHook, link: KvLink) -> AsyncIterator[bytes]:
    """The bytes of a transfer as the sender puts them on the wire: through ``hook``, paced by ``link``.

    Pacing holds each frame until the link would have carried everything before it (latency, then the bytes
    at its bandwidth, from the first frame on), sleeping only when that is a millisecond or more ahead: a
    running deadline, so sleeping late once does not slow every frame after it.
    """
    clock = asyncio.get_running_loop().time
    due = clock() + link.latency_s
    async for f in hook.send(transfer_id, frames):
        data = f.encode()
        due += link.seconds(len(data))
        ahead = due - clock()
        if ahead >= 0.001:
            await asyncio.sleep(ahead)
        yield data
    ahead = due - clock()
    if ahead > 0:
        await asyncio.sleep(ahead)


@dataclass(frozen=True, slots=True)
class KvReceived:
    """The KV as the decode side will use it: ``payload`` covers ``offer.tokens`` tokens."""

    payload: bytes
    blocks: int
    verified: bool


async def pull(session: aiohttp.ClientSession, offer: KvOffer, token_ids: Sequence[int], *, timeout: float,
               verify: bool = True) -> KvReceived:
    """Pull ``offer`` and check it against the prompt's ``token_ids`` (see the module docstring)."""
    tid = offer.transfer_id
    try:
        async with asyncio.timeout(timeout):
            try:
                response = await session.get(f"{offer.remote_url}/kv/{tid}")
            except (aiohttp.ClientError, OSError) as exc:
                raise KvTransferError("unreachable", tid, f"{offer.remote_url}: {type(exc).__name__}") from exc
            async with response:
                if response.status in (404, 410):
                    raise KvTransferError("expired", tid, f"the prefill worker answered {response.status}")
                if response.status != 200:
                    raise KvTransferError("unreachable", tid, f"the prefill worker answered {response.status}")
                return await _read(response.content, offer, token_ids, verify)
    except TimeoutError:
        raise KvTransferError("timeout", tid, f"not complete after {timeout:g} s") from None


async def _read(content: aiohttp.StreamReader, offer: KvOffer, token_ids: Sequence[int], verify: bool
                ) -> KvReceived:
    tid = offer.transfer_id
    blocks: list[bytes] = []
    ended = False
    try:
        while True:
            head = await content.readexactly(_HEADER.size)
            magic, version, flags, seq, first, _tokens, length, check = _HEADER.unpack(head)
            if magic != _MAGIC or version != _VERSION:
                raise KvTransferError("protocol", tid, f"frame header {head[:4]!r}")
            payload = await content.readexactly(length) if length else b""
            if flags == _END:
                if verify and seq != offer.blocks:
                    raise KvTransferError("truncated", tid, f"the sender ended after {seq} of {offer.blocks} blocks")
                ended = True
                break
            if verify:
                if check != _check(tid, seq, first, payload):
                    raise KvTransferError("checksum", tid, f"block {seq}")
                if seq < len(blocks):
                    raise KvTransferError("duplicate", tid, f"block {seq} again after {len(blocks)}")
                if seq > len(blocks):
                    raise KvTransferError("gap", tid, f"block {seq} after {len(blocks)}")
            blocks.append(payload)
    except asyncio.IncompleteReadError:
        pass
    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError):
        pass
    if verify:
        if not ended:
            raise KvTransferError("incomplete", tid, f"the stream ended after {len(blocks)} of {offer.blocks} blocks")
        if len(blocks) != offer.blocks:
            raise KvTransferError("truncated", tid, f"{len(blocks)} of {offer.blocks} blocks")
        if digest(token_ids[:offer.tokens], blocks) != offer.digest:
            raise KvTransferError("digest", tid, "the blocks are not the KV computed for this prompt")
    return KvReceived(b"".join(blocks), len(blocks), verify)


# -- KV as files (vLLM's ExampleConnector: fleetward.fleet.kvconnector) ------------------------------------

MANIFEST = "fleetward-manifest.json"


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, tokens: int) -> None:
    """The manifest of a KV folder as it is now: the folder it is for, the tokens its KV covers, a digest of
    every layer file. Written atomically: a reader sees all of it or none."""
    files = {p.name: _file_digest(p) for p in sorted(folder.glob("*.safetensors"))}
    tmp = folder / f".{MANIFEST}.{os.getpid()}"
    tmp.write_text(json.dumps({"folder": folder.name, "tokens": tokens, "files": files}))
    tmp.replace(folder / MANIFEST)


def check_folder(folder: Path, tokens: int) -> tuple[KvErrorKind, str] | None:
    """Why the KV in ``folder`` must not be loaded for ``tokens`` prompt tokens: ``(kind, detail)``, or None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return "incomplete", "no manifest: the producer did not finish writing it"
    except (OSError, ValueError) as exc:
        return "incomplete", f"unreadable manifest: {exc}"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "incomplete", "malformed manifest"
    if manifest.get("folder") != folder.name or manifest.get("tokens") != tokens:
        return "digest", (f"the manifest is of {manifest.get('folder')!r} ({manifest.get('tokens')} tokens), not "
                          f"of this prompt ({folder.name}, {tokens} tokens): stale KV")
    present = {p.name for p in folder.glob("*.safetensors")}
    if missing := sorted(set(manifest["files"]) - present):
        return "truncated", f"{len(missing)} layer file(s) missing, e.g. {missing[0]}"
    if extra := sorted(present - set(manifest["files"])):
        return "digest", f"{len(extra)} layer file(s) not in the manifest, e.g. {extra[0]}"
    for name, want in manifest["files"].items():
        if _file_digest(folder / name) != want:
            return "checksum", f"{name} is not what the producer wrote"
    return None
