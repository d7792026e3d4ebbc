"""Gate target expressions (``--targets``, recipes' ``validate.targets``, ``quantize --accuracy-target``)."""

from __future__ import annotations

import pytest

from bertopt.errors import UserError
from bertopt.measure.targets import Target, parse_targets


def test_targets_read_with_their_default_directions():
    assert parse_targets("cos_min=0.995, max_abs<=0.05, speedup=1.2, accuracy_degradation=0.01") == [
        Target("cos_min", ">=", 0.995), Target("max_abs", "<=", 0.05), Target("speedup", ">=", 1.2),
        Target("accuracy_degradation", "<=", 0.01)]


@pytest.mark.parametrize("text, said", [
    # these ran the whole gate (minutes on a real model) to end "gate failed" every time
    ("cos_min>=2", "target 'cos_min>=2' can never hold: cos_min is at most 1"),
    ("neighbour_agreement_at_10=1.5", "neighbour_agreement_at_10 is at most 1"),
    ("max_abs<=-0.1", "target 'max_abs<=-0.1' can never hold: max_abs is never below 0"),
    ("batch_dev=-1e-3", "batch_dev is never below 0"),
])
def test_a_target_no_measurement_can_meet_is_refused_up_front(text, said):
    with pytest.raises(UserError, match=said.replace("(", r"\(")):
        parse_targets(text)


@pytest.mark.parametrize("text", ["cos_min>=1", "speedup=3", "accuracy_degradation<=-0.01", "max_abs<=0"])
def test_bounds_at_the_ends_or_on_unbounded_metrics_are_kept(text):
    assert len(parse_targets(text)) == 1


def test_a_targets_parts_name_its_output_metric_and_grid_point():
    assert [t.parts for t in parse_targets("pooled.cos_min>=0.99,speedup@32x128>=1.2,batch_dev<=1e-3")] == [
        ("pooled", "cos_min", ""), (None, "speedup", "32x128"), (None, "batch_dev", "")]
    # an ONNX output name may hold a dot; a metric name never does
    assert parse_targets("output.1.max_abs<=0.01")[0].parts == ("output.1", "max_abs", "")
