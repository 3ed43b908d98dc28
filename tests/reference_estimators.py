"""Pure-Python ports of two production memory estimators, kept as reference implementations for tests.

These are *ports for comparison in tests*, not course code: each function below keeps its upstream formula exactly
(same arithmetic, same constants, same branches, same order of operations), only stripped of torch and of the
upstream package imports, so the course's own estimators can be checked against what Megatron-LM and DeepSpeed
actually print. Where upstream mutates its ``args`` or prints, the port says so next to the line.

Sources
-------
* Megatron-LM (NVIDIA), ``megatron/training/theoretical_memory_usage.py``, repository
  https://github.com/NVIDIA/Megatron-LM at commit ``d98e8a64ddf34856e74b24714e3bedb2f5a39553`` (main, 2026-08-22;
  the file itself last changed in ``1bcb3b9e0b029c6109d8d32872645bd540052963``, "Fix LatentMoE theoretical memory
  estimate (#5145)"). Ported: ``compute_weight_and_optimizer_memory``, ``compute_activation_memory``,
  ``compute_activation_memory_without_sp``, ``report_theoretical_memory`` and the helper it calls,
  ``is_hybrid_model`` (``megatron/training/utils/common_utils.py``). Also ported, to build arguments as Megatron
  does: the argument defaults (``megatron/training/arguments.py``, ``megatron/core/transformer/transformer_config.py``,
  ``megatron/core/model_parallel_config.py``), the derivations in ``validate_args`` that these functions rely on,
  and ``calculate_padded_vocab_size`` (``megatron/training/vocab_utils.py``).
  License: BSD-3-Clause style ("Copyright (c) 2019-2025, NVIDIA CORPORATION. All rights reserved. Redistribution and
  use in source and binary forms, with or without modification, are permitted provided that ... Redistributions of
  source code must retain the above copyright notice ..."; see the repository's LICENSE). The ported file carries
  "Copyright (c) 2023, NVIDIA CORPORATION. All rights reserved."
* DeepSpeed (Microsoft / deepspeedai), repository https://github.com/deepspeedai/DeepSpeed (formerly
  microsoft/DeepSpeed) at commit ``edaa7221267243c7be7fb49c5d5f5c4fb97b4641`` (master, 2026-08-22):
  ``estimate_zero2_model_states_mem_needs`` and ``estimate_zero2_model_states_mem_needs_all_cold`` from
  ``deepspeed/runtime/zero/stage_1_and_2.py`` (formula last changed in ``f4cb866c2eba60a72d79c3741d12d098fe4e45b8``,
  #5099, 2024-06-04), and ``estimate_zero3_model_states_mem_needs`` and
  ``estimate_zero3_model_states_mem_needs_all_cold`` from ``deepspeed/runtime/zero/stage3.py``. The ``*_all_live``
  variants and ``model_to_params`` need a torch module and are not ported; pass ``total_params`` (and
  ``largest_layer_params``) yourself, counted as upstream does (shared parameters once; "largest layer" = the
  module with the most *direct* parameters, ``m.parameters(recurse=False)``).
  License: Apache-2.0 ("Copyright (c) Microsoft Corporation. SPDX-License-Identifier: Apache-2.0").
  The printed tables use ``f'{OffloadDeviceEnum.cpu:4}'``, which gives ``'cpu '`` on Python <= 3.10 (the docs'
  tables) but ``'OffloadDeviceEnum.cpu'`` on Python >= 3.11 (``Enum.__format__`` change); the port prints
  ``'cpu '``. The ZeRO-2 "offload_optimizer=none" GPU column in ``docs/code-docs/source/memory.rst`` (15.93GB for
  2851M params on 8 GPUs) predates #5099 (``4P + 16P/N``); the current code gives ``2P + 18P/N`` (11.28GB).

Units
-----
Every function here returns **bytes** unless its name says otherwise. Megatron divides by
``NUM_BYTES_IN_MEGABYTE = 1024 * 1024`` and prints "MB" (so its MB are MiB, 2**20 bytes) with ``:.2f``;
:func:`report_theoretical_memory` reproduces that (MiB) and :func:`theoretical_memory_bytes` gives the same
numbers in bytes. DeepSpeed's core estimators return ``int`` bytes; its ``*_all_cold`` tables print
``bytes / 2**30`` with the suffix "GB" (so GiB).

Megatron branches: all are ported (GQA, MLA with and without q-LoRA, MoE with int or list ``moe_layer_freq``, shared
experts and their gate, latent MoE, MTP, expert TP/EP, untied embeddings, interleaved and non-interleaved pipeline
schedules, the SP+selective and the "without SP" activation formulas). Hybrid Mamba models are not supported
*upstream*: :func:`report_theoretical_memory` prints a message and returns ``None`` there, as upstream does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "NUM_BYTES_IN_MEGABYTE",
    "MegatronArgs",
    "calculate_padded_vocab_size",
    "is_hybrid_model",
    "compute_weight_and_optimizer_memory",
    "compute_activation_memory",
    "compute_activation_memory_without_sp",
    "report_theoretical_memory",
    "theoretical_memory_bytes",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
]

# ======================================================================================================
# Megatron-LM
# ======================================================================================================

NUM_BYTES_IN_MEGABYTE = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class MegatronArgs:
    """Exactly the ``args.*`` fields that Megatron's theoretical-memory functions read, with Megatron's defaults.

    Fields with no usable parser default (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``seq_length``,
    ``micro_batch_size``: parser default ``None``, required by ``validate_args``; ``padded_vocab_size``: computed
    from the tokenizer, see :func:`calculate_padded_vocab_size`) must be given.

    ``__post_init__`` applies the ``validate_args`` derivations these functions depend on, as Megatron would before
    calling them: ``ffn_hidden_size`` (4h, or ``int((4h * 2/3) / 64) * 64`` with SwiGLU), ``kv_channels``
    (h // heads), ``expert_tensor_parallel_size`` (= TP), ``num_experts == 0 -> None``, ``moe_ffn_hidden_size``
    (= ffn_hidden_size for MoE), ``virtual_pipeline_model_parallel_size == 1 -> None``, ``sequence_parallel ->
    False`` when TP == 1, and ``data_parallel_size = world_size // (TP * PP * CP)``. Give ``data_parallel_size``
    *or* ``world_size`` (if only DP is given, ``world_size = DP * TP * PP * CP``; upstream reads ``world_size`` only
    for the expert-data-parallel size). ``context_parallel_size`` is not read by the memory functions; it is here
    only for that DP/world-size relation. ``moe_layer_freq`` may be an int or a list/tuple (stored as a tuple).
    """

    # --- network size (required) ---
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    padded_vocab_size: int
    seq_length: int
    micro_batch_size: int
    # --- network size (optional) ---
    ffn_hidden_size: int | None = None  # TransformerConfig default None -> validate_args
    kv_channels: int | None = None  # TransformerConfig default None -> validate_args
    group_query_attention: bool = False  # --group-query-attention
    num_query_groups: int = 1  # TransformerConfig argparse default 1 (ignored unless group_query_attention)
    swiglu: bool = False  # --swiglu
    untie_embeddings_and_output_weights: bool = False  # --untie-embeddings-and-output-weights
    normalization: str = "LayerNorm"  # TransformerConfig default; "RMSNorm" -> 1 param per channel
    add_bias_linear: bool = True  # --disable-bias-linear sets False; read only for the MoE router bias
    # --- multi-latent attention (arguments.py defaults) ---
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # --- MoE ---
    num_experts: int | None = None  # --num-experts
    moe_layer_freq: int | tuple[int, ...] = 1
    moe_ffn_hidden_size: int | None = None
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_router_topk: int = 2
    moe_latent_size: int | None = None
    # --- multi-token prediction ---
    mtp_num_layers: int | None = None
    # --- hybrid Mamba (only tested for None by report_theoretical_memory) ---
    hybrid_layer_pattern: str | None = None
    # --- parallelism ---
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1  # not read by the formulas; only for DP = world // (TP * PP * CP)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None -> TP (validate_args)
    data_parallel_size: int | None = None
    world_size: int | None = None
    use_distributed_optimizer: bool = False
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # None, "selective" or "full"

    def __post_init__(self) -> None:
        def put(name, value):
            object.__setattr__(self, name, value)

        if self.num_experts == 0:
            put("num_experts", None)
        if self.ffn_hidden_size is None:
            if self.swiglu:
                put("ffn_hidden_size", int((4 * self.hidden_size * 2 / 3) / 64) * 64)
            else:
                put("ffn_hidden_size", 4 * self.hidden_size)
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError("hidden_size must be divisible by num_attention_heads when kv_channels is None")
            put("kv_channels", self.hidden_size // self.num_attention_heads)
        if self.expert_tensor_parallel_size is None:
            put("expert_tensor_parallel_size", self.tensor_model_parallel_size)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            put("moe_ffn_hidden_size", self.ffn_hidden_size)
        if isinstance(self.moe_layer_freq, list):
            put("moe_layer_freq", tuple(self.moe_layer_freq))
        if self.virtual_pipeline_model_parallel_size == 1:
            put("virtual_pipeline_model_parallel_size", None)
        if self.tensor_model_parallel_size == 1:
            put("sequence_parallel", False)
        if self.multi_latent_attention and self.group_query_attention:
            raise ValueError("Group query attention is mutually exclusive with multi latent attention.")
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ValueError(
                f"recompute_granularity must be None, 'selective' or 'full': {self.recompute_granularity!r}"
            )
        model_size = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        if self.world_size is None:
            put("world_size", (1 if self.data_parallel_size is None else self.data_parallel_size) * model_size)
        if self.world_size % model_size != 0:
            raise ValueError(f"world size ({self.world_size}) is not divisible by TP * PP * CP ({model_size})")
        dp = self.world_size // model_size
        if self.data_parallel_size is not None and self.data_parallel_size != dp:
            raise ValueError(f"data_parallel_size {self.data_parallel_size} != world_size // (TP*PP*CP) = {dp}")
        put("data_parallel_size", dp)


def calculate_padded_vocab_size(vocab_size, make_vocab_size_divisible_by=128, tensor_model_parallel_size=1):
    """Port of ``megatron/training/vocab_utils.py::calculate_padded_vocab_size`` (without its log line)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if make_vocab_size_divisible_by <= 0:
        raise ValueError(f"make_vocab_size_divisible_by must be positive, got {make_vocab_size_divisible_by}")
    if tensor_model_parallel_size <= 0:
        raise ValueError(f"tensor_model_parallel_size must be positive, got {tensor_model_parallel_size}")
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def is_hybrid_model(args):
    """Returns True if the model is a hybrid Mamba-Transformer model."""
    return args.hybrid_layer_pattern is not None


def compute_weight_and_optimizer_memory(args, verbose=False):
    """Bytes of weights + gradients + optimizer state on the most-loaded model shard (upstream, verbatim formula).

    Accepts a :class:`MegatronArgs` or any object with the same attributes (e.g. a ``SimpleNamespace`` as in
    upstream's unit tests). One deviation from upstream's side effects: upstream *assigns*
    ``args.num_query_groups = args.num_attention_heads`` when ``group_query_attention`` is off; the port uses a
    local instead (the value only feeds this function).
    """
    # Attention projection size.
    query_projection_size = args.kv_channels * args.num_attention_heads
    query_projection_to_hidden_size_ratio = query_projection_size / args.hidden_size
    # Group Query Attention.
    if not args.group_query_attention:
        num_query_groups = args.num_attention_heads  # upstream: args.num_query_groups = args.num_attention_heads
    else:
        num_query_groups = args.num_query_groups
    # MoE.
    num_experts = 1 if args.num_experts is None else args.num_experts
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1

    shared_expert_ffn_hidden_size = (
        0 if args.moe_shared_expert_intermediate_size is None else args.moe_shared_expert_intermediate_size
    )

    if args.num_experts is not None:
        moe_layer_freq = args.moe_layer_freq
        if isinstance(moe_layer_freq, tuple):  # the port stores lists as tuples
            moe_layer_freq = list(moe_layer_freq)
        if isinstance(moe_layer_freq, int):
            moe_layer_pattern = [1 if (i % moe_layer_freq == 0) else 0 for i in range(args.num_layers)]
        elif isinstance(moe_layer_freq, list):
            moe_layer_pattern = moe_layer_freq
            assert len(moe_layer_pattern) == args.num_layers, (
                f"Invalid length of moe_layer_pattern: {len(moe_layer_pattern)}, "
                f"expected {args.num_layers}, "
                f"current moe layer pattern: {args.moe_layer_freq}"
            )
        else:  # upstream would fail with UnboundLocalError here
            raise TypeError(f"moe_layer_freq must be an int or a list, not {type(moe_layer_freq).__name__}")

        num_dense_layers = args.num_layers - sum(moe_layer_pattern)
        num_moe_layers = sum(moe_layer_pattern)
        moe_ffn_hidden_size = args.moe_ffn_hidden_size
    else:
        moe_layer_pattern = [0] * args.num_layers
        num_dense_layers = args.num_layers
        num_moe_layers = 0
        moe_ffn_hidden_size = 0
    assert num_dense_layers + num_moe_layers == args.num_layers
    if args.mtp_num_layers is not None:
        mtp_layer_is_moe = moe_layer_pattern[-1]
        mtp_num_moe_layers = mtp_layer_is_moe * args.mtp_num_layers
        mtp_num_dense_layers = (1 - mtp_layer_is_moe) * args.mtp_num_layers
    else:
        mtp_num_moe_layers = 0
        mtp_num_dense_layers = 0

    # RMSNorm does not have bias, but LayerNorm has.
    norm_size = 1 if args.normalization == "RMSNorm" else 2

    if args.multi_latent_attention:
        assert not args.group_query_attention
        if args.q_lora_rank is None:
            q_term = args.hidden_size * args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
        else:
            ## q lora + rope + q norm
            q_term = args.q_lora_rank * (
                args.hidden_size + args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim) + norm_size
            )

        self_attn_term = (
            q_term
            ## kv lora + rope + kv norm
            + args.kv_lora_rank
            * (args.hidden_size + args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) + norm_size)
            + args.hidden_size * args.qk_pos_emb_head_dim
            ## o proj
            + (args.num_attention_heads * args.v_head_dim) * args.hidden_size
        )
    else:
        self_attn_term = (
            2
            * args.hidden_size
            * args.hidden_size
            # Attention.
            * ((1 + (num_query_groups / args.num_attention_heads)) * query_projection_to_hidden_size_ratio)
        )

    embedding_size = args.hidden_size * args.padded_vocab_size
    final_layernorm = norm_size * args.hidden_size
    if args.untie_embeddings_and_output_weights:
        num_parameters_in_embedding_layers = 2 * embedding_size
    else:
        num_parameters_in_embedding_layers = embedding_size

    attention_params = self_attn_term
    dense_mlp_params = 2 * args.hidden_size * args.ffn_hidden_size * gated_linear_multiplier
    shared_expert_params = 2 * args.hidden_size * shared_expert_ffn_hidden_size * gated_linear_multiplier
    # Latent MoE projects tokens down before routed experts and projects them back after
    # combine. Shared experts still operate on the full hidden dimension.
    routed_expert_hidden_size = args.moe_latent_size if args.moe_latent_size is not None else args.hidden_size
    routed_expert_params = 2 * routed_expert_hidden_size * moe_ffn_hidden_size * num_experts * gated_linear_multiplier
    active_routed_expert_params = (
        2 * routed_expert_hidden_size * moe_ffn_hidden_size * args.moe_router_topk * gated_linear_multiplier
        if args.num_experts is not None
        else 0
    )
    latent_projection_params = (
        2 * args.hidden_size * args.moe_latent_size
        if args.num_experts is not None and args.moe_latent_size is not None
        else 0
    )
    layernorm_params = 2 * args.hidden_size * norm_size
    router_params = (
        (args.hidden_size * num_experts) + (num_experts if args.add_bias_linear else 0)
        if args.num_experts is not None
        else 0
    )
    shared_expert_gate_params = (
        args.hidden_size if shared_expert_ffn_hidden_size > 0 and getattr(args, "moe_shared_expert_gate", False) else 0
    )

    num_parameters_in_transformer_layer_dense = attention_params + dense_mlp_params + layernorm_params
    num_parameters_in_transformer_layer_moe = (
        attention_params
        + shared_expert_params
        + routed_expert_params
        + latent_projection_params
        + layernorm_params
        + router_params
        + shared_expert_gate_params
    )
    num_active_parameters_in_transformer_layer_moe = (
        attention_params
        + shared_expert_params
        + active_routed_expert_params
        + latent_projection_params
        + layernorm_params
        + router_params
        + shared_expert_gate_params
    )
    num_parameters_in_transformer_block = (
        num_parameters_in_transformer_layer_dense * num_dense_layers
        + num_parameters_in_transformer_layer_moe * num_moe_layers
        + final_layernorm
    )
    num_active_parameters_in_transformer_block = (
        num_parameters_in_transformer_layer_dense * num_dense_layers
        + num_active_parameters_in_transformer_layer_moe * num_moe_layers
        + final_layernorm
    )
    num_parameters_in_mtp_block = (
        num_parameters_in_transformer_layer_dense * mtp_num_dense_layers
        + num_parameters_in_transformer_layer_moe * mtp_num_moe_layers
    )
    num_total_parameters = (
        num_parameters_in_transformer_block + num_parameters_in_mtp_block + num_parameters_in_embedding_layers
    )
    num_active_parameters = (
        num_active_parameters_in_transformer_block + num_parameters_in_mtp_block + num_parameters_in_embedding_layers
    )
    if verbose:
        print(
            f"Number of parameters in transformer block in billions: {num_parameters_in_transformer_block / 10**9: .2f}"
        )
        print(
            f"Number of active parameters in transformer block in billions: "
            f"{num_active_parameters_in_transformer_block / 10**9: .2f}"
        )
        if args.mtp_num_layers is not None:
            print(f"Number of parameters in mtp block in billions: {num_parameters_in_mtp_block / 10**9: .2f}")
        print(f"Number of parameters in embedding layers in billions: {num_parameters_in_embedding_layers / 10**9:.2f}")
        print(f"Total number of parameters in billions: {num_total_parameters / 10**9:.2f}")
        print(f"Total number of active parameters in billions: {num_active_parameters / 10**9:.2f}")

    expert_tensor_parallel_size = args.expert_tensor_parallel_size
    expert_model_parallel_size = args.expert_model_parallel_size
    expert_tensor_model_pipeline_parallel_size = (
        expert_tensor_parallel_size * expert_model_parallel_size * args.pipeline_model_parallel_size
    )
    expert_data_parallel_size = args.world_size // expert_tensor_model_pipeline_parallel_size

    # Split params by how they are held on each rank: regular TP, replicated, or EP/ETP.
    tp_sharded_params_in_transformer_block = (attention_params + dense_mlp_params) * num_dense_layers + (
        attention_params + shared_expert_params
    ) * num_moe_layers
    replicated_params_in_transformer_block = (
        layernorm_params * num_dense_layers
        + (layernorm_params + latent_projection_params + router_params + shared_expert_gate_params) * num_moe_layers
        + final_layernorm
    )
    expert_sharded_params_in_transformer_block = routed_expert_params * num_moe_layers
    tp_sharded_params_in_mtp_block = (attention_params + dense_mlp_params) * mtp_num_dense_layers + (
        attention_params + shared_expert_params
    ) * mtp_num_moe_layers
    replicated_params_in_mtp_block = (
        layernorm_params * mtp_num_dense_layers
        + (layernorm_params + latent_projection_params + router_params + shared_expert_gate_params) * mtp_num_moe_layers
    )
    expert_sharded_params_in_mtp_block = routed_expert_params * mtp_num_moe_layers

    # Most loaded model shard has 1/pp_size transformer layers, 1 mtp block, and 1 embedding layer.
    tp_sharded_params_on_most_loaded_shard = (
        (tp_sharded_params_in_transformer_block / args.pipeline_model_parallel_size)
        + tp_sharded_params_in_mtp_block
        + embedding_size
    ) / args.tensor_model_parallel_size
    replicated_params_on_most_loaded_shard = (
        replicated_params_in_transformer_block / args.pipeline_model_parallel_size
    ) + replicated_params_in_mtp_block
    expert_sharded_params_on_most_loaded_shard = (
        (expert_sharded_params_in_transformer_block / args.pipeline_model_parallel_size)
        + expert_sharded_params_in_mtp_block
    ) / (expert_tensor_parallel_size * expert_model_parallel_size)
    num_parameters_on_most_loaded_model_shard = (
        tp_sharded_params_on_most_loaded_shard
        + replicated_params_on_most_loaded_shard
        + expert_sharded_params_on_most_loaded_shard
    )
    if args.untie_embeddings_and_output_weights and args.pipeline_model_parallel_size == 1:
        tp_sharded_params_on_most_loaded_shard += embedding_size / args.tensor_model_parallel_size
        num_parameters_on_most_loaded_model_shard += embedding_size / args.tensor_model_parallel_size
    if verbose:
        print(
            f"Number of parameters in most loaded shard in billions: "
            f"{num_parameters_on_most_loaded_model_shard / 10**9:.4f}"
        )

    if args.pipeline_model_parallel_size > 1:
        # Other shards just have 1/pp_size transformer layers.
        num_parameters_on_other_model_shards = (
            tp_sharded_params_in_transformer_block
            / (args.pipeline_model_parallel_size * args.tensor_model_parallel_size)
            + replicated_params_in_transformer_block / args.pipeline_model_parallel_size
            + expert_sharded_params_in_transformer_block
            / (args.pipeline_model_parallel_size * expert_tensor_parallel_size * expert_model_parallel_size)
        )
        if verbose:
            print(
                f"Number of parameters in other shards in billions: {num_parameters_on_other_model_shards / 10**9:.4f}"
            )

    def num_bytes_per_parameter(data_parallel_size):
        # This estimator assumes bf16 training: bf16 model params, fp32 main gradients,
        # fp32 main params, and fp32 Adam states. See docs/user-guide/features/dist_optimizer.md.
        return 18 if not args.use_distributed_optimizer else 6 + (12 / data_parallel_size)

    weight_and_optimizer_memory = (
        tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard
    ) * num_bytes_per_parameter(args.data_parallel_size) + expert_sharded_params_on_most_loaded_shard * (
        num_bytes_per_parameter(expert_data_parallel_size)
    )

    return weight_and_optimizer_memory


