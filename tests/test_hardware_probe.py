"""`meshtron plan --gpu cpu`'s measured cluster: the probe's cache (where it lives, what invalidates it,
forcing a new measurement) and a real probe of 2 ranks on small shapes giving usable figures. No
timing is asserted: only that the figures exist, are positive and reach the planner."""

from __future__ import annotations

import dataclasses
import json

import pytest

from meshtron.plan.estimate import estimate
from meshtron.plan.layout import Layout
from meshtron.probe import hardware as hp
from meshtron.rules.checks import load_config

FIGURES = dict(
    ranks=2, threads=1, matmul_flops_per_s=5e10, attention_share=0.2, memory_bytes_per_s=5e9,
    elementwise_share=0.4, all_reduce_bytes_per_s=1e9, all_reduce_latency_s=1e-4,
    all_gather_bytes_per_s=5e8, all_gather_latency_s=2e-4, loaded_latency_s=5e-4, p2p_latency_s=1e-3,
    p2p_bytes_per_s=4e8, context_bytes=2.5e8, host_memory_bytes=16 * 2**30, cpu="test CPU",
    measured_at="today", probe_seconds=1.0,
)  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path))
    monkeypatch.delenv("MESHTRON_REPROBE", raising=False)
    return tmp_path / hp.CACHE_FILE


def test_cache_round_trip(cache, monkeypatch):
    m = hp.Measurement(**FIGURES)
    key = hp.cache_key(2, 1, hp.QUICK)
    assert hp.load_cached(key) is None
    hp.save_cached(key, m)
    assert hp.load_cached(key) == m
    assert hp.load_cached(hp.cache_key(4, 1, hp.QUICK)) is None  # another rank count
    assert hp.load_cached(hp.cache_key(2, 2, hp.QUICK)) is None  # another thread count
    assert hp.load_cached(hp.cache_key(2, 1, hp.DEMO)) is None  # other sizes

    # A measurement is taken only when there is none, or when asked for (argument or environment).
    calls = []
    monkeypatch.setattr(hp, "launcher_threads", lambda ranks: 1)
    monkeypatch.setattr(hp, "measure", lambda *a, **k: calls.append(a) or dataclasses.replace(m, cpu="new"))
    assert hp.probe(2, hp.QUICK) == m and not calls
    assert hp.probe(2, hp.QUICK, reprobe=True).cpu == "new" and len(calls) == 1
    monkeypatch.setenv("MESHTRON_REPROBE", "1")
    hp.probe(2, hp.QUICK)
    assert len(calls) == 2
    assert hp.load_cached(key).cpu == "new"  # the new measurement replaced the entry

    # An entry of another probe version, or an unreadable file, is measured again.
    data = json.loads(cache.read_text())
    data[key]["version"] = hp.PROBE_VERSION - 1
    cache.write_text(json.dumps(data))
    assert hp.load_cached(key) is None
    cache.write_text("{not json")
    assert hp.load_cached(key) is None
    hp.save_cached(key, m)  # and is rewritten whole
    assert hp.load_cached(key) == m


def test_cache_location(tmp_path, monkeypatch):
    monkeypatch.delenv("MESHTRON_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hp.cache_path() == tmp_path / "xdg" / "meshtron" / hp.CACHE_FILE
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hp.cache_path() == tmp_path / "home" / ".cache" / "meshtron" / hp.CACHE_FILE
    monkeypatch.setenv("MESHTRON_CACHE", str(tmp_path / "data"))  # beside the prepared corpus
    assert hp.cache_path() == tmp_path / "data" / hp.CACHE_FILE
    # The prepared corpus and the MFU reference live in the same place, XDG_CACHE_HOME honoured alike.
    from meshtron.data import dataset
    from meshtron.utils.cache import cache_dir

    monkeypatch.delenv("MESHTRON_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dataset.meshtron_cache_dir is cache_dir and cache_dir() == tmp_path / "xdg" / "meshtron"


def test_cpu_cluster_measures_two_ranks(cache, monkeypatch):
    cluster = hp.cpu_cluster(2, hp.QUICK, reprobe=True)
    m = hp.load_cached(hp.cache_key(2, hp.launcher_threads(2), hp.QUICK))
    assert m is not None and m.ranks == 2
    for name in ("matmul_flops_per_s", "attention_share", "memory_bytes_per_s", "elementwise_share"):
        assert getattr(m, name) > 0, name
    assert m.all_reduce_bytes_per_s > 0 and m.all_gather_bytes_per_s > 0
    assert m.context_bytes > 0 and m.host_memory_bytes > 0
    assert m.all_reduce_latency_s >= 0 and m.all_gather_latency_s >= 0
    g = cluster.gpu
    assert (cluster.gpus, cluster.dtype, g.gpus_per_node) == (2, "fp32", 2)
    assert cluster.peak == g.fp32_flops_per_s == m.matmul_flops_per_s
    assert g.memory_bytes == m.host_memory_bytes // 2 and g.intra_node_bytes_per_s == m.all_gather_bytes_per_s
    assert cluster.links.nvlink_latency_s == max(m.loaded_latency_s, m.all_reduce_latency_s)
    assert m.p2p_latency_s >= 0 and m.p2p_bytes_per_s > 0 and cluster.links.p2p_latency_s == m.p2p_latency_s

    # The planner runs on it: a tiny model on 2 ranks of tensor parallel gets a positive step time.
    cfg = load_config(
        None, ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.vocab_size=256"]
    )
    cfg = Layout(tp=2, micro_batch=2).apply(
        dataclasses.replace(
            cfg, training=dataclasses.replace(cfg.training, dtype="fp32", global_batch=4, seq_len=32)
        )
    )
    est = estimate(cfg, cluster)
    assert est.step_time_s > 0 and est.time["compute"] > 0 and est.time["tp"] > 0

    # Asked again, the cache answers without measuring.
    monkeypatch.setattr(hp, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert hp.cpu_cluster(2, hp.QUICK) == cluster
