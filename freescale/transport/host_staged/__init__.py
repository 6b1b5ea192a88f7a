"""The SM-free transport: collectives staged through host memory and moved by a CPU proxy.

No kernel of ours runs for a transfer: on CUDA the copy engine stages tensors through pinned
host memory, and on any machine a proxy thread per rank moves the bytes, through shared
memory between ranks of one host and gloo point-to-point between hosts. One concern per
module:

- ``memory``: rings, memory files, the result pool, the local-path probe;
- ``wire``: the control messages between ranks of one host, peers and their liveness;
- ``scheduler``: ops and handles, the proxy thread and who runs a collective, the failure latch;
- ``local``: one collective's exchange with the peers on this host, as a state machine;
- ``remote``: the part that crosses hosts;
- ``staging``: CUDA tensors to and from pinned host memory on a copy stream;
- ``transport``: ``HostStagedTransport``, which ties them together.
"""

from freescale.transport.host_staged.transport import HostStagedTransport

__all__ = ["HostStagedTransport"]
