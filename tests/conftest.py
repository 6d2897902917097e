import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # dist_util for the spawned ranks too


@pytest.fixture(autouse=True)
def _seed():
    import torch

    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _no_namespaces_left():
    """Whatever a failed or interrupted test left of an emulated cluster (its launcher is
    dead by now) is removed at the end of the session; live runs of others are kept."""
    yield
    from lbcomm.cli import netns

    if netns.available()[0]:
        for prefix in ("lbctest", netns.DEFAULT_PREFIX):
            netns.cleanup_stale(prefix)


# ---------------------------------------------------------------------------- test tiers
# Markers (registered in pyproject.toml) are assigned here, by module and test name, rather
# than in every test file. A plain `python -m pytest` leaves out `slow` (addopts);
# `-m "slow or not slow"` runs everything, `-m mpi` (or multiproc, netns, slow) one tier.
#
# multiproc: the test starts ranks as processes (dist_util.run_ranks, torchrun, mpirun,
#            the lbcomm-bench launcher), or shares a module fixture that does.
# mpi:       ranks started by mpirun (needs mpi4py and Open MPI).
# netns:     an emulated cluster (network namespaces, veth, tbf; root): the tests that
#            skip with "emulated cluster unavailable".
# slow:      the long ones (tens of seconds each on 2 cores, or a module fixture that is).
ALL = "*"

