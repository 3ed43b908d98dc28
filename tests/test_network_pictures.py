"""The topology pictures: one dot per GPU, highlighted groups in their colour, the links' rates and the
oversubscription written where a student reads them, a torus' wrap-around links drawn, bad input refused."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from course_lib.cluster.topology import from_spec  # noqa: E402
from course_lib.ui.network_pictures import GPU_FACE, HIGHLIGHTS, draw_topology  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def gpu_colors(fig) -> dict[int, str]:
    """Each GPU's dot colour, by the index in its gid; fails if a GPU is drawn twice."""
    dots = [a for a in fig.axes[0].get_children() if (a.get_gid() or "").startswith("gpu:")]
    colors = {int(d.get_gid().split(":")[1]): to_hex(d.get_markerfacecolor()) for d in dots}
    assert len(colors) == len(dots)
    return colors


def texts(fig) -> list[str]:
    ax = fig.axes[0]
    return [t.get_text() for t in ax.texts] + [t.get_text() for t in ax.get_legend().get_texts()] + [ax.get_title()]


def wraps(fig, gid: str = "wrap") -> int:
    return sum(p.get_gid() == gid for p in fig.axes[0].patches)


@pytest.mark.parametrize(
    "spec,groups",
    [
        ("h100-superpod:2", {"TP group": [0, 1, 2, 3], "far": [15]}),
        ("gb200-nvl72:1", {"EP group": list(range(40, 72))}),
        ("tpu-v5p:4x4x4", {"ring": [1, 5, 9, 13], "plane": list(range(48, 64))}),
        ("tpu-v5p:4x4", {"row": [4, 5, 6, 7]}),
    ],
)
def test_one_dot_per_gpu_and_the_highlight_colours_exactly_its_groups(spec, groups):
    topo = from_spec(spec)
    fig = draw_topology(topo, highlight=groups)
    colors = gpu_colors(fig)
    assert sorted(colors) == list(range(topo.n_gpus))
    expected = {g: to_hex(HIGHLIGHTS[i]) for i, gpus in enumerate(groups.values()) for g in gpus}
    assert colors == {g: expected.get(g, to_hex(GPU_FACE)) for g in range(topo.n_gpus)}
    assert set(groups) <= set(texts(fig))


def test_a_fat_tree_names_its_links_rates_and_writes_the_oversubscription_on_each_uplink():
    topo = from_spec("ethernet-2to1:4")  # two leaves of two 8-GPU nodes, 2:1 above them
    labels = texts(fig := draw_topology(topo))
    assert "NVLink 450 GB/s per GPU each way" in labels
    assert "NIC 50 GB/s per GPU each way" in labels
    assert "leaf uplink 400 GB/s each way = 16 NICs x 50 GB/s / 2 (2:1 oversubscribed)" in labels
    assert labels.count("2:1") == 2 and {"leaf 0", "leaf 1"} <= set(labels)
    assert "node 3: GPUs 24-31" in labels and len(fig.axes[0].lines) > topo.n_gpus  # the dots and their links


def test_rails_get_their_own_leaves_and_a_rack_its_compact_grid():
    rails = texts(draw_topology(from_spec("h100-superpod:2")))
    assert {f"leaf rail {r}" for r in range(8)} <= set(rails) and any("colour: rail" in t for t in rails)
    rack = draw_topology(from_spec("gb200-nvl72:1"))
    assert "72 leaf switches, one per rail" in texts(rack) and "rack 0: GPUs 0-71" in texts(rack)
    ys = {round(line.get_ydata()[0], 6) for line in rack.axes[0].lines if (line.get_gid() or "").startswith("gpu")}
    assert len(ys) == 6  # 72 GPUs as 6 rows of 12, not one row


@pytest.mark.parametrize(
    "spec,arcs,layer_wrap",
    [("tpu-v5p:4x4", 8, 0), ("tpu-v5p:2x4", 2, 0), ("tpu-v5p:4x4x4", 32, 1), ("tpu-v5p:8", 1, 0)],
)
def test_a_torus_draws_every_wrap_around_link_and_its_rate(spec, arcs, layer_wrap):
    # A ring of k > 2 chips has one wrap-around cable; a ring of two has only its one cable, drawn as a link.
    fig = draw_topology(from_spec(spec))
    assert wraps(fig) == arcs and wraps(fig, "wrap-layers") == layer_wrap
    assert "100 GB/s per link each way" in fig.axes[0].get_title()


@pytest.mark.parametrize(
    "spec,highlight,message",
    [
        ("h100-superpod:2", {"TP": [0, 16]}, "do not fit"),
        ("h100-superpod:2", {"TP": [0, 1], "DP": [1, 9]}, "GPU 1 is in two highlighted groups"),
        ("tpu-v5p:2x2x2x2", {}, "tori of 1, 2 or 3 axes"),
        ("tpu-v5p:4x4", {f"group {g}": [g] for g in range(7)}, "7 highlighted groups, but only 6 colours"),
    ],
)
def test_bad_input_is_one_clear_line(spec, highlight, message):
    with pytest.raises(ValueError, match=message) as err:
        draw_topology(from_spec(spec), highlight=highlight)
    assert "\n" not in str(err.value)
