"""The simulated worker: a stand-in for a vLLM server that speaks the same HTTP API, with fault switches.

- :mod:`.engine`: a sans-IO continuous-batching scheduler (:class:`~.engine.SimScheduler`) under a thin
  async engine, with a latency model of a GPU;
- :mod:`.server`: the worker assembled (:class:`~.server.SimWorker`) and its command
  (``python -m fleetward.sim.server``); its HTTP API follows vLLM's ``entrypoints/openai/`` layout:

  - :mod:`.protocol`: the completion and chat request schema, checked as vLLM checks it, and vLLM's
    error body; :mod:`.sampling`: from the request to the engine's prompt ids and sampling, refused at
    vLLM's later stages;
  - :mod:`.serving`: ``/v1/completions`` and ``/v1/chat/completions`` over the engine; :mod:`.sse`:
    the one writer of their streams; :mod:`.responses`: the responses that release an engine request
    once sent, or drop the connection of a cut one;
  - :mod:`.servedmodel`: the served model's name, vocabulary and ``/v1/models`` card;
  - :mod:`.metrics`: vLLM's metric names at ``/metrics``;
  - :mod:`.admin`: the ``/admin/faults`` switches chaos experiments use, and ``/admin/state``;
  - :mod:`.kvtransfer`: prefill/decode KV offered at ``/kv/{id}`` and pulled, through the fault hook
    of :mod:`.kvfaults`;
  - :mod:`.endpoints`: vLLM's other endpoints (tokenize, embeddings, score, audio, the Responses API);

- :mod:`.model`: the deterministic "model" (any continuation is a pure function of the prefix), so a
  fault-free reference is known without a run;
- :mod:`.tokenizer`: the byte-level vocabulary shared by the sim and the tiny vLLM model;
- :mod:`.tinymodel`: writes the tiny Llama that real vLLM serves on a CPU (``fleetward model tiny``).

The product never imports this package: the ``sim`` backend starts the server as a process.
"""