# module -> the tests that start ranks (ALL: every test of the module)
MULTIPROC = {
    "test_auto_freeze": {"test_auto_freeze_decides_as_the_reference_on_every_rank",
                         "test_auto_freeze_run_equals_the_simulation_with_that_fixed_step",
                         "test_a_resume_mid_warmup_freezes_at_the_same_step_bitwise",
                         "test_zeroone_var_freeze_step_auto_starts_the_local_steps_on_every_rank",
                         "test_before_the_freeze_bytes_stats_and_checkpoints_say_why_nothing_is_compressed",
                         "test_a_run_that_ends_before_the_freeze_says_so"},
    "test_bitwise_replicas": ALL,
    "test_integrations_trainer_defaults": {"test_default_arguments_with_a_onebit_optimizer_clip_by_the_shared_norm",
                                           "test_default_arguments_with_the_hook_keep_the_trainers_clipping"},
    "test_resume_warnings": ALL,
    "test_allreduce": {"test_matches_reference_and_invariant", "test_half_inputs_across_ranks",
                       "test_async_matches_sync", "test_pieces_are_bitwise_the_whole",
                       "test_weights_fused_match_reference_and_divide_multiply", "test_automatic_pieces",
                       "test_nonfinite_is_seen_by_every_rank_and_errors_stay",
                       "test_state_of_another_group_is_refused", "test_state_dict_resumes_bitwise"},
    "test_bench_cli": {"test_allreduce_loopback_table", "test_allreduce_json_schema", "test_allreduce_plot",
                       "test_failing_rank_is_reported", "test_train_loopback_tiny", "test_under_torchrun",
                       "test_mpi_backend", "test_allreduce_emulated_cluster",
                       "test_emulated_cluster_torn_down_on_failure", "test_emulated_cluster_torn_down_on_ctrl_c"},
    "test_checkpoint": {"test_shards_are_one_file_per_rank", "test_resume_with_the_same_world_size_is_bitwise_identical",
                        "test_resume_with_another_world_size_without_elastic_warns_resets_and_keeps_learning",
                        "test_version_1_checkpoints_still_load_and_continue_bitwise"},
    "test_cli": {"test_lbcomm_bench_imports_warn_and_alias", "test_python_m_lbcomm_bench_still_runs_with_a_warning"},
    "test_clipping": {"test_local_gradients_are_clipped_by_one_norm", "test_averaged_gradients_are_clipped_like_torch"},
    "test_ddp": {"test_onebit_hook_trains_and_keeps_replicas_identical", "test_onebit_hook_stats",
                 "test_onebit_hook_resume_is_bitwise_exact", "test_onebit_hook_nonfinite_skips_on_every_rank",
                 "test_warmup_average_hook_trains_and_keeps_replicas_identical",
                 "test_warmup_average_hook_averages_in_warmup_only"},
    "test_ddp_checkpoint": ALL,
    "test_docs": {"test_shell_block_runs"},
    "test_dct": {"test_dct_hook_matches_the_reference_bitwise", "test_dct_hook_keeps_replicas_identical_and_reports",
                 "test_all_gather_v_of_lengths_that_differ", "test_dct_hook_resumes_bitwise_and_skips_nonfinite",
                 "test_dct_hook_elastic_resume_4_to_2", "test_dct_mp_sparse_exchange_equals_dense_at_threshold_0"},
    "test_decentlam": {"test_ranks_match_the_simulation_bitwise", "test_resume_nonfinite_ddp_refusal_and_transport_on_4_ranks",
                       "test_mpi_ranks_match_the_simulation_bitwise"},
    "test_elastic": {"test_load_sharded_redistributes_the_error_feedback", "test_hook_and_dcp_elastic_resume_4_to_2_to_4"},
    "test_exit": ALL,
    "test_fsdp": ALL,
    "test_fsdp_optim": ALL,
    "test_ft": {"test_replica_dies_survivors_go_on_and_a_restart_heals",
                "test_local_group_of_ranks_with_different_weights_is_refused",
                "test_replicas_in_the_default_group_without_local_group_are_refused",
                "test_node_topology_replica_groups_that_start_apart_are_refused",
                "test_node_topology_a_slice_that_is_not_finite_skips_the_round_in_every_group",
                "test_node_topology_groups_of_two_ranks_lose_one_and_heal_it"},
    "test_state_contract": ALL,
    "test_gpu_check": {"test_allreduce_job_and_its_verdict_on_cpu_ranks", "test_allreduce_check_over_mpirun_on_cpu_ranks",
                       "test_train_job_and_its_verdict_on_cpu_ranks", "test_pipelining_job_on_cpu_ranks"},
    "test_hook_momentum": {"test_hook_momentum_adaptive_matches_reference_resumes_and_skips"},
    "test_hook_normalize": ALL,
    "test_integrations_accelerate": ALL,
    "test_integrations_attach": {"test_attach_on_two_ranks", "test_attach_dct_hook_state_on_two_ranks",
                                 "test_attach_local_updates_on_two_ranks"},
    "test_integrations_dcp": {"test_recipe_resumes_bitwise"},
    "test_integrations_lightning": ALL,
    "test_integrations_recipes": {"test_recipe_runs"},
    "test_integrations_transformers": {"test_trainer_compresses_and_resumes_bitwise",
                                       "test_trainer_clips_by_one_norm_with_the_callback",
                                       "test_trainer_local_updates_sync_and_resume_bitwise",
                                       "test_trainer_with_dct_hook_state_resumes_bitwise"},
    "test_local_updates": {"test_two_ranks_match_the_reference_bitwise", "test_compression_really_differs_from_fp32",
                           "test_stats_and_bytes", "test_resume_is_bitwise", "test_ddp_averaging_every_step_is_refused",
                           "test_nonfinite_pseudo_gradient_is_skipped_or_raised_on_every_rank",
                           "test_four_ranks_flat_and_hierarchical_match_the_reference_bitwise",
                           "test_elastic_resume_4_to_2"},
    "test_lars": {"test_lars_averages_by_itself_and_refuses_a_second_average",
                  "test_lars_under_ddp_and_onebit_hook_keeps_replicas_identical"},
    "test_launch_check": {"test_torchrun_script_without_init_process_group_fails_on_every_rank"},
    "test_mpi": {"test_mpi_matches_torch_backend_bitwise", "test_mpi_transport_all_reduce_and_barrier",
                 "test_mpi_backend_selection_and_errors"},
    "test_netem": {"test_tcp_throughput_is_capped_and_torn_down", "test_teardown_on_exception_kills_ranks",
                   "test_delay_adds_a_wide_area_round_trip",
                   "test_launch_reports_failed_rank_and_kills_the_rest", "test_teardown_on_signal",
                   "test_cleanup_stale_after_sigkill", "test_gloo_allreduce_across_namespaces"},
    "test_never_silent": {"test_gradients_averaged_by_ddp_raise_at_the_first_step",
                          "test_gradients_averaged_after_the_freeze_raise_at_the_first_compression_step",
                          "test_lbcomm_hook_and_opt_out_train_through", "test_freeze_logs_what_the_compression_stage_sends",
                          "test_exact_numel_covering_most_of_the_model_is_a_warning",
                          "test_a_shard_of_another_rank_is_reported_with_cause_and_fix",
                          "test_onebit_hook_under_a_onebit_optimizer_raises",
                          "test_double_compression_error_names_onebit_hook"},
    "test_optim_ranks": {"test_onebit_adam_warmup_equals_adamw_on_averaged_grads", "test_onebit_lamb_warmup_equals_lamb",
                          "test_four_ranks_match_the_simulation_bitwise", "test_four_ranks_rescale_variance_matches_the_simulation",
                          "test_a_tight_max_update_changes_the_run",
                          "test_max_update_keeps_unmasked_zero_variance_coordinates_in_place",
                          "test_simulation_detects_a_wrong_block_size", "test_zero_variance_coordinates_are_masked",
                          "test_nonfinite_steps_are_skipped_on_every_rank_with_state_untouched",
                          "test_grads_averaged_by_a_hook_skip_the_optimizers_allreduce", "test_exact_numel_takes_effect"},
    "test_optim_mpi": ALL,
    "test_race": {"test_race_loopback_schema_and_table", "test_check_race_doc_rejects",
                  "test_race_emulated_cluster_counts_bytes"},
    "test_reduce": {"test_callable_source_and_sink_are_bitwise_the_tensor_path",
                    "test_nan_on_one_rank_is_agreed_before_any_error_changes",
                    "test_overflow_of_finite_inputs_resets_the_errors_on_every_rank"},
    "test_reliability": {"test_different_sizes_raise_clearly_on_every_rank", "test_out_of_step_ranks_raise_with_errors_untouched",
                         "test_dead_peer_raises_within_timeout_and_leaves_no_orphans", "test_short_soak_identical_and_bounded"},
    "test_rescale_variance": {"test_two_ranks_optimizer_and_hook_paths_agree_with_the_simulation"},
    "test_robustness": {"test_integration_onebit_adam_first_compressed_update_is_bounded",
                        "test_integration_onebit_lamb_first_compressed_update_is_bounded",
                        "test_integration_no_divergence_where_the_full_precision_twin_converges",
                        "test_integration_the_published_rule_stays_available"},
    "test_shm": ALL,
    "test_stats": {"test_estimates_match_gathered_gradients"},
    "test_stats_relative": {"test_error_ratio_is_the_error_norm_over_what_was_sent"},
    "test_topology": {"test_hierarchical_equals_reference_and_invariant", "test_degenerate_topology_is_the_flat_call",
                      "test_hierarchical_mean_is_exact_and_identical_on_every_rank",
                      "test_nonfinite_skips_everywhere_with_errors_untouched", "test_clear_errors"},
    "test_topology_hook": ALL,
    "test_topology_bench": {"test_bench_emulated_nodes_count_inter_node_bytes", "test_bench_train_nodes_loopback"},
    "test_transport": {"test_torch_transport_all_reduce_and_barrier"},
    "test_zeroone": {"test_four_ranks_match_the_simulation_bitwise", "test_comm_stats_count_what_each_kind_of_step_sends",
                     "test_first_steps_are_adamw_on_the_averaged_gradients", "test_resume_mid_interval_is_bitwise_exact",
                     "test_nonfinite_steps_are_skipped_on_every_rank", "test_exact_numel_matches_the_simulation"},
    "test_same_lr": ALL,
}

