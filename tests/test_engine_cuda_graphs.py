"""MLX's CUDA graphs (provider/engine/cuda_graphs.py): turned off for the engine on CUDA only, never
over the operator's own setting."""

from __future__ import annotations

import os

import mlx.core as mx

from provider.engine.cuda_graphs import USE_CUDA_GRAPHS, without_cuda_graphs


def test_on_cuda_kernels_are_launched_directly():
    environ: dict[str, str] = {"PATH": "/bin"}
    assert without_cuda_graphs(environ, cuda=True) == {USE_CUDA_GRAPHS: "0"}
    assert environ == {"PATH": "/bin", USE_CUDA_GRAPHS: "0"}


def test_the_operators_setting_is_kept():
    environ = {USE_CUDA_GRAPHS: "1"}
    assert without_cuda_graphs(environ, cuda=True) == {}
    assert environ == {USE_CUDA_GRAPHS: "1"}


def test_nothing_is_set_off_cuda():
    environ: dict[str, str] = {}
    assert without_cuda_graphs(environ, cuda=False) == {}
    assert environ == {}


def test_an_engine_on_this_machine_sets_it_only_on_cuda(monkeypatch):
    monkeypatch.delenv(USE_CUDA_GRAPHS, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    without_cuda_graphs()
    assert (USE_CUDA_GRAPHS in os.environ) == mx.cuda.is_available()
