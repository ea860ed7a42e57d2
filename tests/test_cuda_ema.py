"""tiny-cuda-nn's EMA optimizer wrapper on the cuda backend (a CUDA GPU; skipped without CuPy or
one): the mma variant keeps the average on the device (``mlp_optimize``) and serves it from its
own forward image, checked with tests/test_optimizers.py's helpers against the cpu reference's
update replayed on the model's own fp16 weights, the emulating oracle's loss curve, and a
checkpoint round trip; cublaslt, wgmma and mma-f16acc+cublaslt refuse it by name, and auto-selection
takes one of the two mma variants."""

from __future__ import annotations

import pytest

from mmad.backends.dispatch import settled
from mmad.errors import SpecError
from mmad.spec import bench_spec
from tests.test_cuda import _cuda_backend
from tests.test_optimizers import EMA_ADAM, EMA_SGD, check_ema_checkpoint_resumes, check_ema_tracks_its_own_weights

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def backend():
    return _cuda_backend()


@pytest.mark.parametrize("ema_doc", [EMA_ADAM, EMA_ADAM | {"full_precision": True}, EMA_SGD],
                         ids=["adam", "adam-full-precision", "sgd"])
def test_mma_ema_tracks_its_own_weights(backend, ema_doc):
    # steps=8 in one call replays a captured CUDA graph: the EMA table is indexed like the rates
    check_ema_tracks_its_own_weights(lambda spec: backend.compile(spec, "mma"), bench_spec("S", optimizer=ema_doc))


def test_mma_ema_checkpoint_resumes(backend):
    check_ema_checkpoint_resumes(lambda spec: backend.compile(spec, "mma"), bench_spec("M", optimizer=EMA_ADAM))


def test_ema_picks_an_mma_variant_and_the_others_refuse_it(backend):
    spec = bench_spec("S", optimizer=EMA_ADAM)
    with settled(backend.compile(spec)) as model:  # measured between the two variants that keep the average
        assert model.variant in ("mma", "mma-f16acc")
    rows = {r.variant: r for r in backend.probe()}
    for variant in ("cublaslt", "wgmma", "wgmma+mma", "mma-f16acc+cublaslt", "wgmma+cublaslt"):
        if not rows[variant].available:
            continue
        with pytest.raises(SpecError) as err:
            backend.compile(spec, variant)
        assert f"not implemented on the cuda backend's {variant} variant" in str(err.value)
