"""vLLM's ExampleConnector with fleetward's KV check: a decode server never loads KV it cannot verify.

vLLM's ``ExampleConnector`` moves a prompt's KV between a prefill server (``kv_producer``) and a decode
server (``kv_consumer``) as safetensors files, one per layer, in a folder named by the hash of the prompt's
tokens under a shared path. Nothing checks what the decode side loads: corrupted, stale or zeroed files give
HTTP 200 with wrong tokens, a truncated file or a missing layer kills the decode server, and a one-token
prompt after a short one crashes it (docs/pd.md). This connector is the same with four changes:

- the producer writes a manifest beside the files once a request's KV is saved: the folder it belongs to,
  the number of tokens, and a BLAKE2b digest of every layer file;
- before the consumer's scheduler counts an external hit, it checks the folder against its manifest (present,
  written for this folder, every layer there, every digest right). A folder that fails is moved aside and
  removed, the request computes its prompt itself (exact, later), and the next prefill of that prompt writes
  it again. The log says ``fleetward: KV ... failed its check (<kind>: ...)``, kinds as in
  :mod:`fleetward.fleet.kv` (``incomplete``, ``truncated``, ``checksum``, ``digest``);
- a prompt too short to cover a whole block never counts as a hit (vLLM's own connector answers a negative
  count there and its engine dies);
- a prompt whose prefill was chunked gets no manifest: ExampleConnector saves only the blocks of a request's
  first chunk, under the folder of its whole prompt, and loading that folder kills the engine (a shape
  mismatch in ``inject_kv_into_layer``).

The check runs when the scheduler decides, the load a step later: a file changed in between is not seen.

Use it in ``--kv-transfer-config``::

    {"kv_connector": "FleetwardExampleConnector", "kv_connector_module_path": "fleetward.fleet.kvconnector",
     "kv_role": "kv_producer" | "kv_consumer", "kv_connector_extra_config": {"shared_storage_path": PATH}}

Imported only inside a vLLM server (it needs vLLM).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)
from vllm.logger import init_logger

from fleetward.fleet.kv import check_folder, write_manifest

__all__ = ["FleetwardExampleConnector"]

logger = init_logger(__name__)


class FleetwardExampleConnector(ExampleConnector):
    """``ExampleConnector`` with a manifest on save and a check before load (see the module docstring)."""

    def wait_for_save(self) -> None:
        super().wait_for_save()
        meta = self._get_connector_metadata()
        if not isinstance(meta, ExampleConnectorMetadata):
            return
        for request in meta.requests:
            if request.is_store and len(request.token_ids) > 0:
                folder = Path(self._generate_foldername_debug(request.token_ids, request.mm_hashes,
                                                              create_folder=True))
                if len(request.slot_mapping) < len(request.token_ids):
                    # A chunked prefill: ExampleConnector saves only the blocks of the request's first chunk,
                    # under the folder of its whole prompt. No manifest: the folder is refused, not loaded.
                    logger.warning("fleetward: KV in %s holds %d of its %d tokens (a chunked prefill); not marking "
                                "it loadable", folder, len(request.slot_mapping), len(request.token_ids))
                    continue
                write_manifest(folder, len(request.token_ids))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        token_ids = list(request.prompt_token_ids or [])
        tokens = align_to_block_size(len(token_ids) - 1, self._block_size)
        if tokens <= 0:
            return 0, False  # no whole block to load (vLLM's connector would answer a negative count)
        if not self._found_match_for_request(request):
            return 0, False
        import torch

        folder = Path(self._generate_foldername_debug(torch.tensor(token_ids)[:tokens],
                                                      [f.identifier for f in request.mm_features]))
        why = check_folder(folder, tokens)
        if why is not None:
            kind, detail = why
            logger.warning("fleetward: KV in %s for request %s failed its check (%s: %s); computing the prompt "
                           "here, and removing the folder so that the next prefill writes it again", folder,
                           request.request_id, kind, detail)
            aside = folder.with_name(f"{folder.name}.bad-{os.getpid()}-{time.monotonic_ns()}")
            try:
                folder.rename(aside)
                shutil.rmtree(aside, ignore_errors=True)
            except OSError:
                pass  # another process moved it first
            return 0, False
        matched: tuple[int | None, bool] = super().get_num_new_matched_tokens(request, num_computed_tokens)
        return matched
