"""The unit tier's membership: what tests/conftest.py marks slow from the measured durations."""

import conftest


class FakeItem:
    def __init__(self, nodeid, slow=False):
        self.nodeid, self.markers = nodeid, ["slow"] if slow else []

    def get_closest_marker(self, name):
        return name if name in self.markers else None

    def add_marker(self, marker):
        self.markers.append(marker.name)


def test_a_test_measured_over_a_second_is_slow_whatever_its_marks(monkeypatch):
    over = conftest.FAST_TEST_SECONDS + 0.01
    measured = {"a::costly": over, "a::cheap": conftest.FAST_TEST_SECONDS, "a::marked": 0.1}
    monkeypatch.setattr(conftest, "_measured_durations", lambda: measured)
    items = [FakeItem("a::costly"), FakeItem("a::cheap"), FakeItem("a::marked", slow=True), FakeItem("a::new")]
    conftest.SlowByMeasure().pytest_collection_modifyitems(items)
    assert [item.markers for item in items] == [["slow"], [], ["slow"], []]


def test_the_rule_runs_before_marks_select_the_tier(pytestconfig):
    # Registered by pytest_configure; pluggy calls a hook's implementations from the last listed to
    # the first, so -m "not slow" (pytest's mark plugin) must come before the rule in the list.
    plugins = [impl.plugin for impl in pytestconfig.pluginmanager.hook.pytest_collection_modifyitems.get_hookimpls()]
    rule = pytestconfig.pluginmanager.get_plugin("terra-slow-by-measure")
    assert isinstance(rule, conftest.SlowByMeasure)
    assert plugins.index(pytestconfig.pluginmanager.get_plugin("mark")) < plugins.index(rule)
