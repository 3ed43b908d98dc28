"""The at-scale memory model against the references (issue 15): Megatron-LM's ``theoretical_memory_usage.py`` and
DeepSpeed's ZeRO-2/ZeRO-3 model-state estimators, ported verbatim in ``reference_estimators.py``, on the same
inputs. Under their conventions (Megatron: 18 bytes a parameter, or 6 + 12/d with its distributed optimizer, no
bias or learned position counted; DeepSpeed: its fp16 + fp32 gradients) the bytes are equal; where we differ on
purpose the test says by how much and why. Then the four errors the comparison found, each with a test that
failed before."""

import dataclasses
import json
import re

import pytest
from reference_estimators import (
    MegatronArgs,
    compute_activation_memory,
    compute_activation_memory_without_sp,
    compute_weight_and_optimizer_memory,
    estimate_zero2_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs,
)

from course_lib.ledgers.memory import CATEGORIES
from course_lib.model.config import Layout
from course_lib.model.formulas import (
    activation_bytes_per_layer,
    memory_formula,
    model_state_formula,
    stage_shape,
    transformer_params,
)
from course_lib.model.stages import stage_expert_params, stage_params
from course_lib.planner.presets import make_model

GPT_175B = {"num_layers": 96, "hidden_size": 12288, "num_attention_heads": 96, "padded_vocab_size": 51200}
GPT_1_7B = {"num_layers": 24, "hidden_size": 2304, "num_attention_heads": 24, "padded_vocab_size": 51200}
GPT_18B = {"num_layers": 40, "hidden_size": 6144, "num_attention_heads": 48, "padded_vocab_size": 51200}
LLAMA = {"swiglu": True, "untie_embeddings_and_output_weights": True, "normalization": "RMSNorm"}
LLAMA_8B = {
    "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "padded_vocab_size": 128256,
    "group_query_attention": True, "num_query_groups": 8, "ffn_hidden_size": 14336, **LLAMA,
}  # fmt: skip
LLAMA_70B = {**LLAMA_8B, "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64, "ffn_hidden_size": 28672}

# (shape, sequence, micro batch, tp, pp, dp, sp, recompute, distributed optimizer, virtual stages)
CONFIGS = {
    "gpt175b-tp8-pp8-sp-sel-distopt": (GPT_175B, 2048, 1, 8, 8, 8, True, "selective", True, None),
    "gpt175b-tp8-pp8-sp-sel-vpp3": (GPT_175B, 2048, 1, 8, 8, 4, True, "selective", False, 3),
    "gpt175b-tp8-pp16-nosp": (GPT_175B, 2048, 1, 8, 16, 2, False, "selective", True, None),
    "gpt1.7b-tp1-pp1-dp32": (GPT_1_7B, 2048, 16, 1, 1, 32, False, None, False, None),
    "gpt1.7b-tp2-pp1-sp-sel": (GPT_1_7B, 2048, 4, 2, 1, 16, True, "selective", True, None),
    "gpt18b-tp8-pp1-sp-sel": (GPT_18B, 2048, 8, 8, 1, 32, True, "selective", False, None),
    "gpt18b-tp4-pp2-nosp-vpp2": (GPT_18B, 2048, 2, 4, 2, 8, False, "selective", True, 2),
    "llama8b-tp1-pp4-dp8": (LLAMA_8B, 8192, 1, 1, 4, 8, False, None, False, None),
    "llama8b-tp1-pp4-dp8-distopt": (LLAMA_8B, 8192, 1, 1, 4, 8, False, None, True, None),
    "llama8b-tp2-pp1-sp-sel": (LLAMA_8B, 8192, 1, 2, 1, 8, True, "selective", True, None),
    "llama70b-tp8-pp4-sp-sel-distopt": (LLAMA_70B, 8192, 1, 8, 4, 16, True, "selective", True, None),
    "llama70b-tp8-pp8-sp-sel-vpp5": (LLAMA_70B, 8192, 1, 8, 8, 4, True, "selective", False, 5),
}


def megatron(name: str) -> MegatronArgs:
    shape, s, b, tp, pp, dp, sp, recompute, distopt, vpp = CONFIGS[name]
    return MegatronArgs(
        **shape, seq_length=s, micro_batch_size=b, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=dp, sequence_parallel=sp, recompute_granularity=recompute,
        use_distributed_optimizer=distopt, virtual_pipeline_model_parallel_size=vpp,
    )  # fmt: skip


def counted_as_megatron_does(args: MegatronArgs) -> int:
    """Our parameter count of the model, without biases and learned positions (which Megatron's estimator skips)."""
    return transformer_params(
        args.num_layers, args.hidden_size, args.padded_vocab_size, heads=args.num_attention_heads,
        kv_heads=args.num_query_groups if args.group_query_attention else None, ffn=args.ffn_hidden_size,
        swiglu=args.swiglu, tied=not args.untie_embeddings_and_output_weights,
        norm="rmsnorm" if args.normalization == "RMSNorm" else "layernorm", biases=False,
    )["total"]  # fmt: skip


def ours(args: MegatronArgs, as_megatron_counts_activations: bool = True) -> dict:
    """Our memory on Megatron's inputs: its 18-byte convention, its distributed optimizer as ZeRO-1. Megatron's
    activation formula counts K and V as wide as Q and an MLP's inner activations as GELU's 4 ffn/h; with
    ``as_megatron_counts_activations`` we do too (else grouped-query attention and SwiGLU count as they are)."""
    gqa = args.num_query_groups if args.group_query_attention else None
    layout = Layout(
        tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size, dp=args.data_parallel_size,
        zero=1 if args.use_distributed_optimizer else 0, chunks=args.virtual_pipeline_model_parallel_size or 1,
        sp=args.sequence_parallel, recompute=args.recompute_granularity or "none", micro_batch=args.micro_batch_size,
    )  # fmt: skip
    return memory_formula(
        counted_as_megatron_does(args), "megatron", layout,
        layers=args.num_layers, seq=args.seq_length, hidden=args.hidden_size, heads=args.num_attention_heads,
        ffn=args.ffn_hidden_size, vocab=args.padded_vocab_size, tied=not args.untie_embeddings_and_output_weights,
        kv_heads=None if as_megatron_counts_activations else gqa,
        swiglu=args.swiglu and not as_megatron_counts_activations,
        norm="rmsnorm" if args.normalization == "RMSNorm" else "layernorm",
    )  # fmt: skip


def states(memory: dict) -> float:
    return sum(memory[c] for c in CATEGORIES)


@pytest.mark.parametrize("name", CONFIGS)
def test_weights_and_optimizer_equal_megatrons(name):
    args = megatron(name)
    assert states(ours(args)) == pytest.approx(compute_weight_and_optimizer_memory(args), rel=1e-12)


@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n][6] and CONFIGS[n][7] == "selective"])
def test_activations_equal_megatrons_sequence_parallel_formula(name):
    """Megatron's sequence-parallel formula (Korthikanti et al. 2022 Table 2, selective recompute, which
    FlashAttention gives for free) with its embedding and output-layer terms: equal."""
    args = megatron(name)
    mine = ours(args)
    assert mine["stage"] in ("all", "first")  # Megatron counts the first stage
    assert mine["activations"] == pytest.approx(compute_activation_memory(args, None), rel=1e-12)


