"""Resume a stream through a fleetward router after its connection broke: a runnable example.

    python docs/examples/resume_stream.py ROUTER_URL [--model sim-tiny] [--event-ids]

It streams a completion, hangs up after a few tokens (as a network failure would), and asks for the rest:
the same request body again, with ``Last-Event-ID: <request id>:<tokens it holds>``. The router sends what
follows those tokens, from the router that served it or, through the request's checkpoint in etcd, from any
other. It prints the two parts, and the whole text.

- By default the stream is vLLM's own, byte for byte: no SSE ids. The request id is each chunk's ``id`` (also
  the ``X-Request-Id`` header), and the client counts the tokens it holds from each chunk's ``token_ids``
  (asked for with ``"return_token_ids": true``).
- With ``--event-ids`` the client asks for SSE ids (``X-Fleetward-Event-Ids: 1``; ``routing.event_ids: true``
  gives them to every stream): each event then carries ``id: <request id>:<tokens held>``, which is
  ``Last-Event-ID`` as it is.

Only httpx is needed. Any HTTP client that can send a header does the same.
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx


def stream(url: str, body: dict, headers: dict[str, str], *, hang_up_after: int | None = None) -> tuple[str, str]:
    """Stream ``body``; returns the text read and where a resume starts (``<request id>:<tokens held>``)."""
    text, request_id, held, last_id = "", "", 0, ""
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body,
                                                           headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("id: "):  # only with SSE ids asked for
                last_id = line.removeprefix("id: ")
            elif line.startswith("data: {"):
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                request_id = chunk["id"]
                for choice in chunk["choices"]:
                    text += choice["text"]
                    held += len(choice["token_ids"] or [])
                if hang_up_after is not None and held >= hang_up_after:
                    break  # the connection breaks here
    return text, last_id or f"{request_id}:{held}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("router", help="the router's URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default="sim-tiny")
    p.add_argument("--event-ids", action="store_true", help="ask for SSE ids (X-Fleetward-Event-Ids: 1)")
    args = p.parse_args()
    body = {"model": args.model, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0,
            "stream": True, "return_token_ids": True}
    headers = {"X-Fleetward-Event-Ids": "1"} if args.event_ids else {}

    head, resume_from = stream(args.router, body, headers, hang_up_after=8)
    # The same body again, with Last-Event-ID: the router sends what follows the tokens the client holds.
    tail, _ = stream(args.router, body, {**headers, "Last-Event-ID": resume_from})
    print(json.dumps({"head": head, "resumed_from": resume_from, "tail": tail, "text": head + tail}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
