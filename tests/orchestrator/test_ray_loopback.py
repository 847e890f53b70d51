"""The patch that puts a run's own Ray cluster on loopback (orchestrator/ray_loopback.py, ray 2.60.0)."""

import pytest

from moe_grpo.orchestrator import ray_loopback


def test_inside_the_patch_ray_takes_loopback_as_the_nodes_address_and_the_setting_comes_back():
    """What `ray.init(address="local")` asks for the node's address when none is given (node.py): the host's address
    without the patch (`ray.init(_node_ip_address="127.0.0.1")` is turned into it too), 127.0.0.1 with it."""
    import ray
    from ray._private import ray_constants, services

    assert not ray.is_initialized()
    assert services.resolve_ip_for_localhost("127.0.0.1") == services.get_node_ip_address(), \
        "ray.init replaces a loopback _node_ip_address with this: why the patch exists"
    before = ray_constants.ENABLE_RAY_CLUSTER
    with ray_loopback.loopback_node():
        assert services.get_node_ip_address() == "127.0.0.1"
    assert ray_constants.ENABLE_RAY_CLUSTER is before
    with pytest.raises(KeyError), ray_loopback.loopback_node():
        raise KeyError("the block fails")
    assert ray_constants.ENABLE_RAY_CLUSTER is before, "given back however the block ends"


def test_the_patch_refuses_another_ray_version(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "__version__", "2.61.0")
    with pytest.raises(RuntimeError, match=r"read against ray==2.60.0, found ray==2.61.0"):
        with ray_loopback.loopback_node():
            pass
