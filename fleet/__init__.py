"""fleetward's shared core: worker model, backends, etcd state store, MQTT event bus, config, clock,
local infrastructure, and the CLI (the composition root)."""

import os as _os

# gRPC (under aetcd) prints a warning on every fork while its threads run; fleetward forks workers and
# infrastructure on purpose and never uses gRPC in a child. Must be set before grpc is imported.
_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
