"""Write it yourself: the core of four schemes, as functions for you to write (notebook 10).

Each function below is a stub: its docstring says exactly what to compute, and its body raises
``NotImplementedError``. Write your own version with the same signature (in the notebook, or in a file of your
own) and pass it to the matching check of :mod:`course_lib.practice.write_it_check`, which runs it against one device or
the course's own code and answers with what it measured and a hint. The model solutions are kept apart, in
``exercises/answers/write_it.py``: read them after your own has passed.

1. :func:`ring_all_reduce`: the ring all-reduce from point-to-point sends, on real ranks (Patarasuk & Yuan 2009).
2. :func:`one_f_one_b`: the 1F1B pipeline schedule as a table of time steps (Narayanan et al. 2021, §2.1).
3. :func:`dispatch_counts`: how many token rows each rank sends each rank in expert parallelism (Lepikhin et al.
   2020, §2.2; Fedus et al. 2021, §2.2 for capacity).
4. :func:`merge_partials`: ring attention's merge of two partial attentions by their log-sum-exps (Dao et al.
   2022, §3.1; Liu et al. 2023, §3).
"""

from __future__ import annotations

import torch

Partial = tuple[torch.Tensor, torch.Tensor]  # (attention output normalised over its keys, log-sum-exp of the scores)


def ring_all_reduce(tensor: torch.Tensor) -> None:
    """Sum ``tensor`` over every rank of the world, in place, as ``dist.all_reduce(tensor)`` does, by the ring.

    Runs on every rank at once (the check starts them). n = the world size, r = this rank; ``tensor`` is contiguous
    and its number of elements a multiple of n. Cut it into n equal chunks along its flattened elements, chunk c
    being elements c S/n .. (c+1) S/n - 1, and let every rank talk only to its neighbours: it sends to rank
    (r + 1) mod n and receives from rank (r - 1) mod n, one chunk per step, 2(n - 1) steps:

    * reduce-scatter, steps k = 0 .. n-2: send chunk (r - k) mod n; add the chunk that arrives into your chunk
      (r - k - 1) mod n. Afterwards chunk (r + 1) mod n holds the sum over all ranks.
    * all-gather, steps k = 0 .. n-2: send chunk (r + 1 - k) mod n; store (not add) the chunk that arrives as your
      chunk (r - k) mod n. Afterwards every chunk holds the sum.

    Each rank then sends 2(n-1) chunks of S/n bytes: 2(n-1)/n S, whatever n is.

    Use only the point-to-point calls of :mod:`course_lib.ledgers.comm`, called as ``comm.send``, ``comm.recv``,
    ``comm.isend`` and ``comm.irecv``: those of ``torch.distributed``, with the same arguments, recorded on the
    ledger so the check can count your bytes and read your messages. No collective. Careful: gloo's blocking
    ``send`` waits until the peer receives, so if every rank sends first, every rank waits for ever; post the send
    with ``comm.isend``, receive with ``comm.recv``, then ``wait()`` the send's handle.
    """
    raise NotImplementedError("write the ring all-reduce: n-1 reduce-scatter steps, then n-1 all-gather steps")


def one_f_one_b(stages: int, microbatches: int) -> list[list[str]]:
    """The 1F1B pipeline schedule of ``stages`` = p stages and ``microbatches`` = m microbatches, as a table of time
    steps: ``table[s][t]`` is what stage s does at step t: ``"F3"`` (the forward of microbatch 3), ``"B3"`` (its
    backward), or ``""`` (idle). One op per cell; a forward and a backward each take one step.

    Every stage runs the forward and the backward of every microbatch once. A forward of microbatch i on stage s
    needs stage s-1's forward of i at an earlier step (stage 0 needs nothing); a backward of i on stage s needs
    stage s+1's backward of i at an earlier step (the last stage: its own forward of i).

    1F1B's order (Narayanan et al. 2021, §2.1, PipeDream-Flush): stage s runs min(p-s-1, m) warm-up forwards, then
    one forward, one backward, ... while forwards remain, then the remaining backwards, microbatches in order; each
    op at the earliest step its input and its stage allow. So stage s never holds more than p-s microbatches'
    activations (forward done, backward not yet), and the table is 2(m+p-1) steps long: each stage idles 2(p-1) of
    them, a bubble of (p-1)/(m+p-1).

    Write it without :mod:`course_lib.parallel.schedules`.
    """
    raise NotImplementedError("write the 1F1B table: warm-up forwards, one forward one backward, the last backwards")


def dispatch_counts(choices: list[torch.Tensor], experts: int, capacity_factor: float | None = None) -> list[list[int]]:
    """The token rows each rank sends each rank when a mixture-of-experts layer dispatches its tokens.

    n = ``len(choices)`` ranks hold the ``experts`` = E experts in blocks: rank d holds experts d E/n .. (d+1) E/n - 1
    (E is a multiple of n). ``choices[r]`` is rank r's router's choice, a (tokens, k) tensor of expert ids: row t is
    the k different experts of rank r's token t, in token order. Every (token, expert) pair is one row sent to the
    rank holding that expert, so a token whose two experts live on the same rank is sent there twice, and a row
    whose expert is on its own rank stays (it counts on the diagonal).

    ``capacity_factor`` None keeps every pair. A number caps each expert at C = ceil(T k / E x capacity_factor)
    pairs, T the tokens of all ranks together (Fedus et al. 2021, §2.2): the batch is rank 0's tokens, then rank
    1's, ..., and an expert keeps its first C pairs in that order and drops the rest, which are not sent.

    Return ``counts[src][dst]``, an n x n table (a list of lists or a tensor) of the rows rank src sends rank dst.
    """
    raise NotImplementedError("count the rows: one per (token, expert) pair, to the rank that holds the expert")


def merge_partials(a: Partial, b: Partial) -> Partial:
    """Two partial attentions of the same queries over disjoint sets of keys, merged into the attention over their
    union, as ring attention merges each K/V block it receives (Dao et al. 2022, §3.1; Liu et al. 2023, §3).

    Each partial is ``(out, lse)``: ``out`` (..., queries, head_dim) is softmax(scores) @ values over its own keys
    alone, normalised over them; ``lse`` (..., queries, 1) is the log-sum-exp of those scores, log sum_j e^(s_j).
    Return the same pair for the union: its log-sum-exp, and its output, each partial's output weighted by the
    share of the softmax's mass its keys hold. In float64 it must match attention over all the keys at once to
    1e-10, also when the scores are in the hundreds (e^800 overflows float64).
    """
    raise NotImplementedError("merge the log-sum-exps, then reweight each partial output by its share")
