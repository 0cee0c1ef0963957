"""WriteTrainBatches' stages (split on the packer's key, file writers, committer) run one after the other
in this process, the committer's state in a fake bag: a step writer for tests that feed the packer by hand."""

from __future__ import annotations

from typing import Any

from beam_rl.rundir.step_parts import FileToWrite
from tests.support.fakes import StateBag
from transforms.write import _CommitFn, _split, _WriteFileFn


class InProcessWriter:
    def __init__(self, run_dir: str) -> None:
        self.files, self.commit, self.parts = _WriteFileFn(run_dir), _CommitFn(run_dir), StateBag()
        self.files.setup()
        self.commit.setup()

    def split(self, item: Any) -> tuple[list[Any], list[Any]]:
        """The files to write, keyed, and what the writers pass on to the committer, of a packer output."""
        out = list(_split(item))
        files = [keyed for keyed in out if isinstance(keyed[1], FileToWrite)]
        others = [keyed for keyed in out if not isinstance(keyed[1], FileToWrite)]
        return files, [passed for keyed in others for passed in self.files.process(keyed)]

    def write(self, keyed_file: Any) -> list[Any]:
        return list(self.files.process(keyed_file))

    def deliver(self, part: Any) -> list[int]:
        """Hand one part to the committer; the steps it committed."""
        return list(self.commit.process(part, parts=self.parts))

    def process(self, item: Any) -> list[int]:
        """Every stage for one packer output, in order: the steps committed."""
        files, plans = self.split(item)
        committed = [step for plan in plans for step in self.deliver(plan)]
        for keyed in files:
            committed += [step for written in self.write(keyed) for step in self.deliver(written)]
        return committed