@pytest.mark.parametrize("name", [n for n in CONFIGS if not CONFIGS[n][6] and CONFIGS[n][4] > 1])
def test_megatrons_formula_without_sequence_parallelism_adds_five_percent(name):
    """Without sequence parallelism Megatron uses Korthikanti's sbh(10 + 24/t) per layer, as we do, and multiplies
    the total by 1.05 (its allowance for temporaries, which we do not make: our figures are what is kept for
    backward), and it takes every MLP as 4h wide whatever its width (Llama-3-8B's is 3.5h). On a pipeline's first
    stage (no output layer) those are the only differences."""
    args = dataclasses.replace(megatron(name), recompute_granularity="selective")
    mine = ours(dataclasses.replace(args, ffn_hidden_size=4 * args.hidden_size))
    assert mine["stage"] == "first"
    assert compute_activation_memory_without_sp(args, None) == pytest.approx(1.05 * mine["activations"], rel=1e-12)


def test_megatron_counts_the_parameters_as_we_do_without_biases_and_positions():
    """On one GPU without the distributed optimizer Megatron's bytes are 18 per parameter of its count, which is
    ours without linear biases and learned position embeddings; the course's GPT has both, and we count them
    (GPT-3 175B: 25.2M positions, 1.2M biases)."""
    for name in CONFIGS:
        args = dataclasses.replace(
            megatron(name), tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1,
            world_size=None, sequence_parallel=False, virtual_pipeline_model_parallel_size=None,
            use_distributed_optimizer=False,
        )  # fmt: skip
        assert compute_weight_and_optimizer_memory(args) == 18 * counted_as_megatron_does(args)
    h, seq = 12288, 2048
    with_both = transformer_params(96, h, 51200, heads=96, positions=seq)["total"]
    assert with_both - counted_as_megatron_does(megatron("gpt175b-tp8-pp8-sp-sel-distopt")) == 96 * 6 * h + seq * h