MPI = {
    "test_mpi": MULTIPROC["test_mpi"],
    "test_optim_mpi": ALL,
    "test_exit": {"test_mpirun_job_exits_zero"},
    "test_bench_cli": {"test_mpi_backend"},
    "test_decentlam": {"test_mpi_ranks_match_the_simulation_bitwise"},
    "test_gpu_check": {"test_allreduce_check_over_mpirun_on_cpu_ranks"},
}

# emulated clusters whose test skips inside its body rather than by a skipif mark
NETNS = {
    "test_topology_bench": {"test_bench_emulated_nodes_count_inter_node_bytes"},
}

# module -> the long tests, chosen from per-test durations measured on a 2-core machine:
# what stays in the default run is the unit tests and the quicker multi-rank checks of
# every feature; whole module fixtures are kept together (marking part of a fixture's users
# would not save its time).
SLOW = {
    "test_allreduce": {"test_automatic_pieces", "test_matches_reference_and_invariant[3]",
                       "test_matches_reference_and_invariant[4]",
                       "test_matches_reference_and_invariant[5]", "test_half_inputs_across_ranks[dtype1]",
                       "test_async_matches_sync", "test_pieces_are_bitwise_the_whole[3-4099-64-3-lengths0]",
                       "test_pieces_are_bitwise_the_whole[4-10000-256-2-lengths1]",
                       "test_weights_fused_match_reference_and_divide_multiply[3-4099]"},
    "test_bench_cli": {"test_allreduce_loopback_table", "test_allreduce_json_schema", "test_allreduce_plot",
                       "test_check_allreduce_doc_rejects", "test_train_loopback_tiny", "test_under_torchrun",
                       "test_mpi_backend",
                       "test_allreduce_emulated_cluster", "test_emulated_cluster_torn_down_on_failure",
                       "test_emulated_cluster_torn_down_on_ctrl_c"},
    "test_checkpoint": {"test_resume_with_another_world_size_without_elastic_warns_resets_and_keeps_learning"},
    "test_cli": {"test_python_m_lbcomm_bench_still_runs_with_a_warning"},
    "test_docs": {"test_shell_block_runs", "test_mkdocs_build_strict", "test_script_options_exist"},
    "test_dct": {"test_dct_hook_elastic_resume_4_to_2"},
    "test_ddp_checkpoint": {"test_v1_hook_checkpoint_resumes_bitwise"},
    "test_decentlam": {"test_ranks_match_the_simulation_bitwise[4]",
                       "test_resume_nonfinite_ddp_refusal_and_transport_on_4_ranks",
                       "test_mpi_ranks_match_the_simulation_bitwise",
                       "test_decentlam_removes_the_momentum_bias_of_dmsgd",
                       "test_decentlam_on_the_exponential_graph_diverges_hence_refused",
                       "test_compressed_exchange_converges_with_dmsgd_and_diverges_with_decentlam"},
    "test_elastic": {"test_load_sharded_redistributes_the_error_feedback[2-4]",
                     "test_load_sharded_redistributes_the_error_feedback[4-2]",
                     "test_hook_and_dcp_elastic_resume_4_to_2_to_4"},
    "test_auto_freeze": MULTIPROC["test_auto_freeze"],
    "test_bitwise_replicas": ALL,
    "test_integrations_trainer_defaults": MULTIPROC["test_integrations_trainer_defaults"],
    "test_exit": ALL,
    "test_fsdp": ALL,
    "test_fsdp_optim": ALL,
    "test_ft": {"test_replica_dies_survivors_go_on_and_a_restart_heals",
                "test_node_topology_groups_of_two_ranks_lose_one_and_heal_it"},
    "test_gpu_check": MULTIPROC["test_gpu_check"] | {
        "test_a_check_runs_in_its_own_process_with_a_hard_timeout",
        "test_pytest_check_fails_when_the_kernel_tests_are_skipped",
        "test_build_step_records_success_failure_and_timeout", "test_a_failing_rank_is_reported_with_its_traceback"},
    "test_integrations_accelerate": ALL,
    "test_integrations_dcp": {"test_recipe_resumes_bitwise"},
    "test_integrations_lightning": ALL,
    "test_integrations_recipes": {"test_recipe_runs"},
    "test_integrations_transformers": MULTIPROC["test_integrations_transformers"],
    "test_mpi": MULTIPROC["test_mpi"],
    "test_netem": MULTIPROC["test_netem"],
    "test_optim_mpi": ALL,
    "test_race": {"test_race_loopback_schema_and_table", "test_check_race_doc_rejects",
                  "test_race_emulated_cluster_counts_bytes"},
    "test_reduce": {"test_callable_source_and_sink_are_bitwise_the_tensor_path[3-5003]",
                    "test_nan_on_one_rank_is_agreed_before_any_error_changes[raise]",
                    "test_overflow_of_finite_inputs_resets_the_errors_on_every_rank[raise]",
                    "test_callable_source_and_sink_are_bitwise_the_tensor_path[4-10007]"},
    "test_reliability": {"test_different_sizes_raise_clearly_on_every_rank[sizes1]",
                         "test_different_sizes_raise_clearly_on_every_rank[sizes0]",
                         "test_out_of_step_ranks_raise_with_errors_untouched",
                         "test_dead_peer_raises_within_timeout_and_leaves_no_orphans",
                         "test_short_soak_identical_and_bounded"},
    "test_robustness": MULTIPROC["test_robustness"],
    "test_same_lr": ALL,
    "test_state_contract": {"test_every_compressor_reports_the_same_statistics"},
    "test_stats": MULTIPROC["test_stats"],
    "test_never_silent": {"test_exact_numel_covering_most_of_the_model_is_a_warning"},
    "test_topology": {"test_hierarchical_mean_is_exact_and_identical_on_every_rank",
                      "test_make_reducer_with_a_topology", "test_clear_errors",
                      "test_hierarchical_equals_reference_and_invariant[1000-None-dtype1-explicit]",
                      "test_hierarchical_equals_reference_and_invariant[777-64-dtype2-env]",
                      "test_hierarchical_equals_reference_and_invariant[4099-256-dtype3-mesh]",
                      "test_hierarchical_equals_reference_and_invariant[40-32-dtype4-mesh]",
                      "test_degenerate_topology_is_the_flat_call", "test_nonfinite_skips_everywhere_with_errors_untouched[raise]"},
    "test_topology_hook": ALL,
    "test_topology_bench": {"test_bench_emulated_nodes_count_inter_node_bytes", "test_bench_train_nodes_loopback"},
    "test_local_updates": {"test_four_ranks_flat_and_hierarchical_match_the_reference_bitwise",
                           "test_elastic_resume_4_to_2"},
    "test_zeroone": {"test_resume_mid_interval_is_bitwise_exact"},
}


