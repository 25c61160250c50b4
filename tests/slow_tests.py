"""The tests left out of the fast inner loop: `python3 -m pytest -m 'not slow'`.

`tests/conftest.py` marks these `slow` when it collects them (the one place
they are named): whole files, then single test functions (every case of a
parametrized one) and doctests, by the file that holds them. The README's
command, `python3 -m pytest -q` (what CI runs), runs them all.

Chosen by measurement, not by guess: `python3 -m pytest -q --durations=0`
over the whole suite, each test's setup, call and teardown summed per test
function, the slowest left out until what stays runs in under a minute on 2
cores: the 8-device and multi-process checks, the new-process checkpoints,
the notebooks and guides, the `IdTable` models and its C++ twin, the
framework layers, the per-optimizer conformance and parity suites, and the
costliest compiled-program checks. Measure again and move a test here when
it grows slow.
"""

SLOW_FILES = (
    'lazy_optax/_src/id_export.py',
    'lazy_optax/_src/id_table.py',
    'lazy_optax/equinox.py',
    'lazy_optax/flax.py',
    'lazy_optax/haiku.py',
    'tests/test_bags.py',
    'tests/test_bare_rules.py',
    'tests/test_colabs.py',
    'tests/test_collection.py',
    'tests/test_collection_export.py',
    'tests/test_collection_state.py',
    'tests/test_collection_layers.py',
    'tests/test_collection_more.py',
    'tests/test_collection_training.py',
    'tests/test_conformance.py',
    'tests/test_demo.py',
    'tests/test_equinox.py',
    'tests/test_export_portable.py',
    'tests/test_fbgemm_counter_parity.py',
    'tests/test_fbgemm_emainplace_parity.py',
    'tests/test_fbgemm_parity.py',
    'tests/test_flax.py',
    'tests/test_haiku.py',
    'tests/test_id_table.py',
    'tests/test_id_table_checkpoint.py',
    'tests/test_id_table_kernel.py',
    'tests/test_id_table_layers.py',
    'tests/test_id_table_training.py',
    'tests/test_kernel_cache.py',
    'tests/test_kernel_shards.py',
    'tests/test_migrating_to_collections.py',
    'tests/test_migration_guide.py',
    'tests/test_properties.py',
    'tests/test_step_recovery.py',
    'tests/test_torch_parity.py',
)
SLOW_TESTS = {
    'lazy_optax/_src/adam.py': (
        'lazy_adam',
    ),
    'lazy_optax/_src/adam_with_counter.py': (
        'adam_with_counter',
    ),
    'lazy_optax/_src/checks.py': (
        'with_id_checks',
    ),
    'lazy_optax/_src/collection.py': (
        'fresh_rows',
    ),
    'lazy_optax/_src/cowclip.py': (
        'cowclip',
    ),
    'lazy_optax/_src/cowclip_adam.py': (
        'lazy_adam_cowclip',
    ),
    'lazy_optax/_src/grads.py': (
        'value_and_grad',
    ),
    'lazy_optax/_src/impls.py': (
        'explain_update',
    ),
    'lazy_optax/_src/keras_clipping.py': (
        'global_clipnorm',
    ),
    'lazy_optax/_src/lookups.py': (
        'lookup_bag',
    ),
    'lazy_optax/_src/multi_steps.py': (
        'multi_steps',
    ),
    'lazy_optax/_src/reset_rows.py': (
        'reset_rows',
    ),
    'lazy_optax/_src/rowwise_adagrad_with_counter.py': (
        'rowwise_adagrad_with_counter',
    ),
    'lazy_optax/_src/sparse_rows.py': (
        'SparseRows',
    ),
    'lazy_optax/_src/stochastic_rounding.py': (
        'apply_updates_stochastic',
        'stochastic_round',
    ),
    'lazy_optax/_src/train_step.py': (
        'make_train_step',
    ),
    'lazy_optax/_src/tree_ops.py': (
        'add',
        'pmean',
    ),
    'tests/test_adam_fast_path.py': (
        'test_fast_path_equals_plain_lazy',
    ),
    'tests/test_adam_with_counter.py': (
        'test_late_row_first_step_is_lr_per_row_and_2_5x_global',
    ),
    'tests/test_backend.py': (
        'test_auto_under_a_cpu_default_device_keeps_the_kernel',
        'test_explain_update_tells_what_the_compiled_step_runs',
        'test_impl_xla_compiles_to_a_step_without_cpp_calls',
        'test_multi_steps_on_xla_path_copies_no_table',
    ),
    'tests/test_checkpoint.py': (
        'test_switch_between_lazy_and_dense_adam',
    ),
    'tests/test_composition.py': (
        'test_accumulating_k_steps_matches_adam_on_the_mean_gradient',
        'test_apply_if_finite_skips_a_nan_step_and_applies_a_finite_one',
        'test_plain_optax_scale_after_a_lazy_transform_scales_the_rows',
        'test_scan_training_loop_matches_python_loop_and_reference',
    ),
    'tests/test_cowclip.py': (
        'test_counts_from_value_and_grad_batch_ids',
        'test_cowclip_and_max_norm_on_bfloat16_tables',
        'test_cowclip_checks_every_tables_counts_in_one_check_naming_the_table',
        'test_cowclip_outside_lazy_clips_every_row_by_its_count',
        'test_cowclip_refuses_missing_or_mismatched_counts',
        'test_cowclip_with_batch_counts_matches_the_float64_model',
        'test_explain_update_names_the_rule_with_tables',
        'test_max_norm_step_bounds_the_rows_it_writes',
        'test_max_norm_bounds_written_rows_only_at_update_time',
        'test_max_norm_update_added_to_other_parameters_adds_its_rows',
    ),
    'tests/test_cpu_kernel.py': (
        'test_a_rule_kernel_given_the_wrong_operands_says_which',
        'test_empty_batch_and_traced_hyperparameters',
        'test_every_composition_reaches_the_kernel_and_equals_generic',
        'test_large_batch_shared_over_threads_matches_float64_rule',
        'test_switched_off_by_environment_gives_the_same_table',
        'test_vmapped_over_an_ensemble_equals_the_generic_path',
    ),
    'tests/test_dedup.py': (
        'test_unique_rows_matches_numpy',
    ),
    'tests/test_deprecations.py': (
        'test_export_changes_function_warns_and_agrees_with_the_method',
        'test_importing_and_using_the_new_names_does_not_warn',
    ),
    'tests/test_errors.py': (
        'test_check_ids_in_range_outside_jit_raises_at_once',
        'test_checked_mode_reports_out_of_range_ids_under_jit',
        'test_column_statistic_state_names_the_state_leaf',
        'test_the_first_line_of_each_error_names_what_happened_and_the_fix',
        'test_unfactored_adafactor_table_is_fine',
    ),
    'tests/test_fused_rules.py': (
        'test_optax_rules_through_the_kernels_equal_pure_xla',
    ),
    'tests/test_grads.py': (
        'test_a_jitted_step_is_traced_once',
        'test_has_aux_and_row_dtype',
        'test_lookups_under_inner_transformations_are_refused',
        'test_named_tables',
        'test_plain_jax_grad_through_lookup_stays_dense_and_correct',
        'test_sparse_gradients_equal_dense_ones',
        'test_table_also_used_densely_gets_the_full_dense_gradient',
        'test_tables_argument_leaves_a_transformed_table_dense',
    ),
    'tests/test_huge_pages.py': (
        'test_donated_lazy_adam_step_keeps_the_advised_buffers',
    ),
    'tests/test_id_safety.py': (
        'test_a_small_capacity_takes_the_default_probe',
        'test_eager_int64_and_jitted_words_give_two_ids_two_rows',
        'test_under_x64_traced_int64_ids_are_kept_whole',
    ),
    'tests/test_keras_clipping.py': (
        'test_clipnorm_uses_the_norm_after_summing_duplicates',
        'test_with_lazy_adam_matches_the_tf_model',
    ),
    'tests/test_lookup_ids.py': (
        'test_checked_mode_reports_out_of_range_lookup_ids_under_jit',
        'test_no_optimizer_ever_updates_the_padding_row',
        'test_padding_id_reads_its_row_and_gives_no_gradient_row',
        'test_under_jit_out_of_range_ids_read_zeros_and_give_no_gradient_row',
    ),
    'tests/test_memory_guard.py': (
        'test_dense_gradient_step_temporaries_grow_with_the_table',
        'test_sparse_step_temporaries_do_not_grow_with_the_table',
    ),
    'tests/test_numeric_faults.py': (
        'test_apply_if_finite_skips_the_whole_step',
        'test_count_saturates_at_int32_max',
        'test_extreme_gradients_give_finite_updates_like_optax_adam',
        'test_non_finite_gradient_row_changes_that_row_only',
    ),
    'tests/test_optax_parity.py': (
        'test_every_row_touched_lazy_equals_optax',
        'test_lazy_clip_by_global_norm_uses_the_summed_gradient_norm',
        'test_skip_zero_rows_caveat_a_touched_row_with_zero_gradient_is_skipped',
        'test_skip_zero_rows_leaves_zero_rows_untouched',
    ),
    'tests/test_partial_rowwise_adam.py': (
        'test_one_entry_rows_are_optax_adamw',
    ),
    'tests/test_per_pattern.py': (
        'test_equals_separate_optimizers_per_group',
        'test_keras_spelling_is_refused_with_its_one_line_conversion',
        'test_untouched_rows_stay_put',
    ),
    'tests/test_precision.py': (
        'test_compiled_temporaries_grow_with_batch_not_table',
        'test_float64_under_x64',
        'test_low_precision_dtypes_stable_in_optax_formulation',
        'test_low_precision_table_with_float32_moments',
    ),
    'tests/test_row_context.py': (
        'test_a_user_transform_gets_its_extra_args_and_the_row_context_key',
        'test_a_wrapper_that_forwards_extra_args_keeps_the_rule_fused',
        'test_nested_lazy_runs_the_inner_rule_on_the_outer_blocks',
        'test_optax_wrappers_around_lazy_forward_the_explanation',
        'test_optax_wrappers_inside_lazy_keep_or_rebuild_the_tables',
        'test_the_extra_argument_is_not_a_jit_argument',
    ),
    'tests/test_rowwise_adagrad_with_counter.py': (
        'test_adagradw_decays_a_returning_row_as_dense_training_would',
        'test_reset_rows_gives_fresh_slots_fresh_counters',
    ),
    'tests/test_semantics.py': (
        'test_clip_before_lazy_as_first_reported',
        'test_damaged_ids_stop_the_jitted_step',
        'test_multi_steps_on_xla_path_is_the_rule_once_a_window',
        'test_scaling_the_tree_keeps_the_rows',
        'test_transform_before_lazy_equals_dense',
        'test_vmapped_step_raises_only_for_damaged_ids',
    ),
    'tests/test_sharding.py': (
        'test_an_id_on_both_data_shards_is_summed_before_the_update',
        'test_per_device_traffic_grows_with_batch_not_table',
    ),
    'tests/test_sparse_rows.py': (
        'test_concatenate_sums_duplicates_across_parts',
        'test_concrete_and_traced_id_codes_have_the_same_bits',
        'test_lazy_update_has_its_gradients_structure',
        'test_out_of_range_ids_are_kept_alike_with_and_without_a_branch',
        'test_sparse_rows_sums_duplicates_when_built',
        'test_value_and_grad_sums_duplicates_once_per_id',
    ),
    'tests/test_state_bytes.py': (
        'test_per_row_leaves_lazy_slots_and_shardings',
    ),
    'tests/test_stochastic_rounding.py': (
        'test_bf16_table_keeps_learning_with_stochastic_rounding',
        'test_bf16_table_with_rowwise_rmsprop_ar_learns_with_stochastic_rounding',
        'test_bf16_table_with_rule_learns_with_stochastic_rounding',
        'test_bits_depend_on_seed_step_and_row_only',
        'test_jit_donation_other_dtypes_and_scalars',
        'test_rounding_is_unbiased',
        'test_same_bits_on_8_devices',
        'test_small_updates_kept_on_average_untouched_rows_bit_for_bit',
    ),
    'tests/test_train_steps.py': (
        'test_a_linear_loss_through_value_and_grad_copies_no_table',
        'test_a_step_that_copies_a_donated_table_is_reported',
        'test_every_python_block_of_the_guide_runs_in_order',
    ),
    'tests/test_tree_arithmetic.py': (
        'test_apply_if_finite_rejected_step_writes_nothing',
        'test_checked_mode_reports_damaged_ids_under_jit',
        'test_every_fix_the_messages_name_runs_on_a_dict',
        'test_flax_train_state_with_clipping_before_lazy_adam',
        'test_haiku_step_with_loss_scaling_and_apply_if_finite',
        'test_jmp_dynamic_loss_scaling_unscales_values_only',
        'test_multi_steps_equals_the_rule_on_the_mean_gradient',
        'test_plain_optax_after_a_lazy_one_acts_on_the_values',
        'test_scaling_gradients_by_a_number_scales_values_only',
        'test_the_documented_ways_run_on_a_dict',
        'test_tree_add_of_microbatches_equals_one_step_on_the_whole_batch',
        'test_tree_arithmetic_on_two_batches_is_refused_eagerly',
        'test_tree_psum_and_pmean_across_8_devices_match_one_device',
        'test_under_jit_damaged_ids_stop_the_step',
    ),
}


def is_slow(path: str, name: str) -> bool:
  """Whether the test `name` (a function's name without its parameters, or
  a doctest's last dotted part) in the file `path` (relative to the
  repository root, `/`-separated) is slow."""
  return path in SLOW_FILES or name in SLOW_TESTS.get(path, ())
