"""How the learner's batch is cut into microbatches (learner/batch.py `make_microbatches`)."""

import numpy as np

from moe_grpo.learner.batch import LearnerSequence, make_microbatches


def _seqs(lengths):
    return [LearnerSequence(np.arange(n) % 50, prompt_len=2, advantage=float(i)) for i, n in enumerate(lengths)]


def _cut(seqs, same_shape):
    return make_microbatches(seqs, list(range(len(seqs))), micro_batch_size=4, pad_multiple=2, packed=False,
                             with_routing=False, moe_layers=1, top_k=1, same_shape=same_shape)


def test_without_pipeline_stages_a_few_long_sequences_pad_only_their_own_microbatch():
    """Twelve sequences, two of them 500 tokens: every microbatch was padded to 500 positions (and a user's steps
    took 30-40 s where the short prompts alone took 1 s). Without pipeline stages they are taken shortest first and
    each microbatch is padded to its own longest; every sequence is in exactly one place, with its own tokens."""
    lengths = [9, 500, 7, 12, 8, 10, 11, 500, 6, 9, 13, 7]
    seqs = _seqs(lengths)
    ragged = _cut(seqs, same_shape=False)
    assert [tuple(mb.input_ids.shape) for mb in ragged] == [(4, 8), (4, 10), (4, 500)]  # positions: length - 1
    assert sum(mb.input_ids.numel() for mb in ragged) < 0.4 * sum(mb.input_ids.numel() for mb in _cut(seqs, True))
    placed = sorted(idx for mb in ragged for idx, *_ in mb.spans)
    assert placed == list(range(12))
    for mb in ragged:
        for idx, row, start, end in mb.spans:
            assert (mb.input_ids[row, start:end].numpy() == seqs[idx].tokens[:-1]).all()
            assert (mb.advantages[row, start:end] == idx).all()
    same = _cut(seqs, same_shape=True)
    assert {tuple(mb.input_ids.shape) for mb in same} == {(4, 500)}, "pipeline schedules keep one shape"
