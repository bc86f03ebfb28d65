"""The compiled (non-interpret) kernel paths lower for their real targets, checked on CPU.

``jax.export`` with ``platforms=["tpu"]`` runs the Pallas Mosaic lowering and with ``["cuda"]``
the Pallas Triton lowering, without the hardware. This catches ops the compilers reject at
lowering time (interpret mode accepts far more); Mosaic's and Triton's own backend passes still
only run on a real chip.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import export

from pallas_kernels import decode, ragged

_CHECKS = [
    export.DisabledSafetyCheck.custom_call("tpu_custom_call"),
    export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton"),
]
_TARGET = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


def _export(fn, platform, *shapes):
    exp = export.export(jax.jit(fn), platforms=[platform], disabled_checks=_CHECKS)(*shapes)
    text = exp.mlir_module()
    assert _TARGET[platform] in text
    return text


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize(
    "dtype,s,d,g", [(jnp.bfloat16, 16, 128, 4), (jnp.float32, 8, 64, 3), (jnp.bfloat16, 32, 64, 1)]
)
def test_decode_lowers(platform, dtype, s, d, g):
    b, hkv, p, m = 4, 8, 256, 40
    hq = hkv * g
    sds = jax.ShapeDtypeStruct
    kern = (
        decode.paged_decode_attention_tpu
        if platform == "tpu"
        else decode.paged_decode_attention_gpu
    )
    _export(
        lambda *a: kern(*a, soft_cap=30.0, sliding_window=100),
        platform,
        sds((b, hq, d), dtype),
        sds((hkv, p, s, d), dtype),
        sds((hkv, p, s, d), dtype),
        sds((b,), jnp.int32),
        sds((b, m), jnp.int32),
    )


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_ragged_lowers(platform):
    t, b, hq, hkv, d, p, s, m = 100, 6, 12, 4, 64, 128, 16, 37
    sds = jax.ShapeDtypeStruct
    kern = (
        ragged.ragged_paged_attention_tpu
        if platform == "tpu"
        else ragged.ragged_paged_attention_gpu
    )
    _export(
        lambda *a: kern(*a, soft_cap=30.0),
        platform,
        sds((t, hq, d), jnp.bfloat16),
        sds((hkv, p, s, d), jnp.bfloat16),
        sds((hkv, p, s, d), jnp.bfloat16),
        sds((b,), jnp.int32),
        sds((b, m), jnp.int32),
        sds((b + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


def test_gpu_defaults_fit_triton_minimums_for_tiny_tables():
    """One 8-token page per sequence: default blocks still give >= 16-token Triton dots."""
    sds = jax.ShapeDtypeStruct
    pages = sds((2, 9, 8, 64), jnp.float32)
    lens, tables = sds((3,), jnp.int32), sds((3, 1), jnp.int32)
    _export(
        decode.paged_decode_attention_gpu,
        "cuda",
        sds((3, 4, 64), jnp.float32),
        pages,
        pages,
        lens,
        tables,
    )
    _export(
        ragged.ragged_paged_attention_gpu,
        "cuda",
        sds((5, 4, 64), jnp.float32),
        pages,
        pages,
        lens,
        tables,
        sds((4,), jnp.int32),
        sds((1,), jnp.int32),
    )
