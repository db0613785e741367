"""Shared helpers of the guidance tests: guidance data, comparisons, file stores."""

from __future__ import annotations

import functools
import pathlib
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from trace_jax import fp4
from trace_jax.fp4 import Guidance, GuidanceMode
from trace_jax.guidance import GuidanceStore, GuidanceStoreConfig

RUN = "run-a"


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.reshape(-1).view(np.uint8) if x.dtype != np.bool_ else x.reshape(-1)


def assert_same_guidance(a: dict[str, Guidance], b: dict[str, Guidance]) -> None:
    """Same site keys, same static fmt/mode and None-ness, bit-identical leaves and dtypes."""
    assert sorted(a) == sorted(b)
    for site in a:
        ga, gb = a[site], b[site]
        assert jax.tree_util.tree_structure(ga) == jax.tree_util.tree_structure(gb), site
        assert (ga.fmt, ga.mode) == (gb.fmt, gb.mode)
        for la, lb in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
            assert la.shape == lb.shape and jnp.dtype(la.dtype) == jnp.dtype(lb.dtype), site
            np.testing.assert_array_equal(_bits(la), _bits(lb))


def digest(guidance: dict[str, Guidance]) -> int:
    """crc32 over every leaf's bytes, sites in sorted order."""
    crc = 0
    for site in sorted(guidance):
        for leaf in jax.tree.leaves(guidance[site]):
            crc = zlib.crc32(_bits(leaf).tobytes(), crc)
    return crc


def numpy_guidance(seed: int, rows: int = 4, n: int = 64) -> dict[str, Guidance]:
    """Random but well-formed host guidance (no jax computation): MXFP4 compact, NVFP4 full."""
    rng = np.random.default_rng(seed)
    e8m0 = np.dtype(fp4.MXFP4.scale_dtype)
    e4m3 = np.dtype(fp4.NVFP4.scale_dtype)
    compact = Guidance(
        rng.integers(0, 256, (rows, n // 8), dtype=np.uint8),
        rng.integers(120, 130, (rows, n // 32), dtype=np.uint8).view(e8m0),
        None,
        None,
        fp4.MXFP4,
        GuidanceMode.COMPACT,
    )
    full = Guidance(
        rng.integers(0, 256, (rows, n // 2), dtype=np.uint8),
        rng.integers(40, 80, (rows, n // 16), dtype=np.uint8).view(e4m3),
        rng.random((rows, 1), dtype=np.float32),
        rng.random(rows) < 0.7,
        fp4.NVFP4,
        GuidanceMode.FULL,
    )
    return {"20/expert_in": compact, "20/k": full}


@functools.partial(jax.jit, static_argnames=("fmt", "mode", "global_axes"))
def capture(x, mask=None, *, fmt, mode, global_axes=(-1,)):
    """The rollout's capture: real quantization, then guidance (jitted: compiles fast)."""
    return fp4.make_guidance(fp4.quantize(x, fmt, global_axes=global_axes), mode, mask=mask)


def file_store(root: pathlib.Path, **kw) -> GuidanceStore:
    return GuidanceStore(GuidanceStoreConfig(kvstore=str(root), poll_s=0.005, **kw))


def shard_file(root: pathlib.Path, step: int, site: str, leaf: str) -> pathlib.Path:
    """The one shard file of a leaf array of entry (RUN, step, 0)."""
    (data,) = (root / RUN / f"step_{step:010d}" / "mb_00000").glob("data_*")
    leaf_dir = data / site.replace("/", "%2F") / leaf
    (path,) = [p for p in leaf_dir.iterdir() if p.name != "zarr.json"]
    return path
