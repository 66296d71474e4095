"""The data plane's one error type, in a module of its own so that pure parts (the RDMA wire
codec) can raise it without importing torch."""


class TransferError(RuntimeError):
    """An operation cannot complete: a peer was lost, a stream broke or stalled, a block is corrupt."""