def test_grouped_query_attention_and_swiglu_count_as_they_are():
    """Where we differ from Megatron on purpose: K and V of 8 groups are a quarter of Q's for Llama-3-8B (4 x
    (1 - 8/32) = 3 sbh less per layer) and a fused SwiGLU keeps its gate and up projections and their product
    (6 ffn/h, not 4): per layer sbh (3.5 x 14336/4096 - 3) more, split by TP under sequence parallelism."""
    args = megatron("llama8b-tp2-pp1-sp-sel")
    s, b, h, t = args.seq_length, args.micro_batch_size, args.hidden_size, args.tensor_model_parallel_size
    difference = ours(args, as_megatron_counts_activations=False)["activations"] - ours(args)["activations"]
    assert difference == pytest.approx(args.num_layers * s * b * h / t * (2 * 14336 / 4096 - 3), rel=1e-12)


# ------------------------------------------------------------------------------------------------ DeepSpeed
DEEPSPEED = [  # (total params, largest layer, GPUs per node, nodes)
    (7e9, 131e6, 8, 1),
    (7e9, 131e6, 8, 4),
    (2851e6, 32e6, 8, 1),
    (70e9, 1.05e9, 8, 16),
    (175e9, 629e6, 8, 64),
    (1.3e9, 51e6, 4, 2),
]


@pytest.mark.parametrize(("params", "largest", "per_node", "nodes"), DEEPSPEED)
def test_zero2_equals_deepspeeds_estimator(params, largest, per_node, nodes):
    _, gpu = estimate_zero2_model_states_mem_needs(params, per_node, nodes, cpu_offload=False)
    mine = states(model_state_formula(params, "deepspeed", zero=2, dp=per_node * nodes))
    assert gpu <= mine < gpu + 1  # DeepSpeed rounds 18P/N down to whole bytes


@pytest.mark.parametrize(("params", "largest", "per_node", "nodes"), DEEPSPEED)
def test_zero3_equals_deepspeeds_estimator(params, largest, per_node, nodes):
    _, gpu, largest_bytes = estimate_zero3_model_states_mem_needs(
        params, largest, per_node, nodes, cpu_offload=False, cpu_offload_params=False
    )
    mine = model_state_formula(params, "deepspeed", zero=3, dp=per_node * nodes, largest_layer=largest)
    assert gpu <= states(mine) < gpu + 1
    assert largest_bytes == 4 * largest  # the gathered layer's fp16 weights and gradients, in params and grads


# ------------------------------------------------------------------------------------------------ the four errors
def test_the_busiest_pipeline_stage_holds_an_embedding_matrix():
    """Llama-3-8B at PP 4: a stage holds 8 of 32 layers plus a 128,256 x 4096 matrix, 13% more weights and
    optimizer state than an even split (which the planner used to decide "fits" on)."""
    m = make_model(preset="llama3-8b")
    busiest = states(memory_formula(m.params, "megatron", Layout(pp=4), **m.memory_shape()))
    even = states(model_state_formula(m.params, "megatron", pp=4))
    assert busiest / even == pytest.approx(1.131, abs=0.001)