def compute_activation_memory(args, num_microbatches, verbose=False):
    """Activation bytes on the first pipeline stage, sequence parallel + selective recompute (upstream, verbatim).

    Korthikanti et al. 2022 (arXiv:2205.05198), Table 2, "sequence parallel + selective recompute":
    ``sbh * 34 / t`` per layer, generalised to ``sbh * (18 + 4 * ffn/h) / t``. ``num_microbatches`` is what
    training passes (``get_num_microbatches()``); ``None`` as in ``tools/report_theoretical_memory.py``.
    """
    # Using formula in Table 2 of https://arxiv.org/pdf/2205.05198.pdf.
    # We are trying to compute the maximum activation footprint, so all calculations in this
    # function are for the first pipeline stage.

    # TODO: This function needs to take into account query_projection_size potentially being
    # different from hidden_size.

    # Memory footprint from transformer layer (self-attention and MLP).
    activation_memory = (args.seq_length * args.micro_batch_size * args.hidden_size) * (
        18 + (4 * (args.ffn_hidden_size / args.hidden_size))
    )
    if verbose:
        print(
            f"Activation memory footprint per transformer layer: "
            f"{activation_memory / NUM_BYTES_IN_MEGABYTE / args.tensor_model_parallel_size:.1f} MB"
        )
    activation_memory *= args.num_layers

    # Now add activation memory required for input embeddings, last LayerNorm and output layer.

    # Input to embedding (pp_size microbatches in flight).
    activation_memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    # Dropout in embedding layer (pp_size microbatches in flight).
    activation_memory += args.seq_length * args.micro_batch_size * args.hidden_size * args.pipeline_model_parallel_size

    # Multiply by interleaved PP memory factor.
    if args.virtual_pipeline_model_parallel_size is not None:
        interleaved_schedule_memory_penalty = 1 + (
            (args.pipeline_model_parallel_size - 1)
            / (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size)
        )
        in_flight_microbatches = math.ceil(interleaved_schedule_memory_penalty * args.pipeline_model_parallel_size)
        if verbose:
            print(f"Memory penalty from interleaved schedule: {interleaved_schedule_memory_penalty:.2f}")
            print(f"Number of in-flight microbatches: {in_flight_microbatches}")
        activation_memory *= interleaved_schedule_memory_penalty

    # If using non-interleaved schedule, number of microbatches in pipeline can be less than pp_size,
    # so discount accordingly.
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
            in_flight_microbatches = min(num_microbatches, args.pipeline_model_parallel_size)
        else:
            in_flight_microbatches = args.pipeline_model_parallel_size
        if verbose:
            print(f"Number of in-flight microbatches: {in_flight_microbatches}")

    if args.pipeline_model_parallel_size == 1:
        # Inputs to output layer and CE loss.
        activation_memory += (
            args.seq_length
            * args.micro_batch_size
            * args.hidden_size
            * 4
            * (1 + (args.padded_vocab_size / args.hidden_size))
        )

    # Activation memory is partitioned by TP size due to tensor and sequence model parallelism.
    return activation_memory / args.tensor_model_parallel_size


