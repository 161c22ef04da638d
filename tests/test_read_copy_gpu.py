"""GPU-only run of the read-copy verify checks (marker ``gpu``; skipped on CPU): the compiled
Pallas-Triton verify kernels over buffers with a bf16 read copy, at head sizes of the served models
(K = V = 128 for GDN; P = 64, N = 128 for Mamba2), against float64 and XLA
(``tests/test_read_copy.py::check_read_copy_verify``)."""
import pytest

from tests.test_read_copy import check_read_copy_verify

pytestmark = pytest.mark.gpu

GEOMETRY = {"gdn": (2, 4, 128, 128),        # (Hk, Hv, K, V)
            "mamba2": (8, 2, 64, 128)}      # (H, G, P, N)


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
def test_read_copy_verify_compiled(family):
  check_read_copy_verify(family, GEOMETRY[family])
