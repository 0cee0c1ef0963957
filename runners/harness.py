"""What beam-rl changes in Beam's Python SDK harness, the code that runs the pipeline's stages (in this
process for `loopback`, in worker processes otherwise).

**A data stream the runner hangs up on is not raised a second time.** A Flink TaskManager closing an SDK
environment (a job that ended or was cancelled) shuts its control server and then its data server, one
right after the other: the data multiplexer ends each open stream with CANCELLED ("Multiplexer hanging
up"). The harness closes its data channels once it sees the control stream end; when the CANCELLED comes
first, its reader thread (`read_grpc_client_inputs`) logs the error, records it for any bundle still
reading that channel, and then raises it again, out of the thread, where nobody can catch it: Python
prints it as an unhandled thread exception. One job end in a few lost that race (tests/pipeline/test_rollouts.py
requires workers to end quietly). `quiet_hangups()` keeps everything but that last raise, and only for
CANCELLED: a bundle still reading the channel gets the error as before, and Beam's log has it.
"""

from __future__ import annotations

import functools

import grpc
from apache_beam.runners.worker import data_plane

_PATCHED = "_beam_rl_quiet_hangups"


def quiet_hangups() -> None:
    """Installs the change above in this process's harness (idempotent)."""
    channel = data_plane._GrpcDataChannel
    if getattr(channel._read_inputs, _PATCHED, False):
        return
    read_inputs = channel._read_inputs

    @functools.wraps(read_inputs)
    def _read_inputs(self, elements_iterator):  # type: ignore[no-untyped-def]
        try:
            read_inputs(self, elements_iterator)
        except grpc.RpcError as err:
            # Beam recorded it (self._exception) for the bundles that read this channel: raised here, it
            # would only reach threading's excepthook.
            if err is not self._exception or err.code() != grpc.StatusCode.CANCELLED:
                raise

    setattr(_read_inputs, _PATCHED, True)
    channel._read_inputs = _read_inputs  # type: ignore[method-assign]  # the patch
