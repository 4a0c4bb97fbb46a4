"""Shared fixtures: long-lived gloo worker pools, one per world size, reused by every test; and the quick
tier (`pytest -m quick`, under three minutes): every feature touched once, for a contributor's loop."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from meshtron.comm.workers import WorkerPool, close_pools
from meshtron.plan.estimate import Cluster
from meshtron.plan.hardware import Accelerator, GiB
from meshtron.testing.parity import release_meshes

os.environ.setdefault("OMP_NUM_THREADS", "1")
# inductor's C++ kernels on this CPU without explicit SIMD: the compiled tests check what meshtron hands
# the compiler (graphs, breaks, collectives in them), not inductor's vectoriser, and its scalar kernels
# take about a fifth less time to generate (a compiled tiny DeepSeek step: 35-38 s, not 42-50 s).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
# Every gloo process group a rank holds keeps a thread that wakes about a hundred times a second while
# idle (gloo's tcp loop): the meshes left by test_plan.py's layouts took 0.18 of a core doing nothing.
# A worker keeps the meshes of its last two layouts (testing/parity.py mesh_for); past MAX_TOTAL_THREADS
# the idle pools close theirs, the largest first, and every pool a test used closes them before a test
# that uses none (a launch, whose ranks want the cores: 0.02 of a core is left). Closing takes 0.3-0.5 s,
# so a pool the next tests use keeps its meshes, and a pool no test has used since it closed them is not
# asked again (asking every pool before each of the suite's many tests without one cost 0.3-0.5 s a
# test). A pool restarts (its ranks import torch again, about 6 s) only while its ranks hold more than
# MAX_POOL_THREADS: process groups something leaked.
MAX_POOL_THREADS = 150
MAX_TOTAL_THREADS = 1600
_POOLS: dict[int, WorkerPool] = {}
_USED: set[int] = set()  # world sizes of the pools that ran a test since they last closed their meshes


def _held(pool: WorkerPool) -> int:
    return 0 if pool.broken else pool.threads() * pool.world_size


def _release(world_size: int) -> None:
    pool = _POOLS[world_size]
    if not pool.broken:
        pool.run(release_meshes)
    _USED.discard(world_size)


@pytest.fixture(scope="session")
def workers():
    """workers(n) -> a WorkerPool of n ranks, started on first use and kept for the session."""

    def get(world_size: int) -> WorkerPool:
        others = sorted((p for size, p in _POOLS.items() if size != world_size), key=_held, reverse=True)
        for idle in others:
            if sum(_held(p) for p in _POOLS.values()) <= MAX_TOTAL_THREADS:
                break
            _release(idle.world_size)
        pool = _POOLS.get(world_size)
        if pool is not None and not pool.broken and pool.threads() > MAX_POOL_THREADS:
            pool.close()  # a fresh pool: its ranks no longer poll the threads of old process groups
        if pool is None or pool.broken:
            pool = _POOLS[world_size] = WorkerPool(world_size, timeout_s=180)
        _USED.add(world_size)
        return pool

    yield get
    close_pools(list(_POOLS.values()))
    _POOLS.clear()
    _USED.clear()


@pytest.fixture(autouse=True)
def _pools_quiet_beside_other_tests(request):
    """Before a test that uses no pool, every pool used since it last did closes the meshes it holds."""
    if "workers" not in request.fixturenames:
        for world_size in sorted(_USED):
            _release(world_size)
    yield


@pytest.fixture
def fixed_cpu(monkeypatch):
    """No CUDA, and a CPU probe that returns a fixed cluster (the real one measures this machine)."""
    cpu = Accelerator(
        name="cpu",
        bf16_flops_per_s=1e11,
        fp8_flops_per_s=None,
        memory_bytes=8 * GiB,
        hbm_bytes_per_s=2e10,
        intra_node_bytes_per_s=5e9,
        inter_node_bytes_per_s=5e9,
        gpus_per_node=4,
        fp32_flops_per_s=5e10,
    )
    probe = types.ModuleType("meshtron.probe.hardware")
    probe.cpu_cluster = lambda ranks: Cluster(cpu, ranks, "fp32")
    monkeypatch.setitem(sys.modules, "meshtron.probe.hardware", probe)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return probe


@pytest.fixture
def nothing_starts(monkeypatch, tmp_path):
    """Fail the test if a dry run launches ranks or trains; run in an empty directory to see it stays so."""

    def refuse(*args, **kwargs):
        raise AssertionError("a dry run started something")

    # By dotted name: this module's `meshtron` is the subprocess helper above, not the package.
    monkeypatch.setattr("meshtron.commands.train._launch", refuse)
    monkeypatch.setattr("meshtron.train.trainer.train", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


# The quick tier: a test file (all of it) or a test id (a test, or one parametrized case), each marked
# `quick`. Every feature once: config and layout rules, the planner, the schedules, the collectives, one
# parity case per parallelism and composition family, checkpoints, Hugging Face, the command line.
QUICK = (
    "tests/test_architecture.py",
    "tests/test_config.py",
    "tests/test_split.py",
    "tests/test_mesh.py::test_full_5d_layout_groups_partition_the_world",
    "tests/test_mesh.py::test_expert_parallel_folding",
    "tests/test_schedules.py::test_zero_bubble_h1_has_a_third_of_1f1b_bubble_at_the_same_memory",
    "tests/test_planner.py::test_search_holds_fixed_keys_counts_refusals_and_ranks_by_time",
    "tests/test_planner.py::test_plan_json_contract",
    "tests/test_plan.py::test_predicted_state_and_traffic_equal_measured[zero3_4]",
    "tests/test_memory_model.py",
    "tests/test_comm.py::test_collective_forward_backward[all_to_all-2]",
    "tests/test_comm.py::test_recordings_count_their_block_and_nest",
    "tests/test_model.py::test_moe_gradients_match_per_token_loop",
    "tests/test_model.py::test_initialisation_is_per_parameter_and_layout_independent",
    "tests/test_data.py::test_global_batch_independent_of_layout",
    "tests/test_data_parallel.py::test_parity_with_single_device[ddp2-accumulation]",
    "tests/test_data_parallel.py::test_parity_with_single_device[zero1_4-one_micro_batch]",
    "tests/test_data_parallel.py::test_parity_with_single_device[zero3_4-accumulation]",
    "tests/test_data_parallel.py::test_parity_with_single_device[hsdp2x2-one_micro_batch]",
    "tests/test_simple_fsdp.py::test_parity_with_single_device[dp_shard2]",
    "tests/test_tensor_parallel.py::test_parity_with_single_device[tp2_sp]",
    "tests/test_context_parallel.py::test_parity_with_single_device[ring2]",
    "tests/test_context_parallel.py::test_parity_with_single_device[alltoall2]",
    "tests/test_expert_parallel.py::test_parity_with_single_device[ep2_alltoall]",
    "tests/test_pipeline.py::test_schedules_match_single_device[1f1b-2-4-1]",
    "tests/test_pipeline.py::test_schedules_match_single_device[zero_bubble-2-4-1]",
    "tests/test_pipeline_v.py::test_v_schedules_match_single_device[dualpipev-2]",
    "tests/test_activation_memory.py::test_saved_activations_match_the_formula[2-True-selective]",
    "tests/test_train.py::test_checkpoint_resume_is_exact",
    "tests/test_train.py::test_steps_of_degree_one_change_nothing",
    "tests/test_validation.py::test_val_loss_equals_single_device[cp2]",
    "tests/test_faults.py::test_a_non_finite_step_is_skipped_and_changes_nothing",
    "tests/test_hf.py::test_load_matches_transformers[qwen2_moe]",
    "tests/test_hf.py::test_save_loads_in_transformers[llama]",
    "tests/test_init_from_hf.py::test_first_loss_is_transformers_in_every_layout[tp2]",
    "tests/test_compile.py::test_compiled_blocks_give_the_eager_losses[one_device_full_recompute]",
    "tests/test_cli.py::test_train_on_one_process",
    "tests/test_cli.py::test_mesh_json",
    "tests/test_data_parallel.py::test_checkpoint_written_by_zero3_resumes_on_other_layouts",
    "tests/test_pipeline.py::test_schedules_match_single_device[interleaved-2-4-2]",
    "tests/test_pipeline_pairs.py::test_overlapped_pairs_compose[pp_only]",
    "tests/test_context_parallel.py::test_parity_with_single_device[hybrid2x2]",
    "tests/test_expert_parallel.py::test_parity_with_single_device[ep2_x_zero1_edp2]",
    "tests/test_fuzz.py::test_fuzzed_layout_matches_single_device[35]",
    "tests/test_verify.py::test_verify_passes_a_correct_layout",
    "tests/test_records.py::test_a_run_records_its_config_environment_and_wandb_scalars",
    "tests/test_export_generate.py::test_cached_decoding_equals_the_whole_sequence[gqa]",
    "tests/test_export_generate.py::test_commands_and_checkpoint_forms",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        nodeid = item.nodeid
        if any(nodeid == q or nodeid.startswith((q + "::", q + "[")) for q in QUICK):
            item.add_marker(pytest.mark.quick)
