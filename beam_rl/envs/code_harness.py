"""The code environment's test harness: the program the sandbox runs (as main.py), never imported.

It reads the candidate program (solution.py) and the tests' call expressions (tests.json), runs each
call in a forked child holding a fresh copy of the program, and prints one line, `<token> <json>`,
with what each call returned, encoded with its exact types. The environment compares those values
with the expected ones outside the sandbox: they never enter it, so nothing a program does in here
can make a test pass except returning the right value. Standard library only (the sandbox's python3).
"""

import json
import os
import select
import signal
import sys
import time

MAX_REPLY_BYTES = 1 << 16  # a larger result is reported as an error, not shipped
FORK_RETRY_S = 1.0  # processes killed after the previous test may take a moment to be reaped


def encode(value, depth=0):
    """`value` as [type tag, payload]; only exact builtin types, so no object can fake equality."""
    if depth > 64:
        raise ValueError("result nested too deeply")
    kind = type(value)
    if value is None:
        return ["none", None]
    if kind in (bool, int, str):
        return [kind.__name__, value]
    if kind is float:
        return ["float", repr(value)]  # repr keeps nan and inf, which JSON cannot hold
    if kind is bytes:
        return ["bytes", value.hex()]
    if kind in (list, tuple, set, frozenset):
        return [kind.__name__, [encode(item, depth + 1) for item in value]]
    if kind is dict:
        return ["dict", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
    return ["other", kind.__qualname__]


def describe(exc):
    return f"{type(exc).__name__}: {exc}"[:300]


def run_call(code, call, reply_fd):
    """In the child: run the program, evaluate the call, send the encoded result, exit."""
    os.dup2(2, 1)  # the program's prints go to stderr: stdout carries only the harness's report
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
        reply = {"value": encode(eval(call, namespace))}
        data = json.dumps(reply).encode()
        if len(data) > MAX_REPLY_BYTES:
            raise ValueError(f"result is over {MAX_REPLY_BYTES} bytes encoded")
    except BaseException as exc:  # SystemExit too: a program that exits has not returned a value
        data = json.dumps({"error": describe(exc)}).encode()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    view = memoryview(data)
    while view:
        view = view[os.write(reply_fd, view) :]
    os._exit(0)


def fork():
    deadline = time.monotonic() + FORK_RETRY_S
    while True:
        try:
            return os.fork()
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def run_test(code, call, timeout_s):
    """One test in a child process: {"value": ...}, {"error": ...} or {"timeout": seconds}."""
    reply_r, reply_w = os.pipe()
    try:
        pid = fork()
    except OSError as exc:
        os.close(reply_r)
        os.close(reply_w)
        return {"error": f"could not start the test: {describe(exc)}"}
    if pid == 0:
        os.close(reply_r)
        run_call(code, call, reply_w)
    os.close(reply_w)
    try:
        data, timed_out = read_reply(pid, reply_r, timeout_s)
    finally:
        os.close(reply_r)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    if timed_out:
        return {"timeout": timeout_s}
    try:
        reply = json.loads(data)
    except ValueError:
        reply = None
    if isinstance(reply, dict) and len(reply) == 1 and ("value" in reply or "error" in reply):
        return reply
    if os.WIFSIGNALED(status):
        return {"error": f"the test's process was killed by {signal.Signals(os.WTERMSIG(status)).name}"}
    return {"error": "the test's process ended without a result"}


def read_reply(pid, reply_r, timeout_s):
    """What the child sent, read until the child exits (processes it started may hold the pipe
    open): (bytes, timed out)."""
    child = os.pidfd_open(pid)
    os.set_blocking(reply_r, False)
    data = b""
    deadline = time.monotonic() + timeout_s
    try:
        while len(data) <= MAX_REPLY_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return data, True
            readable = select.select([reply_r, child], [], [], left)[0]
            chunk = drain(reply_r)
            data += chunk
            if child in readable or (reply_r in readable and chunk == b""):
                return data + drain(reply_r), False
    finally:
        os.close(child)
    return data, False


def drain(fd):
    """The bytes waiting in the pipe `fd` (b"" at end of file or when none are waiting)."""
    data = b""
    while len(data) <= MAX_REPLY_BYTES:
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def end_strays():
    """Kill whatever the last test left running (everything of ours but this process; the PID
    namespace's init ignores it), so every test starts with the whole process budget."""
    for _ in range(2):
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            return


def main():
    with open("tests.json") as f:
        spec = json.load(f)
    started = time.monotonic()
    with open("solution.py", "rb") as f:
        source = f.read()
    try:
        code = compile(source, "solution.py", "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        results = [{"error": describe(exc)}] * len(spec["calls"])
    else:
        results = []
        for call in spec["calls"]:
            left = round(min(spec["test_timeout_s"], spec["budget_s"] - (time.monotonic() - started)), 2)
            results.append(run_test(code, call, left) if left > 0 else {"timeout": 0})
            end_strays()
    sys.stdout.write(f"{spec['token']} {json.dumps(results)}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
