"""The core the torch backend and CollectiveContext's users stand on: the
collectives over this package's endpoints.  collective.py is
CollectiveContext (bootstrap, point to point, allgather) with its handles
(handles.py); stream_group.py the stream-ordered groups of the ranks on one
host (rounds queued on CUDA streams); gpu_ring.py the GPU-initiated
transfers; dispatch.py the one place that chooses each collective's route
(the C fast path, a stream-ordered round, a task of the host-driven engine,
the Gloo-style CPU path).  Modules here import the engine
(uccl_collective._engine), the p2p face (uccl_collective.p2p), each other,
torch and the standard library, never uccl_collective.backend (what the
backend hands the dispatch, such as its Work type, comes in as arguments)."""