def compute_activation_memory_without_sp(args, num_microbatches, verbose=False):
    """Compute activation memory without sequence parallelism (upstream, verbatim formula).

    Korthikanti et al. 2022, Table 2, "tensor parallel + selective recompute": ``sbh * (10 + 24 / t)`` per layer,
    then a flat x1.05 overhead on the total. Used by upstream whenever *not* (SP and selective recompute).
    """

    # 4. Compute per-layer memory
    per_layer_memory = (
        args.seq_length * args.micro_batch_size * args.hidden_size * (10 + (24 / args.tensor_model_parallel_size))
    )

    if verbose:
        print(
            f"Activation memory footprint per transformer layer (precise, without SP): "
            f"{per_layer_memory / NUM_BYTES_IN_MEGABYTE:.1f} MB"
        )

    # 5. Multiply by number of layers
    total_activation_memory = per_layer_memory * args.num_layers

    # 6. Add embedding activations
    # Input to embedding (pp_size microbatches in flight)
    total_activation_memory += 8 * args.seq_length * args.micro_batch_size * args.pipeline_model_parallel_size
    # Dropout in embedding layer (pp_size microbatches in flight)
    total_activation_memory += (
        args.seq_length * args.micro_batch_size * args.hidden_size * args.pipeline_model_parallel_size
    )

    # 7. Handle pipeline parallelism schedules
    # Multiply by interleaved PP memory factor
    if args.virtual_pipeline_model_parallel_size is not None:
        interleaved_schedule_memory_penalty = 1 + (
            (args.pipeline_model_parallel_size - 1)
            / (args.pipeline_model_parallel_size * args.virtual_pipeline_model_parallel_size)
        )
        in_flight_microbatches = math.ceil(interleaved_schedule_memory_penalty * args.pipeline_model_parallel_size)
        if verbose:
            print(f"Memory penalty from interleaved schedule: {interleaved_schedule_memory_penalty:.2f}")
            print(f"Number of in-flight microbatches: {in_flight_microbatches}")
        total_activation_memory *= interleaved_schedule_memory_penalty

    # If using non-interleaved schedule, number of microbatches in pipeline can be less than pp_size
    if args.virtual_pipeline_model_parallel_size is None and args.pipeline_model_parallel_size > 1:
        if num_microbatches is not None:
            total_activation_memory *= min(1, num_microbatches / args.pipeline_model_parallel_size)
            in_flight_microbatches = min(num_microbatches, args.pipeline_model_parallel_size)
        else:
            in_flight_microbatches = args.pipeline_model_parallel_size
        if verbose:
            print(f"Number of in-flight microbatches: {in_flight_microbatches}")

    # 8. Add output layer memory if needed
    if args.pipeline_model_parallel_size == 1:
        # Logits calculation
        logits_size = args.seq_length * args.micro_batch_size * args.padded_vocab_size
        # The output projection is partitioned across TP
        logits_size /= args.tensor_model_parallel_size

        # Outputs from final layer norm
        final_ln_output = args.seq_length * args.micro_batch_size * args.hidden_size

        total_activation_memory += (logits_size + final_ln_output) * 2  # multiply by 2 for bytes

    # 9. Add buffer for optimizer and miscellaneous temporaries (5% overhead)
    overhead_factor = 1.05
    total_activation_memory *= overhead_factor

    return total_activation_memory


