"""Deprecated: the step reader moved to `beam_rl.trainer.reader`; this module keeps
`from beam_rl.reader import StepReader` working for one release."""

import warnings

from beam_rl.trainer.reader import *  # noqa: F403
from beam_rl.trainer.reader import __all__  # noqa: F401

warnings.warn("beam_rl.reader is deprecated: import from beam_rl.trainer.reader instead",
              DeprecationWarning, stacklevel=2)
