"""WriteTrainBatches' stages (split on the packer's key, file writers, committer) run one after the other
in this process, the committer's state in a fake bag: a step writer for tests that feed the packer by hand."""

from __future__ import annotations

from typing import Any

from tests.support.fakes import StateBag
from transforms.write import _CommitFn, _split, _WriteFileFn


class InProcessWriter:
    def __init__(self, run_dir: str) -> None:
        self.files, self.commit, self.parts = _WriteFileFn(run_dir), _CommitFn(run_dir), StateBag()
        self.files.setup()
        self.commit.setup()

    def split(self, item: Any) -> tuple[list[Any], list[Any]]:
        """The files to write and the committer's parts of a packer output, as `_split` emits them."""
        out = list(_split(item))
        return [p for p in out if not hasattr(p, "tag")], [p.value for p in out if hasattr(p, "tag")]

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