def _uses_sp_formula(args):
    # The branch of report_theoretical_memory: SP *and* selective recompute -> compute_activation_memory.
    return args.sequence_parallel and args.recompute_granularity == "selective"


def theoretical_memory_bytes(args, num_microbatches=None):
    """``report_theoretical_memory`` in bytes and silent: ``(weight_and_optimizer, activation, total)``.

    Same branch choice as upstream (the SP formula only when ``sequence_parallel`` and
    ``recompute_granularity == "selective"``, otherwise the "without SP" formula); ``None`` for hybrid models.
    """
    if is_hybrid_model(args):
        return None
    weight_and_optimizer_memory = compute_weight_and_optimizer_memory(args)
    if _uses_sp_formula(args):
        activation_memory = compute_activation_memory(args, num_microbatches=num_microbatches)
    else:
        activation_memory = compute_activation_memory_without_sp(args, num_microbatches=num_microbatches)
    return weight_and_optimizer_memory, activation_memory, weight_and_optimizer_memory + activation_memory


def report_theoretical_memory(args, num_microbatches=None, verbose=False):
    """Upstream's report, verbatim: prints and returns ``(weight_and_optimizer, activation, total)`` in MiB.

    (``print_rank_0`` is plain ``print`` here.) Returns ``None`` for hybrid Mamba models, as upstream.
    """
    if is_hybrid_model(args):
        print("Theoretical memory footprints not yet supported for hybrid Mamba-Transformer models.")
        return

    weight_and_optimizer_memory = compute_weight_and_optimizer_memory(args, verbose=verbose) / NUM_BYTES_IN_MEGABYTE

    # Choose the appropriate activation memory calculation based on parallelism strategy
    if args.sequence_parallel and args.recompute_granularity == "selective":
        print("compute_activation_memory with SP")
        activation_memory = (
            compute_activation_memory(args, num_microbatches=num_microbatches, verbose=verbose) / NUM_BYTES_IN_MEGABYTE
        )
    else:
        print("compute_activation_memory_without_sp")
        activation_memory = (
            compute_activation_memory_without_sp(args, num_microbatches=num_microbatches, verbose=verbose)
            / NUM_BYTES_IN_MEGABYTE
        )

    total_memory = weight_and_optimizer_memory + activation_memory

    print(
        f"Theoretical memory footprints: weight and optimizer={weight_and_optimizer_memory:.2f} MB, "
        f"activation={activation_memory:.2f} MB, total={total_memory:.2f} MB\n"
    )

    return weight_and_optimizer_memory, activation_memory, total_memory


