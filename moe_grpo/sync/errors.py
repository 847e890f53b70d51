"""The weight sync's errors, apart from the transports (which bring torch in): the driver names them without it."""


class SyncError(RuntimeError):
    """A weight sync was refused or failed; names the part (rank, engine, tensor) and the version."""


class UnsafeRootError(SyncError):
    """A transport root another local user could write to or replace; names the path and what is wrong."""


class SyncRootFull(SyncError):
    """A bucket's memory could not be taken under the transport root (its filesystem is full); names the root, the
    bytes wanted and free, and how to make room."""
