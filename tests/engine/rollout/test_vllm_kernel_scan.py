"""vLLM starts in a process that imported Flask (moto, MLflow clients do): its CPU kernel
rebinding scans every module, and Flask's unbound context proxies raise on ``hasattr``."""

import sys

import pytest


def test_vllm_kernel_scan_fails_on_flask_proxies_and_passes_with_them_hidden():
    import flask  # noqa: F401  (puts flask.globals' LocalProxy objects in sys.modules)
    from vllm.triton_utils.dispatcher import _rebind_kernels

    from engine.rollout.vllm_rollout import _modules_hidden_from_vllm_kernel_scan

    with pytest.raises(RuntimeError, match="application context"):
        _rebind_kernels([])  # vLLM's own scan, as the CPU worker runs it at start
    before = dict(sys.modules)
    with _modules_hidden_from_vllm_kernel_scan() as hidden:
        assert "flask.globals" in hidden and "flask.globals" not in sys.modules
        _rebind_kernels([])
    assert sys.modules["flask.globals"] is before["flask.globals"]
    assert set(sys.modules) >= set(before)