# ======================================================================================================
# DeepSpeed
# ======================================================================================================


def estimate_zero2_model_states_mem_needs(
    total_params, num_gpus_per_node=1, num_nodes=1, cpu_offload=True, additional_buffer_factor=1.5
):
    """ZeRO-2 model-states estimate, verbatim: returns ``(cpu_mem, gpu_mem)`` in bytes (ints).

    ZeRO-2 has no ``cpu_offload_params`` / ``zero_init`` options upstream (those are ZeRO-3 only).
    """
    total_gpus = num_nodes * num_gpus_per_node

    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        # GPU's total_params multipliers: 2 = params_16bit,
        # 18 = 2_grads_16bit + 4_grads_32bit + 4_params_32bit + 8_optimizer_states_32bit(momentum and variance)
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem)


def _zero2_all_cold_lines(total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5):
    def format_options(cpu_offload):
        enabled = []
        device = f"{'cpu':4}" if cpu_offload else "none"  # upstream: f'{OffloadDeviceEnum.cpu:4}'
        enabled.append(f"offload_optimizer={device}")
        return ", ".join(enabled)

    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
        f"SW: Model with {int(total_params / 1e6)}M total params.",
        "  per CPU  |  per GPU |   Options",
    ]
    for cpu_offload in [True, False]:
        cpu_mem, gpu_mem = estimate_zero2_model_states_mem_needs(
            total_params=total_params,
            num_gpus_per_node=num_gpus_per_node,
            num_nodes=num_nodes,
            cpu_offload=cpu_offload,
            additional_buffer_factor=additional_buffer_factor,
        )
        options_str = format_options(cpu_offload=cpu_offload)
        lines.append(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options_str}")
    return lines


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """Prints upstream's ZeRO-2 table (GiB, labelled "GB"); also returns the printed text (upstream returns None)."""
    text = "\n".join(_zero2_all_cold_lines(total_params, num_gpus_per_node, num_nodes, additional_buffer_factor))
    print(text)
    return text


