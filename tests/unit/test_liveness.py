"""Durations as the health page shows them."""

from __future__ import annotations

from api.services import health as health_service


def test_duration_reads_in_two_units() -> None:
    assert health_service.duration(60) == "1 min"
    assert health_service.duration(75.9) == "1 min 15 s"
    assert health_service.duration(3 * 3600 + 5 * 60 + 7) == "3 h 5 min"
    assert health_service.duration(2 * 86400 + 7 * 3600) == "2 d 7 h"