def test_activations_outside_the_layers_are_counted():
    """One stage: per layer what Table 2 counts, plus the token ids (8 bytes), the embedding's dropout mask (1
    byte a value), the output head's input and the fp32 logits (4sbh + 4sbV), split by TP under SP."""
    s, b, h, a, v, t, layers = 4096, 2, 2048, 16, 50304, 4, 12
    layout = Layout(tp=t, sp=True, micro_batch=b)
    got = memory_formula(1e9, "mixed", layout, layers=layers, seq=s, hidden=h, heads=a, vocab=v)
    layer = activation_bytes_per_layer(s, b, h, a, t, sp=True)
    assert got["activations"] == pytest.approx(
        layers * layer + (8 * s * b + s * b * h + 4 * s * b * h + 4 * s * b * v) / t
    )


def test_the_last_stage_is_the_busiest_when_the_vocabulary_is_large():
    """Its one microbatch of layers and the logits against the first stage's p microbatches in flight."""
    got = memory_formula(1e9, "mixed", Layout(pp=8), layers=8, seq=8192, hidden=1024, heads=8, vocab=256000)
    assert got["stage"] == "last"


def test_zero3_keeps_the_gathered_layer():
    """Llama-3-8B with ZeRO-3 over 512 GPUs: the shards are 0.25 GB, but the embedding (525M parameters) must be
    gathered whole, its 16-bit weights and then its gradient: at least 2.1 GB."""
    m = make_model(preset="llama3-8b")
    got = states(memory_formula(m.params, "mixed", Layout(dp=512, zero=3), **m.memory_shape()))
    assert got > 4 * 128256 * 4096 > 2.1e9
    assert states(model_state_formula(m.params, "mixed", zero=3, dp=512)) == pytest.approx(16 * m.params / 512)


def test_full_recompute_under_sequence_parallelism_splits_the_saved_input():
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sp=True, recompute="full") == 2 * s * b * h / 8
    assert activation_bytes_per_layer(s, b, h, a, tp=8, recompute="full") == 2 * s * b * h


def test_the_memory_command_says_where_it_differs_from_the_reference(capsys):
    from course_lib.cli import main

    assert main(["memory", "--preset", "llama3-8b", "--precision", "megatron", "--pp", "4"]) == 0
    out = capsys.readouterr().out
    assert "bytes on the busiest GPU (the first pipeline stage)" in out
    assert "against the reference: weights and optimizer equal Megatron-LM's" in out


# ------------------------------------------------------------------------------------------------ uneven stages
# Megatron-Bridge's toy model (its tests/unit_tests/training/utils/test_theoretical_memory_utils.py): hidden 16,
# 4 heads, FFN 64, vocabulary 32, untied, no biases, LayerNorm, 8 layers at PP 4 with 1 layer on the first stage and
# 3 on the last (2 on each other), its distributed optimizer over DP 4 (6 + 12/4 = 9 bytes a parameter).
BRIDGE_TOY = {"layers": 8, "hidden": 16, "vocab": 32}
BRIDGE_UNEVEN = (1, 2, 2, 3)


def bridge_toy_states(stage_layers: tuple[int, ...], stage: int | None = None) -> dict:
    params = transformer_params(**BRIDGE_TOY, heads=4, ffn=64, tied=False, biases=False)["total"]
    return model_state_formula(
        params, "megatron", zero=1, dp=4, pp=4, stage_layers=stage_layers, stage=stage,
        **stage_shape(BRIDGE_TOY["vocab"], BRIDGE_TOY["hidden"], BRIDGE_TOY["layers"], tied=False),
    )  # fmt: skip


