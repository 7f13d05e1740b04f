"""Mesh construction, logical axis rules and parameter specs on the 8 simulated CPU devices."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from sonew_pax import partitioning
from sonew_pax.models import Transformer, TransformerConfig

CONFIG = TransformerConfig(
    vocab_size=64,
    d_model=32,
    num_layers=2,
    num_heads=4,
    head_dim=8,
    mlp_dim=48,
    max_len=16,
    positions="learned",
    tie_embeddings=False,
)


def _abstract_params(config=CONFIG, batch=8, length=16):
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    return jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens)["params"]


def test_default_mesh_uses_all_devices_on_data():
    mesh = partitioning.make_mesh()
    assert mesh.axis_names == ("replica", "data", "model")
    assert dict(mesh.shape) == {"replica": 1, "data": 8, "model": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
    "kwargs, shape",
    [
        (dict(data=2, model=4), (1, 2, 4)),
        (dict(model=2), (1, 4, 2)),
        (dict(replica=2, model=2), (2, 2, 2)),
        (dict(data=4, model=-1), (1, 4, 2)),
    ],
)
def test_mesh_shapes(kwargs, shape):
    mesh = partitioning.make_mesh(**kwargs)
    assert tuple(mesh.shape.values()) == shape
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_mesh_on_a_subset_of_devices():
    mesh = partitioning.make_mesh(model=2, devices=jax.devices()[:4])
    assert tuple(mesh.shape.values()) == (1, 2, 2)


@pytest.mark.parametrize(
    "kwargs, numbers",
    [
        (dict(data=3), ("3", "8")),
        (dict(data=2, model=2), ("4", "8")),
        (dict(model=3), ("3", "8")),
    ],
)
def test_bad_mesh_names_both_numbers(kwargs, numbers):
    with pytest.raises(ValueError) as err:
        partitioning.make_mesh(**kwargs)
    message = str(err.value)
    assert all(n in message for n in numbers), message


@pytest.mark.parametrize("kwargs", [dict(data=-1, model=-1), dict(model=0), dict(replica=-2)])
def test_bad_mesh_sizes(kwargs):
    with pytest.raises(ValueError, match="positive"):
        partitioning.make_mesh(**kwargs)


class _FakeDevice:
    """A device stand-in with a TPU slice index, for the multi-slice layout."""

    platform = device_kind = "cpu"

    def __init__(self, id, slice_index):
        self.id, self.slice_index, self.process_index = id, slice_index, slice_index


def test_replica_axis_spans_slices():
    devices = [_FakeDevice(i, i // 4) for i in range(8)]
    grid = partitioning._device_grid((2, 2, 2), devices)
    assert [{d.slice_index for d in row.flat} for row in grid] == [{0}, {1}]
    with pytest.raises(ValueError, match="replica=1 must be a multiple of the 2 slices"):
        partitioning._device_grid((1, 4, 2), devices)


def test_default_rules():
    rules = dict(partitioning.DEFAULT_RULES)
    assert rules["batch"] == ("replica", "data")
    assert rules["vocab"] == rules["mlp"] == rules["heads"] == "model"
    assert rules["embed"] is rules["kv"] is rules["length"] is None


def test_rule_overrides():
    rules = partitioning.logical_axis_rules(overrides=[("embed", "data"), ("expert", "model")])
    assert dict(rules)["embed"] == "data"
    assert rules[-1] == ("expert", "model")
    assert len(rules) == len(partitioning.DEFAULT_RULES) + 1


def test_logical_to_mesh_spec():
    assert partitioning.logical_to_mesh_spec(("embed", "heads", "kv")) == P(None, "model", None)
    assert partitioning.batch_spec() == P(("replica", "data"), None)
    with pytest.raises(ValueError, match="'embd'"):
        partitioning.logical_to_mesh_spec(("embd", "mlp"))


def test_param_specs_on_2x4_mesh():
    mesh = partitioning.make_mesh(data=2, model=4)
    params = _abstract_params()
    specs = partitioning.param_specs(params)
    partitioning.validate_specs(params, specs, mesh)
    layer = specs["layer_0"]
    assert specs["embedding"] == P("model", None)
    assert specs["output"] == P(None, "model")
    assert specs["pos_embedding"] == P(None, None)
    assert specs["final_norm"]["scale"] == P(None)
    for name in ("query", "key", "value"):
        assert layer["attn"][name] == P(None, "model", None)
    assert layer["attn"]["out"] == P("model", None, None)
    assert layer["mlp"]["wi"] == P(None, "model")
    assert layer["mlp"]["wo"] == P("model", None)
    assert layer["attn_norm"]["scale"] == P(None)
    fsdp = partitioning.param_specs(params, partitioning.logical_axis_rules([("embed", "data")]))
    assert fsdp["layer_0"]["mlp"]["wi"] == P("data", "model")


def test_param_specs_name_path_of_unknown_logical_axis():
    rules = [rule for rule in partitioning.DEFAULT_RULES if rule[0] != "kv"]
    with pytest.raises(ValueError, match=r"\['layer_0'\]\['attn'\]\['key'\].*'kv'"):
        partitioning.param_specs(_abstract_params(), rules)


def test_indivisible_dimension_names_path_size_and_axes():
    mesh = partitioning.make_mesh(data=2, model=4)
    params = _abstract_params(TransformerConfig(**{**vars(CONFIG), "num_heads": 6}))
    with pytest.raises(ValueError) as err:
        partitioning.validate_specs(params, partitioning.param_specs(params), mesh)
    message = str(err.value)
    assert "['layer_0']['attn']['key']" in message
    assert "size 6" in message and "('model',)" in message and "total size 4" in message


def test_unknown_mesh_axis_is_an_error():
    mesh = partitioning.make_mesh(data=2, model=4)
    shapes = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    with pytest.raises(ValueError, match=r"\['w'\].*'tensor'"):
        partitioning.validate_specs(shapes, {"w": P("tensor", None)}, mesh)


def test_sharded_forward_matches_single_device():
    mesh = partitioning.make_mesh(data=2, model=4)
    model = Transformer(CONFIG)
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, CONFIG.vocab_size, jnp.int32)
    specs = partitioning.param_specs(_abstract_params())
    param_shardings = partitioning.shardings(specs, mesh)
    expected = model.apply(model.init(jax.random.key(0), tokens), tokens)

    def init(key):
        return nn.meta.unbox(model.init(key, tokens)["params"])

    with partitioning.axis_rules_context(mesh):
        params = jax.jit(init, out_shardings=param_shardings)(jax.random.key(0))
        forward = jax.jit(
            lambda p, x: model.apply({"params": p}, x),
            in_shardings=(param_shardings, partitioning.data_sharding(mesh)),
        )
        logits = forward(params, tokens)
    for spec, array in zip(
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
        jax.tree.leaves(params),
        strict=True,
    ):
        assert array.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), array.ndim)
    assert logits.sharding.spec[0] in ("data", ("replica", "data"))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(expected), atol=1e-5)


def test_activation_constraints_only_under_rules_context():
    mesh = partitioning.make_mesh(data=2, model=4)
    model = Transformer(CONFIG)
    tokens = jax.ShapeDtypeStruct((8, 16), jnp.int32)
    params = jax.eval_shape(
        lambda: nn.meta.unbox(model.init(jax.random.key(0), jnp.zeros((8, 16), jnp.int32)))
    )
    forward = jax.jit(model.apply)
    assert "sharding_constraint" not in forward.lower(params, tokens).as_text()
    with partitioning.axis_rules_context(mesh):
        assert "sharding_constraint" in forward.lower(params, tokens).as_text()