def _listed(table, module, name, full_name=None):
    """Whether `module`'s test `name` (or one parametrization, `full_name` = "name[id]") is in table."""
    names = table.get(module)
    return names is ALL or (names is not None and (name in names or full_name in names))


def _skips_without_netns(item):
    return any(str(m.kwargs.get("reason", "")).startswith("emulated cluster unavailable")
               for m in item.iter_markers("skipif"))


def tier_markers(item):
    """The tier markers of one collected test (a set of names)."""
    mod = getattr(item, "module", None)
    module = mod.__name__.rsplit(".", 1)[-1] if mod is not None else ""
    name = getattr(item, "originalname", None) or item.name.split("[", 1)[0]
    tiers = set()
    if module == "test_docs":
        block = getattr(getattr(item, "callspec", None), "params", {}).get("block")
        if block is not None and getattr(block, "kind", None) == "torchrun":
            tiers |= {"multiproc", "slow"}  # a torchrun of 2 ranks per block
    if _listed(MULTIPROC, module, name):
        tiers.add("multiproc")
    if _listed(MPI, module, name):
        tiers |= {"mpi", "multiproc"}
    if _listed(NETNS, module, name) or _skips_without_netns(item):
        tiers |= {"netns", "multiproc"}
    if _listed(SLOW, module, name, item.name):
        tiers.add("slow")
    return tiers


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these markers
def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in sorted(tier_markers(item) - {m.name for m in item.iter_markers()}):
            item.add_marker(getattr(pytest.mark, tier))
