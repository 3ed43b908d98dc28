"""Where a model's parameters sit on a pipeline: each stage's layers, even or uneven (Megatron-LM's first- and
last-stage layer counts, BLOOM's embedding and head counted as layers), their dense parameters and the routed experts
of their mixture-of-experts layers (a per-layer pattern of dense and MoE layers), the embedding and head on the end
stages and the norm weights every TP rank keeps; a stage in words. :mod:`course_lib.model.formulas` turns them into
bytes; Megatron-LM's and Megatron-Bridge's estimators count the same (``tests/test_memory_references.py``)."""

from __future__ import annotations

from course_lib.model.config import NORMS


def even_counts(n: int, parts: int) -> list[int]:
    """``n`` split into ``parts`` counts as even as they go, the longer ones first."""
    return [n // parts + (i < n % parts) for i in range(parts)]


def stage_params(
    dense: float,
    pp: int,
    embedding: float = 0.0,
    tied: bool = True,
    replicated: float = 0.0,
    stage_layers: tuple[int, ...] = (),
    final_norm: float = 0.0,
    moe_pattern: tuple[bool, ...] = (),
    dense_mlp: float = 0.0,
) -> list[tuple[float, float]]:
    """Dense parameters of each pipeline stage, first to last: (those tensor parallelism splits, those every TP
    rank keeps whole). The first stage also holds the input embedding (``embedding`` = V x h) and the last the
    output head, its own matrix when untied or a copy of the embedding when tied (Megatron-LM keeps one to sum
    their gradients), so with ``pp`` > 1 each end stage holds its layers plus one V x h matrix, and with ``pp`` = 1
    the one stage holds both matrices when untied.

    Even stages (``stage_layers`` empty) share the layers and the ``replicated`` weights (LayerNorm) evenly, as
    Megatron-LM's ``theoretical_memory_usage.py`` does; for a large vocabulary the end stages are well above an even
    split (Llama-3-8B at PP 4: 2.27B against 2.01B). Uneven stages (``stage_layers``, the layers of each stage)
    hold their layers' share of both, the ``final_norm`` (part of ``replicated``) on the last stage, as
    Megatron-Bridge's estimator counts them (its PP 4 test with layers (1, 2, 2, 3): 9,952 on the last stage).

    ``moe_pattern``, which layers are mixture-of-experts layers (Megatron-core's ``moe_layer_freq`` as a list;
    DeepSeek-V3's first 3 dense): on uneven stages a dense layer holds ``dense_mlp`` parameters more than an MoE
    layer outside its routed experts (its MLP against the shared experts and the router), so each stage holds its
    own layers' (Bridge's MoE test on the same stages: 5,856 dense parameters on the last). Even stages share them
    evenly, as Bridge's estimator does."""
    matrices = 1 if tied else 2
    layers = dense - matrices * embedding - replicated
    if layers < 0:
        raise ValueError(
            f"the embeddings ({matrices} x {embedding:g}) and replicated weights ({replicated:g}) are more than the "
            f"{dense:g} dense parameters: check the vocabulary and the parameter count"
        )
    if pp == 1:
        return [(layers + matrices * embedding, replicated)]
    counts, final = stage_layers or (1,) * pp, final_norm if stage_layers else 0.0
    total = sum(counts)
    shares = [layers * n / total for n in counts]
    if stage_layers and moe_pattern:
        base = (layers - dense_mlp * moe_pattern.count(False)) / len(moe_pattern)  # an MoE layer's
        moe = stage_moe_layers(stage_layers, moe_pattern)
        shares = [n * base + dense_mlp * (n - k) for n, k in zip(counts, moe, strict=True)]
    return [
        (share + embedding * (i in (0, pp - 1)), (replicated - final) * n / total + final * (i == pp - 1))
        for i, (share, n) in enumerate(zip(shares, counts, strict=True))
    ]


def stage_moe_layers(stage_layers: tuple[int, ...], moe_pattern: tuple[bool, ...]) -> list[int]:
    """The mixture-of-experts layers of each pipeline stage of ``stage_layers`` (consecutive layers, first to
    last), by ``moe_pattern``, one flag a layer."""
    ends = [sum(stage_layers[: i + 1]) for i in range(len(stage_layers))]
    return [sum(moe_pattern[end - n : end]) for n, end in zip(stage_layers, ends, strict=True)]


def stage_expert_params(
    expert_params: float, pp: int, stage_layers: tuple[int, ...] = (), moe_pattern: tuple[bool, ...] = ()
) -> list[float]:
    """Routed-expert parameters of each pipeline stage: their share of the MoE layers, those of ``moe_pattern``
    when the stages are uneven (Megatron-Bridge's MoE test, layers (1, 2, 2, 3) with the pattern 0,1,0,0,1,0,1,1:
    4,096 on the last), else each stage's share of the layers (an even split: the same on every stage)."""
    counts = stage_layers or (1,) * pp
    if stage_layers and moe_pattern:
        counts = stage_moe_layers(stage_layers, moe_pattern)
    return [expert_params * n / sum(counts) for n in counts]


def check_stage_layers(pp: int, stage_layers: tuple[int, ...], layers: int | None = None) -> None:
    """Refuse uneven stages that are not one positive count of layers per pipeline stage (adding up to ``layers``
    when it is known), saying why."""
    if not stage_layers:
        return
    if len(stage_layers) != pp:
        raise ValueError(
            f"stage_layers {tuple(stage_layers)} give {len(stage_layers)} stages, not {pp}: give each of the {pp} "
            "pipeline stages at least one layer"
        )
    if min(stage_layers) < 1:
        raise ValueError(
            f"stage_layers {tuple(stage_layers)} must give each of the {pp} pipeline stages at least one layer"
        )
    if layers is not None and sum(stage_layers) != layers:
        raise ValueError(f"stage_layers {tuple(stage_layers)} add up to {sum(stage_layers)} layers, not {layers}")


def check_moe_pattern(moe_pattern: tuple[bool, ...], layers: int | None, expert_params: float) -> None:
    """Refuse a pattern of MoE layers that is not one flag a layer (of ``layers`` when known), or that has no MoE
    layer while there are routed experts to place, saying why."""
    if not moe_pattern:
        return
    if layers is not None and len(moe_pattern) != layers:
        raise ValueError(f"the MoE pattern gives {len(moe_pattern)} layers a flag, not the model's {layers}")
    if expert_params and not any(moe_pattern):
        raise ValueError("the MoE pattern has no MoE layer to hold the routed experts: mark at least one")


def stage_shape(vocab: int, hidden: int, layers: int, tied: bool = True, norm: str = "layernorm") -> dict:
    """:func:`model_state_formula`'s keywords for where the parameters sit (:func:`stage_params`): the V x h
    embedding, tied or not, and the norm weights every TP rank keeps (two per layer and a final one, which uneven
    stages put on the last)."""
    return {
        "embedding_params": vocab * hidden,
        "tied": tied,
        "replicated_params": (2 * layers + 1) * NORMS[norm] * hidden if layers else 0,
        "final_norm": NORMS[norm] * hidden if layers else 0,
    }


def stage_name(stage: int, pp: int) -> str:
    """A pipeline stage in words: ``all`` without a pipeline, ``first``, ``last``, or ``stage i`` (from 0)."""
    if pp == 1:
        return "all"
    return "first" if stage == 0 else "last" if stage == pp - 1 else f"stage {stage}"