def estimate_zero3_model_states_mem_needs(
    total_params,
    largest_layer_params,
    num_gpus_per_node=1,
    num_nodes=1,
    cpu_offload=True,
    cpu_offload_params=True,
    zero_init=True,
    additional_buffer_factor=1.5,
):
    """ZeRO-3 model-states estimate, verbatim: returns ``(cpu_mem, gpu_mem, largest_layer_memory)`` in bytes.

    ``cpu_mem`` and ``gpu_mem`` are ``int``; ``largest_layer_memory`` is ``4 * largest_layer_params`` un-cast, as
    upstream (a float if ``largest_layer_params`` is).
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params

    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory

            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor

        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)

            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor

    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def _zero3_all_cold_lines(
    total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    def format_options(cpu_offload, cpu_offload_params, zero_init):
        enabled = []
        padded_cpu_str = f"{'cpu':4}"  # upstream: f'{OffloadDeviceEnum.cpu:4}'
        param_device = padded_cpu_str if cpu_offload_params else "none"
        enabled.append(f"offload_param={param_device}")
        optimizer_device = padded_cpu_str if cpu_offload else "none"
        enabled.append(f"offload_optimizer={optimizer_device}")
        enabled.append(f"zero_init={1 if zero_init else 0}")
        return ", ".join(enabled)

    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    lines = [
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
        f"SW: Model with {int(total_params / 1e6)}M total params, "
        f"{int(largest_layer_params / 1e6)}M largest layer params.",
        "  per CPU  |  per GPU |   Options",
    ]
    for cpu_offload in [True, False]:
        for cpu_offload_params in [True, False]:
            if not cpu_offload and cpu_offload_params:
                continue
            for zero_init in [True, False]:
                cpu_mem, gpu_mem, largest_layer_memory = estimate_zero3_model_states_mem_needs(
                    total_params=total_params,
                    largest_layer_params=largest_layer_params,
                    num_gpus_per_node=num_gpus_per_node,
                    num_nodes=num_nodes,
                    cpu_offload=cpu_offload,
                    cpu_offload_params=cpu_offload_params,
                    zero_init=zero_init,
                    additional_buffer_factor=additional_buffer_factor,
                )
                options_str = format_options(
                    cpu_offload=cpu_offload, cpu_offload_params=cpu_offload_params, zero_init=zero_init
                )
                lines.append(f" {cpu_mem / 2**30:7.2f}GB | {gpu_mem / 2**30:6.2f}GB | {options_str}")
    return lines


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params, largest_layer_params, num_gpus_per_node=1, num_nodes=1, additional_buffer_factor=1.5
):
    """Prints upstream's ZeRO-3 table (GiB, labelled "GB"); also returns the printed text (upstream returns None)."""
    lines = _zero3_all_cold_lines(
        total_params, largest_layer_params, num_gpus_per_node, num_nodes, additional_buffer_factor
    )
    text = "\n".join(lines)
    print(text)
    return text