def test_the_heaviest_uneven_stage_equals_megatron_bridges():
    """Bridge's test asserts 9,952 parameters and 89,568 bytes on the heaviest stage: the last, 3 layers of 3,072
    weights and two 2h LayerNorms each, the final LayerNorm and the 32 x 16 head."""
    assert 3 * (3072 + 4 * 16) + 2 * 16 + 32 * 16 == 9952
    assert states(bridge_toy_states(BRIDGE_UNEVEN)) == 89568 == 9 * 9952
    assert states(bridge_toy_states(BRIDGE_UNEVEN, stage=3)) == 89568
    first = 3072 + 4 * 16 + 32 * 16  # one layer and the embedding
    assert states(bridge_toy_states(BRIDGE_UNEVEN, stage=0)) == 9 * first
    even = 2 * 3072 + (2 * 8 + 1) * 2 * 16 / 4 + 32 * 16  # Megatron-LM's even split: the norms spread evenly
    assert states(bridge_toy_states(())) == 9 * even


def test_memory_formula_takes_the_stages_from_the_layout():
    """The same through a layout, with the activations: the busiest stage is the one whose states and activations
    add up to the most, and its states are Bridge's 9 x 9,952 bytes when it is the last."""
    layout = Layout(pp=4, dp=4, zero=1, stage_layers=BRIDGE_UNEVEN, micro_batch=2)
    params = transformer_params(**BRIDGE_TOY, heads=4, ffn=64, tied=False, biases=False)["total"]
    got = memory_formula(params, "megatron", layout, seq=8, heads=4, ffn=64, tied=False, **BRIDGE_TOY)
    assert got["stage"] == "last" and states(got) == 89568


