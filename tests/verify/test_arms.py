"""verify.arms: endpoints parsed with errors that name the flag."""

from __future__ import annotations

import pytest

from sgl_kvtier.errors import ConfigError
from sgl_kvtier.serving.launch import Offload
from sgl_kvtier.verify.arms import Arm, parse_endpoint


def test_an_endpoint_names_its_arm_and_urls():
    arm = parse_endpoint("l3=http://10.0.0.5:30000/, http://10.0.0.6:30000")
    assert arm == Arm(Offload.L3, ("http://10.0.0.5:30000", "http://10.0.0.6:30000"))
    assert not arm.started and arm.name == "l3"
    assert Arm(Offload.HBM_ONLY).started


@pytest.mark.parametrize("text", ["http://x:1", "l4=http://x:1", "l3=", "l3=x:1", "l2-only=http://a,ftp://b"])
def test_bad_endpoints_are_refused_naming_the_flag(text):
    with pytest.raises(ConfigError, match="--endpoint"):
        parse_endpoint(text)
