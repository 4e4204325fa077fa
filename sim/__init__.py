"""The simulated worker: a stand-in for a vLLM server that speaks the same HTTP API, with fault switches.

- :mod:`.engine`: a sans-IO continuous-batching scheduler (:class:`~.engine.SimScheduler`) under a thin
  async engine, with a latency model of a GPU;
- :mod:`.server`: the OpenAI-compatible server (``python -m fleetward.sim.server``) with vLLM's metric
  names and the ``/admin/faults`` switches chaos experiments use;
- :mod:`.model`: the deterministic "model" (any continuation is a pure function of the prefix), so a
  fault-free reference is known without a run;
- :mod:`.tokenizer`: the byte-level vocabulary shared by the sim and the tiny vLLM model;
- :mod:`.tinymodel`: writes the tiny Llama that real vLLM serves on a CPU (``fleetward model tiny``).

The product never imports this package: the ``sim`` backend starts the server as a process.
"""
