"""Reduce-scatters XLA:TPU keeps (jaxsched.runtime.collectives._torus): the stages over a 3-D
slice of chips, and the staged and row forms give every device the slice one tiled
``psum_scatter`` does."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxsched.runtime.collectives._base import BucketSpec, psum_scatter
from jaxsched.runtime.collectives._torus import scatter_lanes, scatter_stages, staged_psum_scatter
from support.toolchains import needs_tpu


def _chips(shape, slices=1, platform="tpu"):
    """Fake devices of a TPU torus ``shape`` (x fastest, as libtpu numbers them)."""
    coords = [(x, y, z) for z in range(shape[2]) for y in range(shape[1]) for x in range(shape[0])]
    return [SimpleNamespace(platform=platform, coords=c, slice_index=s) for s in range(slices) for c in coords]


def _mesh(devices, shape, names):
    return SimpleNamespace(
        devices=np.array(devices, dtype=object).reshape(shape), axis_names=names, shape=dict(zip(names, shape))
    )


def test_a_3d_group_is_split_into_a_line_and_a_plane():
    mesh = _mesh(_chips((2, 2, 2)), (8,), ("data",))
    assert scatter_stages(mesh, "data") == (((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7)))
    assert scatter_lanes(mesh) == 128
    first, second = scatter_stages(_mesh(_chips((4, 4, 4)), (64,), ("data",)), "data")
    assert len(first[0]) == 4 and len(second[0]) == 16  # along z, then the xy plane


def test_groups_on_a_plane_other_platforms_and_several_slices_stay_one_reduce_scatter():
    assert scatter_stages(_mesh(_chips((2, 2, 1)), (4,), ("data",)), "data") == ()
    assert scatter_stages(_mesh(_chips((4, 4, 4)), (4, 16), ("a", "b")), "b") == ()
    assert scatter_stages(_mesh(_chips((2, 2, 2), slices=2), (16,), ("data",)), "data") == ()
    gpu = _mesh(_chips((2, 2, 2), platform="gpu"), (8,), ("data",))
    assert scatter_stages(gpu, "data") == () and scatter_lanes(gpu) == 0


def test_the_stages_follow_the_data_axes_of_a_2d_mesh():
    """A ("model", "data") mesh over 2x2x4 chips: each model position's data group is a
    2x2x2 block, split alike; over ("data", "model") the data groups are 2x4 planes."""
    chips = _chips((2, 2, 4))
    assert scatter_stages(_mesh(chips, (2, 8), ("model", "data")), "data") == (
        ((0, 4), (1, 5), (2, 6), (3, 7)),
        ((0, 1, 2, 3), (4, 5, 6, 7)),
    )
    assert scatter_stages(_mesh(chips, (8, 2), ("data", "model")), "data") == ()


@pytest.mark.parametrize("shape", [(8 * 256,), (64, 48), (8 * 128 * 3,)])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("lanes", [0, 128])
def test_staged_and_row_reduce_scatters_give_every_device_its_slice(shape, staged, lanes):
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    stages = (((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))) if staged else ()
    n = int(np.prod(shape))
    spec = BucketSpec(0, n, np.dtype("float32"), 8, (shape,), scatter_stages=stages, scatter_lanes=lanes)
    x = np.random.RandomState(0).randn(8, *shape).astype(np.float32)
    f = jax.jit(
        jax.shard_map(
            lambda a: psum_scatter(a[0], "data", spec),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P("data"),
            check_vma=False,
        )
    )
    out = np.asarray(f(jax.device_put(x, NamedSharding(mesh, P("data")))))
    np.testing.assert_allclose(out, x.sum(0), rtol=1e-6, atol=1e-5)


def _scatter(x, name, dim, stages, exchange):
    """The staged sum with pairs exchanged, or as reduce-scatters with the same groups."""
    if exchange:
        return staged_psum_scatter(x, name, dim, stages)
    for groups in stages or ((tuple(range(8)),),):
        x = jax.lax.psum_scatter(
            x, name, scatter_dimension=dim, tiled=True, axis_index_groups=[list(g) for g in groups]
        )
    return x


def _staged(x, stages, dim, exchange, axes=("data",)):
    mesh = Mesh(np.array(jax.devices()[:8]).reshape((2, 4) if len(axes) == 2 else (8,)), axes)
    spec = P(axes if len(axes) == 2 else axes[0])
    name = axes if len(axes) == 2 else axes[0]
    f = jax.jit(
        jax.shard_map(
            lambda a: _scatter(a[0], name, dim, stages, exchange)[None],
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
    )
    return np.asarray(f(jax.device_put(x, NamedSharding(mesh, spec))))


@pytest.mark.parametrize(
    "stages",
    [
        (((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))),  # pairs first (a line of chips)
        (((0, 2, 4, 6), (1, 3, 5, 7)), ((0, 1), (2, 3), (4, 5), (6, 7))),  # pairs last
        (((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 2), (1, 3), (4, 6), (5, 7)), ((0, 1), (2, 3), (4, 5), (6, 7))),
        (((0, 5), (1, 4), (2, 7), (3, 6)), ((0, 1, 2, 3), (4, 5, 6, 7))),  # irregular pairs: a reduce-scatter
    ],
)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("axes", [("data",), ("slice", "chip")])
def test_pairs_exchanged_as_halves_give_every_device_the_slice_of_one_reduce_scatter(stages, dim, axes):
    """Exchanging halves over pairs sums the same two operands as a reduce-scatter over them
    (bitwise equal) and leaves each device the slice one tiled ``psum_scatter`` gives it,
    whatever the order of the stages and over a tuple of mesh axes."""
    shape = (8, 16, 24) if dim == 0 else (8, 6, 32)
    x = np.random.RandomState(len(stages) + dim).randn(*shape).astype(np.float32)
    exchanged = _staged(x, stages, dim, True, axes)
    scattered = _staged(x, stages, dim, False, axes)
    np.testing.assert_array_equal(exchanged, scattered)
    one = _staged(x, (), dim, False, axes)
    np.testing.assert_allclose(exchanged, one, rtol=1e-5, atol=1e-5)
    want = np.stack(np.split(x.sum(0), 8, axis=dim))
    np.testing.assert_allclose(one, want, rtol=1e-5, atol=1e-5)


def test_only_regular_pairs_are_exchanged():
    """A pair stage becomes a collective permute; irregular pairs and larger groups stay
    reduce-scatters."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))

    def lowered(stages):
        f = jax.shard_map(
            lambda a: staged_psum_scatter(a, "data", 0, stages),
            mesh=mesh,
            in_specs=P(),
            out_specs=P("data"),
            check_vma=False,
        )
        return jax.jit(f).lower(np.zeros((16, 4), np.float32)).as_text()

    regular = lowered((((0, 4), (1, 5), (2, 6), (3, 7)), ((0, 1, 2, 3), (4, 5, 6, 7))))
    assert regular.count("collective_permute") == 1 and regular.count("reduce_scatter") == 1
    irregular = lowered((((0, 5), (1, 4), (2, 7), (3, 6)), ((0, 1, 2, 3), (4, 5, 6, 7))))
    assert "collective_permute" not in irregular and irregular.count("reduce_scatter") == 2


@needs_tpu
def test_the_stages_of_real_v5p_slices():
    import jaxsched.tools.aot as aot

    for topology, sizes in (("2x2x2", [2, 4]), ("2x2x4", [4, 4])):
        devices = aot.devices("v5p", topology)
        stages = scatter_stages(Mesh(np.array(devices), ("data",)), "data")
        assert [len(s[0]) for s in stages] == sizes
    assert scatter_stages(Mesh(np.array(aot.devices("v5p", "2x2x1")), ("data",)), "data") == ()