def test_the_memory_command_shows_each_uneven_stage(tmp_path, capsys):
    """``memory --stage-layers``: each stage's bytes, the busiest named; on Bridge's toy model (its parameter count,
    untied, 8 layers) the last stage's states are Bridge's 9 x 9,952 bytes."""
    from course_lib.cli import main

    params = transformer_params(**BRIDGE_TOY, heads=4, ffn=64, tied=False, biases=False)["total"]
    toy = ["--params", str(params), "--layers", "8", "--hidden", "16", "--vocab", "32", "--untied", "--ffn", "64"]
    toy += ["--heads", "4", "--seq", "8", "--micro-batch", "2"]
    out = tmp_path / "memory.json"
    argv = ["memory", *toy, "--precision", "megatron", "--zero", "1", "--dp", "4", "--pp", "4"]
    assert main([*argv, "--stage-layers", "1,2,2,3", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["stage_layers"] == [1, 2, 2, 3]
    assert [s["stage"] for s in got["bytes_per_stage"]] == ["first", "stage 1", "stage 2", "last"]
    assert states(got["bytes_per_stage"][3]) == 89568 and got["bytes_per_device"]["stage"] == "last"
    text = capsys.readouterr().out
    assert "bytes on the busiest GPU (the last pipeline stage)" in text
    assert re.search(r"last +3 +0\.000 .*<- busiest", text)
    # with the activations a middle stage can be the busiest, and is named so
    dims = ["--params", "1e6", "--layers", "8", "--hidden", "4096", "--heads", "32", "--seq", "2048"]
    assert main(["memory", *dims, "--pp", "4", "--stage-layers", "1,2,2,3"]) == 0
    assert "bytes on the busiest GPU (pipeline stage 1)" in capsys.readouterr().out


# Bridge's MoE test on the same stages (its test_moe_model_state_estimate_uses_layer_pattern_on_uneven_pipeline_stages,
# NVIDIA-NeMo/Megatron-Bridge at 067f987): 2 routed experts of FFN 32 in the layers moe_layer_freq marks, no shared
# expert, no router counted; a dense layer keeps its GELU MLP of 2 x 16 x 64 = 2,048 parameters.
BRIDGE_MOE_PATTERN = (False, True, False, False, True, False, True, True)
BRIDGE_DENSE_MLP = 2 * 16 * 64
BRIDGE_EXPERTS = 4 * 2 * (2 * 16 * 32)  # 4 MoE layers of 2 experts


def test_a_pattern_of_moe_layers_on_uneven_stages_equals_megatron_bridges():
    """Bridge asserts 5,856 dense and 4,096 routed parameters on the heaviest stage: the last, layers 5 (dense), 6
    and 7 (MoE): 3 x (1,024 attention + 64 norm) + 2,048 MLP + the final norm 32 + the 512 head; 2 x 2,048 experts.
    Its distributed optimizer over DP 4 (and over the 4 expert-data-parallel ranks) makes 9 bytes a parameter."""
    dense = transformer_params(**BRIDGE_TOY, heads=4, ffn=64, tied=False, biases=False)["total"]
    dense -= BRIDGE_MOE_PATTERN.count(True) * BRIDGE_DENSE_MLP  # the MoE layers hold experts instead
    shape = stage_shape(BRIDGE_TOY["vocab"], BRIDGE_TOY["hidden"], BRIDGE_TOY["layers"], tied=False)
    pattern = {"moe_pattern": BRIDGE_MOE_PATTERN, "dense_mlp": BRIDGE_DENSE_MLP}
    rows = stage_params(
        dense, 4, shape["embedding_params"], False, shape["replicated_params"], BRIDGE_UNEVEN, shape["final_norm"],
        **pattern,
    )  # fmt: skip
    assert [split + whole for split, whole in rows] == [3136 + 512, 4224, 4224, 5856]
    assert stage_expert_params(BRIDGE_EXPERTS, 4, BRIDGE_UNEVEN, BRIDGE_MOE_PATTERN) == [0, 2048, 2048, 4096]
    got = model_state_formula(
        dense + BRIDGE_EXPERTS, "megatron", zero=1, dp=4, pp=4, expert_params=BRIDGE_EXPERTS,
        stage_layers=BRIDGE_UNEVEN, **pattern, **shape,
    )  # fmt: skip
    assert states(got) == 9 * (5856 + 4096)
    # Without the pattern every layer would hold the same share: the last stage 3/8 of the experts, 3,072.
    spread = stage_expert_params(BRIDGE_EXPERTS, 4, BRIDGE_UNEVEN)
    assert spread[-1] == 3072


@pytest.mark.parametrize(
    ("pattern", "words"),
    [((True,) * 7, "gives 7 layers a flag, not the model's 8"), ((False,) * 8, "has no MoE layer")],
)
def test_a_moe_pattern_that_does_not_fit_is_refused(pattern, words):
    layout = Layout(pp=4, stage_layers=BRIDGE_UNEVEN)
    with pytest.raises(ValueError, match=words):
        memory_formula(
            1e6, "mixed", layout, layers=8, seq=8, hidden=16, heads=4, expert_params=1e5, moe_pattern=pattern
        )


def test_an_uneven_middle_stage_can_hold_the_most_activations():
    """1F1B: stage i of p keeps p - i microbatches in flight (Narayanan et al. 2021), so with layers (1, 2, 2, 3)
    the second stage keeps 3 x 2 layers against the first's 4 x 1 and the last's 3 x 1: 6 layers' activations
    (a small model, whose weights do not decide), below the even split's first stage, 4 x 2 layers and the inputs."""
    s, b, h, a = 2048, 1, 4096, 32
    got = memory_formula(1e6, "mixed", Layout(pp=4, stage_layers=BRIDGE_UNEVEN), layers=8, seq=s, hidden=h, heads=a)
    assert got["stage"] == "stage 1"
    assert got["activations"] == 6 * activation_bytes_per_layer(s, b, h, a)
    even = memory_formula(1e6, "mixed", Layout(pp=4), layers=8, seq=s, hidden=h, heads=a)
    assert even["stage"] == "first"
    assert even["activations"] == 8 * activation_bytes_per_layer(s, b, h, a) + 4 * (8 * s * b + s * b * h)


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        (Layout(pp=4, stage_layers=(2, 2, 4)), "each of the 4 pipeline stages at least one layer"),
        (Layout(pp=4, stage_layers=(0, 3, 2, 3)), "each of the 4 pipeline stages at least one layer"),
        (Layout(pp=4, stage_layers=(1, 2, 2, 2)), "add up to 7 layers, not 8"),
        (Layout(pp=4, chunks=2, stage_layers=(2, 2, 2, 2)), "one model chunk per stage"),
    ],
)
def test_uneven_stages_that_do_not_fit_are_refused(layout, words):
    with pytest.raises(ValueError, match=words):
        memory_formula(1e9, "mixed", layout, layers=8, seq=2048, hidden=4096, heads=32)
