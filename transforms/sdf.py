"""Pieces the splittable DoFns share: an offset-range restriction over a sized element, and a manual
watermark that starts at the restriction's creation rather than at -inf or +inf."""

from __future__ import annotations

from collections.abc import Callable

from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker
from apache_beam.io.watermark_estimators import ManualWatermarkEstimator
from apache_beam.transforms.core import RestrictionProvider, WatermarkEstimatorProvider
from apache_beam.utils.timestamp import Timestamp


class OffsetRestrictions(RestrictionProvider):
    """[0, size(element)) as one restriction, never split up front (one reader per element)."""

    def __init__(self, size: Callable[[object], int]) -> None:
        self._size = size

    def initial_restriction(self, element) -> OffsetRange:
        return OffsetRange(0, self._size(element))

    def create_tracker(self, restriction: OffsetRange) -> OffsetRestrictionTracker:
        return OffsetRestrictionTracker(restriction)

    def split(self, element, restriction):
        yield restriction

    def restriction_size(self, element, restriction: OffsetRange) -> int:
        return restriction.size()


class WatermarkFromStart(WatermarkEstimatorProvider):
    def initial_estimator_state(self, element, restriction):
        return Timestamp.now()

    def create_watermark_estimator(self, estimator_state):
        return ManualWatermarkEstimator(estimator_state)
