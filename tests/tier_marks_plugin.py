"""A pytest plugin for tests/test_tiers.py: after collection (and conftest's quick marking) it
prints one line per collected test with the tier markers it carries, so one collection of the
suite gives every tier's count (`pytest --collect-only -p tier_marks_plugin`)."""

PREFIX = "tier-marks\t"


def pytest_collection_finish(session):
    for item in session.items:
        marks = sorted(m for m in ("quick", "gpu") if item.get_closest_marker(m) is not None)
        print(f"{PREFIX}{item.nodeid}\t{','.join(marks)}")
