"""transforms/flink_keys.py routes keys exactly as Beam's Flink runner and Flink do: checked against Beam's
FlinkKey and Flink's own KeyGroupRangeAssignment, run in jshell with the job server's classes."""

from __future__ import annotations

import random
import shutil
import subprocess

import pytest

from runners.bootstrap import ensure_flink_job_server
from transforms.flink_keys import default_max_parallelism, flink_key_hash, operator_index

pytestmark = pytest.mark.skipif(shutil.which("jshell") is None, reason="needs a JDK's jshell")


def test_operator_index_is_flinks(tmp_path):
    rng = random.Random(7)
    keys = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 24))) for _ in range(40)]
    script = tmp_path / "route.jsh"
    literals = ", ".join("new byte[]{" + ", ".join(f"(byte){b}" for b in key) + "}" for key in keys)
    script.write_text(
        "import org.apache.flink.runtime.state.KeyGroupRangeAssignment;\nimport java.nio.ByteBuffer;\n"
        "import org.apache.beam.runners.flink.adapter.FlinkKey;\n"
        f"byte[][] keys = {{ {literals} }};\n"
        "for (byte[] k : keys) { FlinkKey b = FlinkKey.of(ByteBuffer.wrap(k)); System.out.println(\"ROUTE \" + b.hashCode()"
        " + \" \" + KeyGroupRangeAssignment.assignKeyToParallelOperator(b, 128, 2)"
        " + \" \" + KeyGroupRangeAssignment.assignKeyToParallelOperator(b, 128, 3)"
        " + \" \" + KeyGroupRangeAssignment.assignKeyToParallelOperator(b, 256, 5)"
        " + \" \" + KeyGroupRangeAssignment.computeDefaultMaxParallelism(100)); }\n/exit\n")
    lib = ensure_flink_job_server().parent / "lib"  # the runner, its vendored Guava, Flink
    out = subprocess.run(["jshell", "--class-path", f"{lib}/*", str(script)], capture_output=True, text=True,
                         timeout=120).stdout
    java = [tuple(map(int, line.split()[1:])) for line in out.splitlines() if line.startswith("ROUTE ")]
    ours = [(flink_key_hash(k), operator_index(k, 2), operator_index(k, 3), operator_index(k, 5, 256),
             default_max_parallelism(100)) for k in keys]
    assert len(java) == len(keys) and java == ours
    assert {index for _, index, *_ in ours} == {0, 1}  # the keys do spread: the check can fail
