"""GPU-only run of the read-copy verify checks (marker ``gpu``; skipped on CPU): the compiled
verify kernels over buffers with a bf16 read copy, at head sizes of the served models (K = V = 128
for GDN; P = 64, N = 128 for Mamba2), equal to the copy-free run bit for bit with the copy in step
(``tests/test_read_copy.py::check_read_copy_verify``): Pallas-Triton on both routes (the GPU's
default is reconstruct) and Mosaic GPU."""
import pytest

from tests.test_read_copy import VERIFY_CASES, check_read_copy_verify, force_verify_route

pytestmark = pytest.mark.gpu

GEOMETRY = {"gdn": (2, 4, 128, 128),        # (Hk, Hv, K, V)
            "mamba2": (8, 2, 64, 128)}      # (H, G, P, N)


@pytest.mark.parametrize("family", ["gdn", "mamba2"])
@pytest.mark.parametrize("implementation,route", [c for c in VERIFY_CASES if c[0] != "xla"],
                         ids=lambda x: str(x))
def test_read_copy_verify_compiled(family, implementation, route, monkeypatch):
  force_verify_route(monkeypatch, family, route)
  check_read_copy_verify(family, implementation, GEOMETRY[family])
