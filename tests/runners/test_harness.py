"""runners/harness.py: a data stream the runner hangs up on (CANCELLED, as Flink's data multiplexer ends
every stream when it closes an environment) is not raised out of the harness's reader thread, while a
bundle still reading the channel fails as before."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from apache_beam.portability.api import beam_fn_api_pb2_grpc
from apache_beam.runners.worker import data_plane

from runners.harness import quiet_hangups


_BUNDLE_ERROR = "Channel closed prematurely."  # what Beam raises in a bundle reading a channel that ended


class _HangingUp(beam_fn_api_pb2_grpc.BeamFnDataServicer):
    def __init__(self, code: grpc.StatusCode) -> None:
        self.code = code

    def Data(self, request_iterator, context):  # noqa: N802 (the gRPC method's name)
        context.abort(self.code, "Multiplexer hanging up")


@pytest.fixture
def unpatched():
    """Beam's reader as shipped for the test, whether or not an earlier pipeline of this process installed
    quiet_hangups (a process-wide change); whatever was there is put back after it."""
    installed = data_plane._GrpcDataChannel._read_inputs
    data_plane._GrpcDataChannel._read_inputs = getattr(installed, "__wrapped__", installed)
    yield
    data_plane._GrpcDataChannel._read_inputs = installed


def _reader_thread_errors(code: grpc.StatusCode) -> tuple[list[BaseException], BaseException | None]:
    """Connects a harness data channel to a server that ends the stream with `code`; returns what escaped
    the reader thread and what a bundle reading the channel then raises."""
    escaped: list[BaseException] = []
    hook = threading.excepthook
    threading.excepthook = lambda args: escaped.append(args.exc_value)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    beam_fn_api_pb2_grpc.add_BeamFnDataServicer_to_server(_HangingUp(code), server)
    port = server.add_insecure_port("localhost:0")
    server.start()
    try:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            data = data_plane.GrpcClientDataChannel(beam_fn_api_pb2_grpc.BeamFnDataStub(channel))
            data.wait(timeout=10)
            [reader] = [t for t in threading.enumerate() if t.name == "read_grpc_client_inputs"] or [None]
            if reader is not None:
                reader.join(timeout=10)
            try:
                list(data.input_elements("bundle-1", ["transform-1"]))
                in_bundle = None
            except Exception as err:  # noqa: BLE001 (what the bundle sees is the point)
                in_bundle = err
            data.close()
    finally:
        server.stop(0)
        threading.excepthook = hook
    return escaped, in_bundle


def test_beam_raises_a_hangup_out_of_the_reader_thread(unpatched):
    # Beam as shipped: the reason for the change (if Beam stops doing this, the change can go).
    escaped, in_bundle = _reader_thread_errors(grpc.StatusCode.CANCELLED)
    assert [e.code() for e in escaped] == [grpc.StatusCode.CANCELLED]
    assert str(in_bundle) == _BUNDLE_ERROR


def test_a_hangup_stays_in_the_channel(unpatched):
    quiet_hangups()
    quiet_hangups()  # idempotent: wrapped once
    escaped, in_bundle = _reader_thread_errors(grpc.StatusCode.CANCELLED)
    assert escaped == []
    assert str(in_bundle) == _BUNDLE_ERROR


def test_other_stream_errors_still_escape(unpatched):
    quiet_hangups()
    escaped, in_bundle = _reader_thread_errors(grpc.StatusCode.INTERNAL)
    assert [e.code() for e in escaped] == [grpc.StatusCode.INTERNAL]
    assert str(in_bundle) == _BUNDLE_ERROR
